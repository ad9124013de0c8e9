"""Build indexed token datasets from streams of documents; merge several into one.

Every input is read as an iterator of documents (or of :class:`DocumentBatch`, many documents at
once, as Parquet row groups come), so a corpus of any size is built with memory bounded by one
document or batch plus the index (12 bytes per document). When the vocabulary size is
not known up front the tokens are written as int32 and narrowed to uint16 at the end if every
id fits, in one streaming pass: the smallest fitting dtype either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.data.indexed import (
    UINT16_VOCAB_LIMIT,
    IndexedDataset,
    IndexedDatasetWriter,
    bin_path,
    idx_path,
    optimal_dtype,
    strip_suffix,
)
from tierio.data.documents import DocumentBatch, load_tokenizer
from tierio.data.remote_pair import RemoteOptions
from tierio.io.files import os_error
from tierio.io.lustre import StripeApplied, StripeOptions, apply_stripe, stripe_options


@dataclass
class BuildStats:
    prefix: str
    documents: int
    sequences: int
    tokens: int
    dtype: str
    max_token_id: int
    bin_bytes: int
    idx_bytes: int
    stripe: StripeApplied | None = None   # the layout given to the dataset's directory (Lustre), if any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- inputs ---------------------------------------------------------------------------------

def _lines(p: Path, text: bool) -> Iterator[tuple[int, str | bytes]]:
    """(line number, line) for every non-blank line; a file that cannot be opened is a typed error."""
    try:
        f = open(p, encoding="utf-8") if text else open(p, "rb")
    except OSError as exc:
        raise os_error(exc, p, "opening") from exc
    lineno = 0
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
        except UnicodeDecodeError:
            raise FormatError(f"{p}:{lineno + 1}: not UTF-8 text") from None


def iter_jsonl_tokens(path: str | Path, key: str = "tokens") -> Iterator[np.ndarray]:
    """Documents from JSON Lines: each line a list of ids, or an object with ``key`` -> list."""
    p = Path(path)
    for lineno, line in _lines(p, text=False):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:  # also integers over 4300 digits, deep nesting, bad UTF-8
            raise FormatError(f"{p}:{lineno}: not valid JSON ({exc}); each line must be one document") from None
        if isinstance(obj, dict):
            if key not in obj:
                raise FormatError(f"{p}:{lineno}: object has no {key!r} field; pass --key with the field holding token ids")
            obj = obj[key]
        if not isinstance(obj, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in obj):
            raise FormatError(f"{p}:{lineno}: expected a list of integer token ids")
        try:
            yield np.asarray(obj, dtype=np.int64)
        except OverflowError:
            raise FormatError(f"{p}:{lineno}: a token id does not fit a 64-bit integer") from None


def iter_npy_docs(path: str | Path) -> Iterator[np.ndarray]:
    """Documents from a .npy file: a 1-D array is one document, a 2-D array one per row."""
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"{p} does not exist")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:  # a truncated file is an EOFError or a short mapping
        raise FormatError(f"{p}: not a plain numeric .npy array ({exc})") from None
    if arr.dtype.kind not in "iu":
        raise FormatError(f"{p}: token arrays must be integers, got {arr.dtype}")
    if arr.ndim == 1:
        yield arr
    elif arr.ndim == 2:
        for row in arr:
            yield row
    else:
        raise FormatError(f"{p}: expected a 1-D (one document) or 2-D (one per row) array, got shape {arr.shape}")


def iter_text_docs(
    path: str | Path, tokenizer_json: str | Path, text_key: str = "text", append_eos: int | None = None,
    batch: int = 256,
) -> Iterator[np.ndarray]:
    """Tokenize raw text: ``.jsonl`` with a ``text_key`` field, or plain text with one document per line."""
    tok = load_tokenizer(tokenizer_json)
    p = Path(path)

    def texts() -> Iterator[str]:
        for lineno, line in _lines(p, text=True):
            if p.suffix == ".jsonl":
                try:
                    obj = json.loads(line)
                    text = obj[text_key]
                except (ValueError, RecursionError, KeyError, TypeError, IndexError):
                    text = None
                if not isinstance(text, str):
                    raise FormatError(f"{p}:{lineno}: expected a JSON object with a {text_key!r} string")
                yield text
            else:
                yield line.rstrip("\n")

    pending: list[str] = []
    for text in texts():
        pending.append(text)
        if len(pending) == batch:
            yield from _encode(tok, pending, append_eos)
            pending = []
    if pending:
        yield from _encode(tok, pending, append_eos)


def _encode(tok, texts: list[str], append_eos: int | None) -> Iterator[np.ndarray]:
    # Only the ids are kept: tokenizers >= 0.20 can skip computing each token's character offsets.
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    for enc in encode(texts):
        ids = enc.ids  # a fresh list per call
        if append_eos is not None:
            ids.append(append_eos)
        yield np.asarray(ids, dtype=np.int64)


def iter_input(
    path: str | Path, *, key: str = "tokens", tokenizer: str | Path | None = None, text_key: str = "text",
    append_eos: int | None = None,
) -> Iterator[np.ndarray]:
    """Pick the reader for ``path``: .npy, JSONL of ids, or text/JSONL text when a tokenizer is given."""
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"input {p} does not exist")
    if tokenizer is not None:
        return iter_text_docs(p, tokenizer, text_key=text_key, append_eos=append_eos)
    if p.suffix == ".npy":
        return iter_npy_docs(p)
    if p.suffix in (".jsonl", ".json"):
        docs = iter_jsonl_tokens(p, key=key)
        if append_eos is None:
            return docs
        return (np.append(d, append_eos) for d in docs)
    raise ConfigError(f"{p}: unknown input type {p.suffix!r}; use .jsonl (token ids), .npy, .parquet, or text with --tokenizer")


def iter_inputs(paths: Sequence[str | Path], *, parquet: Any = None, progress: Any = None, declared: int | None = None,
                **options: Any) -> Iterator[Any]:
    """Documents of several inputs in order. Parquet files and directories of them are read with
    ``parquet`` (a :class:`tierio.data.parquet.ParquetColumns`, reporting to ``progress``, holding
    every id to ``declared`` when given); the other inputs with :func:`iter_input` and ``options``."""
    from tierio.data.parquet import iter_parquet  # pyarrow only for Parquet input

    if _parquet_inputs(paths):
        if parquet is None:
            raise ConfigError("Parquet input needs a column: --column COLUMN (token-id lists) or "
                              "--text-column COLUMN --tokenizer tokenizer.json")
        yield from iter_parquet(paths, parquet, progress, declared)
        return
    for path in paths:
        yield from iter_input(path, **options)


def _parquet_inputs(paths: Sequence[str | Path]) -> bool:
    from tierio.data.parquet import is_parquet

    if not paths:
        raise ConfigError("no input given; name at least one input file or directory")
    kinds = [is_parquet(p) for p in paths]
    if any(kinds) and not all(kinds):
        raise ConfigError("Parquet inputs cannot be mixed with other kinds in one build; build them separately and merge")
    return all(kinds)


def build_inputs(paths: Sequence[str | Path], prefix: str | Path, *, vocab_size: int | None = None, parquet: Any = None,
                 progress: Any = None, stripe: str | StripeOptions | None = "auto", **options: Any) -> BuildStats:
    """Build ``prefix`` from input files (what `tierio data build` runs). For Parquet token-id lists
    whose column statistics give the largest id, the token dtype is sized from them up front: one
    pass over the tokens instead of writing int32 and narrowing afterwards.

    ``stripe="auto"``: the dataset's directory, on Lustre, is striped over every OST at 4 MiB first
    (the stats say what was applied); ``"off"`` leaves its layout alone."""
    applied = stripe_dataset_dir(prefix, stripe)
    dtype, declared = None, None
    if vocab_size is None and parquet is not None and _parquet_inputs(paths):
        from tierio.data.parquet import declared_max

        declared = declared_max(paths, parquet)
        if declared is not None:
            eos = parquet.append_eos if parquet.append_eos is not None else -1
            dtype = optimal_dtype(max(declared, eos) + 1)
    docs = iter_inputs(paths, parquet=parquet, progress=progress, declared=declared, **options)
    built = build_indexed(docs, prefix, vocab_size=vocab_size, dtype=dtype)
    built.stripe = applied
    return built


def stripe_dataset_dir(prefix: str | Path, stripe: str | StripeOptions | None) -> StripeApplied | None:
    """Stripe the directory ``prefix.bin`` will be written in, before it is (a layout is fixed at create)."""
    opts = stripe_options(stripe)
    directory = Path(prefix).absolute().parent
    if opts is None or not directory.is_dir():
        return None
    return apply_stripe(str(directory), opts)


# -- building -------------------------------------------------------------------------------

def build_indexed(
    documents: Iterable[Any], prefix: str | Path, *, vocab_size: int | None = None, dtype: Any = None,
) -> BuildStats:
    """Write ``documents`` (each a 1-D sequence of token ids) as ``prefix.bin`` + ``prefix.idx``.

    dtype: explicit token dtype; else derived from ``vocab_size`` (uint16 below 65,500); else
    int32 while streaming, narrowed to uint16 at the end when the largest id allows it.
    """
    narrow_later = dtype is None and vocab_size is None
    dt = np.dtype(dtype) if dtype is not None else (optimal_dtype(vocab_size) if vocab_size else np.dtype(np.int32))
    max_id = -1
    with IndexedDatasetWriter(prefix, dtype=dt) as w:
        for doc in documents:
            if isinstance(doc, DocumentBatch):
                max_id = max(max_id, _check_ids(doc.tokens, vocab_size, lambda i, b=doc: b.locate(b.document_of(i))))
                w.add_documents(doc.tokens, doc.lengths)
                continue
            arr = np.asarray(doc)
            max_id = max(max_id, _check_ids(arr, vocab_size, lambda i, n=w.documents: f"document {n}"))
            w.add_document(arr)
        # narrowed before the pair is published: the old dataset stays until the new one is whole
        w.finalize(np.uint16 if narrow_later and max_id < UINT16_VOCAB_LIMIT else None)
    return _stats(prefix, max_id)


def _check_ids(arr: np.ndarray, vocab_size: int | None, where: Callable[[int], str]) -> int:
    """The largest id of ``arr``, after checking every id is in range (``where(i)`` names token i's place)."""
    if not arr.size or arr.dtype.kind not in "iu":
        return -1  # empty, or not integers: the writer refuses the latter with its own message
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        i = int(np.argmax(arr < 0))
        raise FormatError(f"{where(i)}: negative token id {int(arr[i])}; token ids start at 0")
    if vocab_size is not None and hi >= vocab_size:
        i = int(np.argmax(arr >= vocab_size))
        raise FormatError(f"{where(i)}: token id {int(arr[i])} >= vocabulary size {vocab_size}")
    return hi


def _stats(prefix: str | Path, max_id: int | None) -> BuildStats:
    """What a build or merge wrote (``max_id`` None: read it from the tokens)."""
    ds = IndexedDataset(prefix)
    try:
        if max_id is None:
            max_id = int(ds.flat_tokens().max()) if ds.num_tokens else -1
        return BuildStats(
            prefix=str(prefix), documents=ds.num_documents, sequences=len(ds), tokens=ds.num_tokens,
            dtype=str(ds.dtype), max_token_id=max_id,
            bin_bytes=bin_path(prefix).stat().st_size, idx_bytes=idx_path(prefix).stat().st_size,
        )
    finally:
        ds.close()


def merge_indexed(inputs: list[str | Path], prefix: str | Path) -> BuildStats:
    """Concatenate several datasets (same dtype) into one, documents in input order."""
    if not inputs:
        raise ConfigError("merge needs at least one input dataset")
    prefixes = [strip_suffix(p) for p in inputs]
    if strip_suffix(prefix) in prefixes:
        raise ConfigError(f"merge output {prefix} is also an input; choose a new output prefix")
    first = IndexedDataset(prefixes[0])
    dt, mm = first.dtype, first.sequence_modes is not None
    first.close()
    with IndexedDatasetWriter(prefix, dtype=dt, multimodal=mm) as w:
        for p in prefixes:
            w.add_index(p)
    return _stats(prefix, None)


def inspect_indexed(prefix: str | Path) -> dict[str, Any]:
    """Counts, dtype and length distribution of a dataset (reads only the index, also of a
    dataset on a store: its .bin is then never fetched)."""
    ds = IndexedDataset(prefix, remote=RemoteOptions(bin_reads="ranges"))
    try:
        lens = ds.document_lengths()
        q = np.percentile(lens, [50, 90, 99]) if len(lens) else np.zeros(3)
        return {
            "prefix": ds.prefix,
            "dtype": str(ds.dtype),
            "sequences": len(ds),
            "documents": ds.num_documents,
            "tokens": ds.num_tokens,
            "multimodal": ds.sequence_modes is not None,
            "bin_bytes": ds.num_tokens * ds.dtype.itemsize,
            "idx_bytes": ds.index_bytes,
            "doc_len_mean": float(lens.mean()) if len(lens) else 0.0,
            "doc_len_p50": float(q[0]),
            "doc_len_p90": float(q[1]),
            "doc_len_p99": float(q[2]),
            "doc_len_max": int(lens.max()) if len(lens) else 0,
            "fingerprint": ds.fingerprint(),
        }
    finally:
        ds.close()
