"""Sequence packing: whole documents into ``seq_len`` bins, planned fast, stored as an index.

Planning works on document *lengths* only, window by window (bounded memory, so it streams
over a corpus of any size). Inside a window documents are sorted by decreasing length and
processed in groups of equal length, which is what makes best-fit decreasing cheap:

* For identical items of length L, best fit puts the next item in the open bin with the
  smallest remaining capacity r >= L. After placing it that bin has r - L left, which is
  still the smallest capacity >= L if it is >= L at all, so that bin takes floor(r / L) items
  in a row and drops to r mod L. A whole group is therefore placed by walking capacity
  *buckets* upward from L, each bucket giving each of its bins floor(r / L) items; whole
  buckets move at once to bucket r mod L. The work per group is one step per bucket touched,
  not per document; bins move as lists (C speed).
* First-fit decreasing has the same structure with bins ordered by creation instead of by
  capacity: one vectorised pass over the window's open bins per group.

The plan is stored as a CSR index (pack offsets + document ids), so pack ``i`` is the same
documents in the same order every time: resuming at step ``k`` is exact.

Each pack yields ``input_ids``, ``labels`` (the next token inside the same document; -100 on
each document's last token and on padding, so no token learns to predict across a boundary),
``position_ids`` restarting at 0 in every document, and ``cu_seqlens`` / ``max_seqlen`` in the
``flash_attn_varlen_func`` convention (padding, if any, is one last segment so that
``cu_seqlens[-1] == seq_len``).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tierio.data.binpack import bfd_window, ffd_window
from tierio.data.position import EpochSplit, Positioned
from tierio.data.tar import decode_npy
from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.io.durable import atomic_write
from tierio.io.paths import open_regular
from tierio.io.untrusted import Fields, check_float, check_int, loads, parser

ALGORITHMS = ("bfd", "ffd")
DEFAULT_WINDOW = 1 << 18  # documents planned together; bounds memory, barely affects fill
IGNORE_INDEX = -100
PLAN_FORMAT = "tierio-pack-plan"
PLAN_VERSION = 1


# -- planning -------------------------------------------------------------------------------

@dataclass
class PackStats:
    seq_len: int
    algorithm: str
    documents: int
    packs: int
    real_tokens: int  # tokens placed in packs
    source_tokens: int  # tokens in the documents before truncation
    truncated_docs: int
    fill: float  # real tokens / (packs * seq_len)
    truncation: float  # tokens cut / source tokens
    tokens_per_pack_mean: float
    tokens_per_pack_cv: float  # std / mean of real tokens per pack
    tokens_per_step_cv: float | None = None  # same, per batch of `batch_size` packs
    batch_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PackPlan:
    """Which documents form each pack: ``doc_ids[pack_offsets[i]:pack_offsets[i+1]]``."""

    seq_len: int
    algorithm: str
    window: int
    pack_offsets: np.ndarray  # int64[packs + 1]
    doc_ids: np.ndarray  # int64[documents], global document indices
    doc_lengths: np.ndarray  # int32[documents], tokens used per document (after truncation)
    source: dict[str, Any] = field(default_factory=dict)  # fingerprint of the dataset planned
    stats: PackStats | None = None

    def __len__(self) -> int:
        return len(self.pack_offsets) - 1

    def pack(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(document ids, lengths used) of pack ``i``."""
        a, b = int(self.pack_offsets[i]), int(self.pack_offsets[i + 1])
        return self.doc_ids[a:b], self.doc_lengths[a:b]

    def pack_tokens(self) -> np.ndarray:
        """Real tokens per pack (int64)."""
        csum = np.zeros(len(self.doc_lengths) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths, out=csum[1:])
        return csum[self.pack_offsets[1:]] - csum[self.pack_offsets[:-1]]

    def step_stats(self, batch_size: int) -> float:
        """Coefficient of variation of real tokens per step of ``batch_size`` packs."""
        per_pack = self.pack_tokens()
        steps = len(per_pack) // batch_size
        if steps < 2:
            return 0.0
        per_step = per_pack[: steps * batch_size].reshape(steps, batch_size).sum(axis=1)
        return float(per_step.std() / per_step.mean())


def plan_packing(
    lengths: Sequence[int] | np.ndarray,
    seq_len: int,
    *,
    algorithm: str = "bfd",
    window: int = DEFAULT_WINDOW,
    batch_size: int | None = None,
    source: dict[str, Any] | None = None,
) -> PackPlan:
    """Plan packs for documents of the given lengths (document i has ``lengths[i]`` tokens).

    Documents longer than ``seq_len`` are truncated to ``seq_len`` (counted in the stats);
    empty documents are skipped. Documents are planned ``window`` at a time.
    """
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown packing algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
    if window < 1:
        raise ConfigError(f"window must be >= 1 document, got {window}")
    lens_all = np.asarray(lengths, dtype=np.int64)
    if lens_all.ndim != 1:
        raise ConfigError("lengths must be a 1-D array of document lengths")
    if len(lens_all) and int(lens_all.min()) < 0:
        raise ConfigError("document lengths must be >= 0")
    fit = bfd_window if algorithm == "bfd" else ffd_window
    offsets_parts: list[np.ndarray] = []
    ids_parts: list[np.ndarray] = []
    packs = 0
    placed = 0
    for start in range(0, len(lens_all), window):
        raw = lens_all[start : start + window]
        keep = np.flatnonzero(raw > 0)
        used = np.minimum(raw[keep], seq_len)
        if not len(keep):
            continue
        bin_of, nb = fit(used, seq_len)
        # group the window's documents by bin, keeping each bin's placement order (longest first)
        by_bin = np.argsort(bin_of, kind="stable")
        counts = np.bincount(bin_of, minlength=nb)
        ids_parts.append(keep[by_bin] + start)
        offsets_parts.append(np.cumsum(counts) + placed)
        placed += len(keep)
        packs += nb
    pack_offsets = np.concatenate([np.zeros(1, dtype=np.int64), *offsets_parts]) if offsets_parts else np.zeros(1, dtype=np.int64)
    doc_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, dtype=np.int64)
    doc_lengths = np.minimum(lens_all[doc_ids], seq_len).astype(np.int32)
    plan = PackPlan(seq_len, algorithm, window, pack_offsets.astype(np.int64), doc_ids.astype(np.int64), doc_lengths, dict(source or {}))
    plan.stats = compute_stats(plan, lens_all, batch_size)
    return plan


def compute_stats(plan: PackPlan, source_lengths: np.ndarray, batch_size: int | None = None) -> PackStats:
    real = int(plan.doc_lengths.sum(dtype=np.int64))
    src = int(np.asarray(source_lengths, dtype=np.int64).sum())
    per_pack = plan.pack_tokens()
    packs = len(plan)
    mean = float(per_pack.mean()) if packs else 0.0
    return PackStats(
        seq_len=plan.seq_len,
        algorithm=plan.algorithm,
        documents=len(plan.doc_ids),
        packs=packs,
        real_tokens=real,
        source_tokens=src,
        truncated_docs=int(np.count_nonzero(np.asarray(source_lengths) > plan.seq_len)),
        fill=real / (packs * plan.seq_len) if packs else 0.0,
        truncation=(src - real) / src if src else 0.0,
        tokens_per_pack_mean=mean,
        tokens_per_pack_cv=float(per_pack.std() / mean) if packs and mean else 0.0,
        tokens_per_step_cv=plan.step_stats(batch_size) if batch_size else None,
        batch_size=batch_size,
    )


# -- storing the plan (an index: exact resume) -----------------------------------------------

def save_plan(plan: PackPlan, path: str | Path) -> Path:
    """Write the plan as an .npz of plain arrays (no pickle), atomically."""
    final = Path(path)
    meta = {
        "format": PLAN_FORMAT, "version": PLAN_VERSION, "seq_len": plan.seq_len, "algorithm": plan.algorithm,
        "window": plan.window, "source": plan.source, "stats": plan.stats.to_dict() if plan.stats else None,
    }
    buf = io.BytesIO()
    np.savez(
        buf, pack_offsets=plan.pack_offsets, doc_ids=plan.doc_ids, doc_lengths=plan.doc_lengths,
        meta=np.frombuffer(json.dumps(meta, allow_nan=False).encode(), dtype=np.uint8),
    )
    atomic_write(final, [buf.getbuffer()], direct=False)
    return final


MAX_PLAN_META = 1 << 20
_PLAN_ARRAYS = {"pack_offsets": np.int64, "doc_ids": np.int64, "doc_lengths": np.int32, "meta": np.uint8}
_STATS_INTS = ("seq_len", "documents", "packs", "real_tokens", "source_tokens", "truncated_docs")
_STATS_FLOATS = ("fill", "truncation", "tokens_per_pack_mean", "tokens_per_pack_cv")


def load_plan(path: str | Path) -> PackPlan:
    """Read a plan written by :func:`save_plan`; a damaged or foreign file is a FormatError."""
    p = Path(path)
    try:
        fd = open_regular(p)  # a FIFO is refused, not waited on
    except FileNotFoundError:
        raise NotFoundError(f"pack plan {p} does not exist; create it with `tierio data pack`") from None
    except OSError as exc:
        raise FormatError(f"cannot read pack plan {p}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        return parse_plan(f, str(p))


@parser
def parse_plan(f: BinaryIO, where: str) -> PackPlan:
    """The plan in an open .npz ``f``: every array is checked against the bytes that hold it
    before it is read, and the arrays against each other."""
    try:
        arrays = _plan_arrays(f, where)
    except (zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError, ValueError) as exc:
        # zipfile's own refusals: an encrypted member is a RuntimeError, an unknown method NotImplementedError
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{where}: not a readable pack plan ({exc}); re-create it with `tierio data pack`") from None
    doc = Fields(loads(arrays["meta"].tobytes(), f"{where}: meta", limit=MAX_PLAN_META), f"{where}: meta")
    if doc.doc.get("format") != PLAN_FORMAT or doc.doc.get("version") != PLAN_VERSION:
        raise FormatError(f"{where}: not a {PLAN_FORMAT} v{PLAN_VERSION} file")
    seq_len = doc.int("seq_len", 1, 1 << 31)
    algorithm = doc.const("algorithm", *ALGORITHMS)
    window = doc.int("window", 1)
    source = doc.obj("source", default=None)
    stats = doc.obj("stats", default=None)
    offsets, ids, lens = arrays["pack_offsets"], arrays["doc_ids"], arrays["doc_lengths"]
    if (
        len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(ids)
        or len(ids) != len(lens) or (len(offsets) > 1 and bool(np.any(np.diff(offsets) < 0)))
    ):
        raise FormatError(f"{where}: pack offsets are inconsistent with the document list; the file is corrupt")
    if len(ids) and int(ids.min()) < 0:
        raise FormatError(f"{where}: a document id is negative; the file is corrupt")
    if len(lens) and (int(lens.max()) > seq_len or int(lens.min()) < 1):
        raise FormatError(f"{where}: a document length lies outside 1..seq_len; the file is corrupt")
    return PackPlan(seq_len, algorithm, window, offsets, ids, lens, {} if source is None else source.doc,
                    None if stats is None else _stats(stats))


def _plan_arrays(f: BinaryIO, where: str) -> dict[str, np.ndarray]:
    """The 1-D arrays of a plan. Members must be stored, not compressed (np.savez stores them), so
    a member holds no more than the bytes of the file: no decompression bomb, nothing allocated
    from a shape the bytes do not back."""
    out = {}
    with zipfile.ZipFile(f) as z:
        for name, dtype in _PLAN_ARRAYS.items():
            try:
                info = z.getinfo(f"{name}.npy")
            except KeyError:
                raise FormatError(f"{where}: not a pack plan (no {name} array); re-create it with `tierio data pack`") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise FormatError(f"{where}: array {name} is compressed; pack plans store their arrays uncompressed")
            with z.open(info) as m:
                raw = m.read()
            arr = decode_npy(raw, what=f"{where}: array {name}")
            if arr.dtype != np.dtype(dtype) or arr.ndim != 1:
                raise FormatError(f"{where}: array {name} is {arr.dtype} of shape {arr.shape}, expected a 1-D {np.dtype(dtype)} array")
            out[name] = arr
    return out


def _stats(doc: Fields) -> PackStats:
    w = doc.where
    ints = {k: doc.int(k) for k in _STATS_INTS}
    floats = {k: doc.float(k, 0.0) for k in _STATS_FLOATS}
    step_cv = doc.doc.get("tokens_per_step_cv")
    batch = doc.doc.get("batch_size")
    return PackStats(
        algorithm=doc.const("algorithm", *ALGORITHMS), **ints, **floats,
        tokens_per_step_cv=None if step_cv is None else check_float(step_cv, f"{w}: tokens_per_step_cv", 0.0),
        batch_size=None if batch is None else check_int(batch, f"{w}: batch_size", 1),
    )


# -- materialising packs ---------------------------------------------------------------------

def build_pack(
    docs: Sequence[np.ndarray], seq_len: int, pad_id: int = 0,
) -> dict[str, np.ndarray | int]:
    """One packed sample from its documents' tokens (each already <= seq_len, total <= seq_len)."""
    lens = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    total = int(lens.sum())
    if total > seq_len:
        raise ConfigError(f"documents of {total} tokens do not fit seq_len {seq_len}")
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    if docs:
        np.concatenate(docs, out=input_ids[:total], casting="unsafe")
    return _pack_fields(input_ids, lens, seq_len)


def _pack_fields(input_ids: np.ndarray, lens: np.ndarray, seq_len: int) -> dict[str, np.ndarray | int]:
    total = int(lens.sum())
    pad = seq_len - total
    seg = np.concatenate([lens, [pad]]) if pad else lens
    starts = np.zeros(len(seg), dtype=np.int64)
    np.cumsum(seg[:-1], out=starts[1:])
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    labels[: seq_len - 1] = input_ids[1:]
    ends = starts[: len(lens)] + lens - 1  # last token of each document predicts nothing
    labels[ends[lens > 0]] = IGNORE_INDEX
    labels[total:] = IGNORE_INDEX
    position_ids = np.arange(seq_len, dtype=np.int64) - np.repeat(starts, seg)
    cu = np.zeros(len(seg) + 1, dtype=np.int32)
    np.cumsum(seg, out=cu[1:])
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seqlens": cu,
        "max_seqlen": int(seg.max()) if len(seg) else 0,
        "num_tokens": total,
    }


def pack_from_tokens(tokens: np.ndarray, seqlens: np.ndarray, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray | int]:
    """A packed sample from concatenated document tokens and their lengths (the shard layout)."""
    lens = np.asarray(seqlens, dtype=np.int64)
    total = int(lens.sum())
    if total != len(tokens) or total > seq_len:
        raise FormatError(f"pack of {len(tokens)} tokens does not match its document lengths (sum {total}, seq_len {seq_len})")
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    input_ids[:total] = tokens
    return _pack_fields(input_ids, lens, seq_len)


class PackedDataset(Positioned):
    """Map-style dataset of packs: ``ds[i]`` materialises this rank's pack ``i`` of ``plan`` from ``dataset``.

    ``dataset`` is an IndexedDataset; packs read whole documents through zero-copy views of
    its mapping. The plan must have been made for this dataset (checked by fingerprint). Rank
    ``r`` of ``world_size`` takes packs ``r, r + world_size, ...``; the position is global
    (``state_dict``/``load_state_dict``, see ``tierio.data.position``).
    """

    def __init__(self, dataset, plan: PackPlan, pad_id: int = 0, check_source: bool = True, *,
                 rank: int = 0, world_size: int = 1) -> None:
        self.dataset = dataset
        self.plan = plan
        self.pad_id = pad_id
        fp = plan.source.get("fingerprint")
        if check_source and fp and fp != dataset.fingerprint():
            raise FormatError(
                f"pack plan was made for dataset {plan.source.get('prefix', '?')} (fingerprint {fp}), "
                f"not {dataset.prefix} ({dataset.fingerprint()}); re-plan with `tierio data pack`"
            )
        if len(plan.doc_ids) and int(plan.doc_ids.max()) >= dataset.num_documents:
            raise FormatError(f"pack plan names document {int(plan.doc_ids.max())} but {dataset.prefix} has {dataset.num_documents}")
        self._doc_offsets = dataset.document_offsets()
        self.split = EpochSplit(len(plan), rank, world_size, "strided")

    def position_identity(self) -> dict[str, Any]:
        return {"kind": "packs", "dataset": self.plan.source.get("fingerprint") or self.dataset.fingerprint(),
                "packs": len(self.plan), "seq_len": self.plan.seq_len}

    def _documents(self, i: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Zero-copy views of this rank's pack ``i``'s documents, and their lengths."""
        ids, lens = self.plan.pack(self.global_index(i))
        flat = self.dataset.flat_tokens()
        return [flat[s : s + n] for s, n in zip(self._doc_offsets[ids].tolist(), lens.tolist())], lens

    def pack_tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(concatenated tokens, per-document lengths) of pack ``i`` in the dataset's dtype."""
        docs, lens = self._documents(i)
        tokens = np.asarray(docs[0]) if len(docs) == 1 else np.concatenate(docs)
        return tokens, lens.astype(np.int32)

    def __getitem__(self, i: int) -> dict[str, np.ndarray | int]:
        docs, _ = self._documents(i)  # copied once, straight into the padded sample
        return build_pack(docs, self.plan.seq_len, self.pad_id)

    def __iter__(self) -> Iterator[dict[str, np.ndarray | int]]:
        for i in range(len(self)):
            yield self[i]


def collate_packed(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack packs into a batch; ``cu_seqlens`` covers the batch flattened to one row of B*S tokens."""
    import torch

    seq_len = len(batch[0]["input_ids"])
    out = {k: torch.from_numpy(np.stack([b[k] for b in batch])) for k in ("input_ids", "labels", "position_ids")}
    cu = [np.asarray(batch[0]["cu_seqlens"], dtype=np.int32)]
    for n, b in enumerate(batch[1:], 1):
        cu.append(np.asarray(b["cu_seqlens"][1:], dtype=np.int32) + n * seq_len)
    out["cu_seqlens"] = torch.from_numpy(np.concatenate(cu))
    out["max_seqlen"] = max(int(b["max_seqlen"]) for b in batch)
    out["num_tokens"] = sum(int(b["num_tokens"]) for b in batch)
    return out


def block_diagonal_mask(cu_seqlens, total_len: int | None = None, causal: bool = True):
    """Boolean [T, T] mask (True = may attend) that keeps attention inside each segment.

    For ordinary (non-varlen) attention over a packed row: pass the pack's ``cu_seqlens``;
    with ``causal`` the mask is also lower-triangular.
    """
    import torch

    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    T = int(cu[-1]) if total_len is None else total_len
    seg = torch.searchsorted(cu[1:], torch.arange(T), right=True)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= torch.ones(T, T, dtype=torch.bool).tril()
    return mask
