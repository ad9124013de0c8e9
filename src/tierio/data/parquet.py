"""Parquet input for dataset builds: a column of token-id lists, or a text column tokenized locally.

Files are read one row group at a time, at most ``batch_rows`` rows at once, and only the one
column asked for, so memory stays bounded by a batch whatever the size of the files. A batch of
token lists goes to the builder as one :class:`~tierio.data.builder.DocumentBatch` (one write for
thousands of documents). Every problem (a missing column, a column of the wrong type, a null, a
damaged file) is a FormatError naming the file, the row group and the row.

Needs ``pyarrow`` (``pip install 'tierio[parquet]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierio.data.documents import DocumentBatch, load_tokenizer
from tierio.errors import ConfigError, FormatError, NotFoundError

DEFAULT_BATCH_ROWS = 16384


@dataclass(frozen=True)
class ParquetColumns:
    """Which column to read: ``ids`` (lists of integer token ids) or ``text`` (strings, tokenized
    with the local ``tokenizer``.json; ``append_eos`` is added to every document either way)."""

    ids: str | None = None
    text: str | None = None
    tokenizer: str | Path | None = None
    append_eos: int | None = None
    batch_rows: int = DEFAULT_BATCH_ROWS

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.text is None):
            raise ConfigError("name one Parquet column: --column COLUMN (lists of token ids) or "
                              "--text-column COLUMN --tokenizer tokenizer.json (text)")
        if self.text is not None and self.tokenizer is None:
            raise ConfigError(f"--text-column {self.text} needs --tokenizer tokenizer.json to turn the text into token ids")
        if self.ids is not None and self.tokenizer is not None:
            raise ConfigError(f"--column {self.ids} holds token ids already; --tokenizer applies to --text-column only")
        if self.batch_rows < 1:
            raise ConfigError(f"batch_rows must be at least 1, got {self.batch_rows}")

    @property
    def name(self) -> str:
        return self.ids if self.ids is not None else str(self.text)


@dataclass(frozen=True)
class ParquetProgress:
    """Where a Parquet build is, reported after every row group."""

    file: str
    file_index: int  # 0-based
    files: int
    row_group: int  # 0-based, the one just finished
    row_groups: int  # in this file
    rows: int  # documents so far, all files
    tokens: int  # tokens so far, all files


Progress = Callable[[ParquetProgress], None]


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet input needs pyarrow, which is not installed: pip install 'tierio[parquet]' "
                          "(or pip install pyarrow)") from None
    return pa, pq


def is_parquet(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() or p.suffix.lower() in (".parquet", ".pq")


def parquet_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The Parquet files named: files as given, directories as every ``*.parquet`` below them (sorted)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*.parquet") if f.is_file())
            if not found:
                raise NotFoundError(f"directory {p} holds no .parquet files; pass the files or the directory that has them")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise NotFoundError(f"input {p} does not exist")
    return files


class _Where:
    """Names the row of a document in a batch: file, row group, row in the group and in the file."""

    def __init__(self, path: Path, group: int, first_in_group: int, group_start: int) -> None:
        self.path, self.group, self.first, self.start = path, group, first_in_group, group_start

    def __call__(self, i: int) -> str:
        row = self.first + i
        return f"{self.path}: row group {self.group}, row {row} (row {self.start + row} of the file)"


def _open(pq: Any, path: Path, columns: ParquetColumns) -> Any:
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise FormatError(f"{path}: not a readable Parquet file ({exc})") from None
    if columns.name not in schema.names:
        raise FormatError(f"{path}: no column {columns.name!r}; its columns are {schema.names[:20]}")
    return pf


def _check_type(pa: Any, path: Path, columns: ParquetColumns, dtype: Any) -> None:
    if columns.ids is not None:
        lists = pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype)
        if not lists or not pa.types.is_integer(dtype.value_type):
            hint = " (text: use --text-column with --tokenizer)" if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) else ""
            raise FormatError(f"{path}: column {columns.ids!r} is {dtype}; --column needs lists of integer token ids{hint}")
    elif not (pa.types.is_string(dtype) or pa.types.is_large_string(dtype)):
        raise FormatError(f"{path}: column {columns.text!r} is {dtype}; --text-column needs strings "
                          "(token-id lists: use --column)")


def _null_row(arr: Any) -> int:
    return int(np.argmax(arr.is_null().to_numpy(zero_copy_only=False)))


def declared_max(files: Sequence[str | Path], columns: ParquetColumns) -> int | None:
    """The largest token id the files' column statistics declare (metadata only, nothing decoded);
    None when a row group has no statistics or the column is not a token-id list."""
    if columns.ids is None:
        return None
    _, pq = _pyarrow()
    top = -1
    for path in parquet_files(files):
        meta = _open(pq, path, columns).metadata
        leaves = [j for j in range(meta.num_columns) if meta.schema.column(j).path.split(".")[0] == columns.ids]
        if len(leaves) != 1:
            return None
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(leaves[0]).statistics
            if stats is None or not stats.has_min_max or not isinstance(stats.max, int):
                return None
            top = max(top, stats.max)
    return top


def _id_batch(pa: Any, arr: Any, where: _Where, append_eos: int | None, declared: int | None) -> DocumentBatch:
    """A batch of token-id lists as one DocumentBatch (no per-document Python work)."""
    if arr.null_count:
        raise FormatError(f"{where(_null_row(arr))}: null instead of a list of token ids; drop or fill such rows first")
    if pa.types.is_fixed_size_list(arr.type):
        lengths = np.full(len(arr), arr.type.list_size, dtype=np.int64)
    else:
        offsets = arr.offsets.to_numpy()
        lengths = np.diff(offsets).astype(np.int64, copy=False)
    values = arr.flatten()
    if values.null_count:
        first = _null_row(values)
        doc = int(np.searchsorted(np.cumsum(lengths), first, side="right"))
        raise FormatError(f"{where(doc)}: a null token id inside the list; drop or fill such rows first")
    tokens = values.to_numpy(zero_copy_only=False)
    if declared is not None and tokens.size and int(tokens.max()) > declared:
        i = int(np.argmax(tokens > declared))
        doc = int(np.searchsorted(np.cumsum(lengths), i, side="right"))
        raise FormatError(f"{where(doc)}: token id {int(tokens[i])} is above {declared}, the largest id the files' "
                          "column statistics declare; the metadata is wrong: rewrite the file (e.g. with pyarrow)")
    if append_eos is not None:
        tokens, lengths = _append(tokens, lengths, append_eos)
    return DocumentBatch(tokens, lengths, where)


def _append(tokens: np.ndarray, lengths: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """Insert ``eos`` after every document of a concatenated batch."""
    ends = np.cumsum(lengths)
    out = np.insert(tokens.astype(np.int64, copy=False), ends, eos)
    return out, lengths + 1


def _text_batch(arr: Any, where: _Where, tokenizer: Any, append_eos: int | None) -> DocumentBatch:
    if arr.null_count:
        raise FormatError(f"{where(_null_row(arr))}: null instead of text; drop or fill such rows first")
    encoded = tokenizer.encode_batch(arr.to_pylist())
    lengths = np.fromiter((len(e.ids) for e in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.fromiter((t for e in encoded for t in e.ids), dtype=np.int64, count=int(lengths.sum()))
    if append_eos is not None:
        tokens, lengths = _append(tokens, lengths, append_eos)
    return DocumentBatch(tokens, lengths, where)


def iter_parquet(files: Sequence[str | Path], columns: ParquetColumns, progress: Progress | None = None,
                 declared: int | None = None) -> Iterator[DocumentBatch]:
    """Batches of documents from ``files`` in order, one row group after another. ``declared``:
    the largest id the statistics promise (the build sized its token dtype by it): enforced."""
    pa, pq = _pyarrow()
    paths = parquet_files(files)
    tokenizer = load_tokenizer(columns.tokenizer) if columns.text is not None else None
    rows = tokens = 0
    for index, path in enumerate(paths):
        pf = _open(pq, path, columns)
        _check_type(pa, path, columns, pf.schema_arrow.field(columns.name).type)
        meta = pf.metadata
        start = 0
        for group in range(meta.num_row_groups):
            first = 0
            try:
                for batch in pf.iter_batches(batch_size=columns.batch_rows, row_groups=[group], columns=[columns.name]):
                    where = _Where(path, group, first, start)
                    arr = batch.column(0)
                    docs = (_id_batch(pa, arr, where, columns.append_eos, declared) if tokenizer is None
                            else _text_batch(arr, where, tokenizer, columns.append_eos))
                    rows, tokens, first = rows + len(arr), tokens + len(docs.tokens), first + len(arr)
                    yield docs
            except (OSError, pa.ArrowException) as exc:  # a damaged page or row group
                raise FormatError(f"{path}: row group {group} cannot be read ({exc})") from None
            start += meta.row_group(group).num_rows
            if progress is not None:
                progress(ParquetProgress(str(path), index, len(paths), group, meta.num_row_groups, rows, tokens))
