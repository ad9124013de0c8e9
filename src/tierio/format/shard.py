"""Checkpoint shard files: one safetensors file per rank, laid out for one large aligned write.

A shard is staged as a single contiguous host buffer holding the header and the data section, so
persisting it is one big O_DIRECT write and promoting it is a byte copy. Every tensor is split
along its first dimension into chunks of at most ``CHUNK_BYTES`` for checksums: a corrupt copy is
reported down to the chunk, and global offsets stay meaningful for later resharding.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Collection
from dataclasses import dataclass

import torch

from tierio.errors import FormatError
from tierio.format.manifest import ChunkInfo, TensorInfo
from tierio.format.safetensors import Header, build_header, dtype_name, itemsize
from tierio.io.checksum import xxh3_ranges

CHUNK_BYTES = 64 << 20
FORMAT_VERSION = "1"

STEP_DIGITS = 9
RANK_DIGITS = 5
_STEP_RE = re.compile(r"step_(\d{9})")
MANIFEST = "manifest.json"


def step_dir(step: int) -> str:
    """'step_000000100'."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**STEP_DIGITS:
        raise FormatError(f"checkpoint step must be an integer in 0..{10**STEP_DIGITS - 1}, got {step!r}")
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int) -> str:
    return f"rank_{rank:0{RANK_DIGITS}d}.safetensors"


def _check_token(token: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{1,16}", token):
        raise FormatError(f"token {token!r} must be 1-16 lowercase hex digits")
    return token


def fragment_name(rank: int, token: str) -> str:
    """A rank's marker that it copied its files of a step to a slower tier (promotion). ``token``
    names the copy, so a marker some other copy left behind is never counted."""
    return f"rank_{rank:0{RANK_DIGITS}d}.{_check_token(token)}.json"


def record_name(rank: int, token: str, digest: str) -> str:
    """A rank's record (its manifest entry), written once its shard is durable. ``token`` names the
    run writing it, so a committer never takes a record some other run left behind; ``digest`` is
    the record's xxh3, so a committer knows it from a listing alone."""
    if not re.fullmatch(r"[0-9a-f]{16}", digest):
        raise FormatError(f"record digest {digest!r} must be 16 lowercase hex digits")
    return f"rank_{rank:0{RANK_DIGITS}d}.{_check_token(token)}.{digest}.json"


_RECORD_RE = re.compile(r"rank_(\d{5})\.([0-9a-f]{1,16})\.([0-9a-f]{16})\.json")


@dataclass(frozen=True)
class RecordName:
    rank: int
    token: str
    digest: str


def parse_record_name(name: str) -> RecordName | None:
    m = _RECORD_RE.fullmatch(name)
    return RecordName(int(m.group(1)), m.group(2), m.group(3)) if m else None


def manifest_key(step: int) -> str:
    return f"{step_dir(step)}/{MANIFEST}"


def shard_key(step: int, rank: int) -> str:
    return f"{step_dir(step)}/{shard_name(rank)}"


def fragment_key(step: int, rank: int, token: str) -> str:
    return f"{step_dir(step)}/{fragment_name(rank, token)}"


def step_key(step: int, name: str) -> str:
    """The key of file ``name`` of a step."""
    return f"{step_dir(step)}/{name}"


@dataclass(frozen=True)
class ChunkSpec:
    """A run of whole rows of one tensor: file bytes [begin, end) hold local rows [row0, row0+rows)."""

    begin: int  # absolute file offset
    end: int
    row0: int
    rows: int
    shape: tuple[int, ...]


@dataclass
class ShardLayout:
    header_bytes: bytes
    header: Header
    total_bytes: int
    chunks: dict[str, list[ChunkSpec]]

    def span(self, name: str) -> tuple[int, int]:
        """Absolute file byte range of a tensor."""
        e = self.header.tensors[name]
        return self.header.data_offset + e.begin, self.header.data_offset + e.end


def split_rows(shape: tuple[int, ...], itemsize: int, begin: int, chunk_bytes: int = CHUNK_BYTES) -> list[ChunkSpec]:
    """Chunk a tensor stored at absolute offset ``begin`` along dim 0."""
    nbytes = math.prod(shape) * itemsize
    if len(shape) == 0 or nbytes == 0 or nbytes <= chunk_bytes:
        return [ChunkSpec(begin, begin + nbytes, 0, shape[0] if shape else 1, tuple(shape))]
    row = nbytes // shape[0]
    per = max(1, chunk_bytes // row)
    out = []
    for r in range(0, shape[0], per):
        n = min(per, shape[0] - r)
        out.append(ChunkSpec(begin + r * row, begin + (r + n) * row, r, n, (n, *shape[1:])))
    return out


def plan_shard(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> ShardLayout:
    """Lay out a shard: header (padded so data starts at a multiple of 64) then tensors by element size."""
    meta = {"format": "tierio", "tierio.version": FORMAT_VERSION}
    meta.update(metadata or {})
    hdr, header = build_header(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()), meta)
    chunks = {}
    for name, e in header.tensors.items():
        chunks[name] = split_rows(e.shape, tensors[name].dtype.itemsize, header.data_offset + e.begin, chunk_bytes)
    return ShardLayout(hdr, header, header.data_offset + header.data_bytes, chunks)


def plan_subset(layout: ShardLayout, names: Collection[str], chunk_bytes: int = CHUNK_BYTES) -> ShardLayout:
    """The layout of a shard holding only the tensors ``names`` of ``layout``, with the same header
    metadata (an incremental save's shard: the tensors that changed). Chunks split as in ``layout``."""
    specs = [(n, e.dtype, e.shape) for n, e in layout.header.tensors.items() if n in names]
    hdr, header = build_header(specs, layout.header.metadata)
    chunks = {name: split_rows(e.shape, itemsize(e.dtype), header.data_offset + e.begin, chunk_bytes)
              for name, e in header.tensors.items()}
    return ShardLayout(hdr, header, header.data_offset + header.data_bytes, chunks)


def staging_view(buf_u8: torch.Tensor, begin: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed view of bytes [begin, end) of a uint8 tensor (no copy)."""
    piece = buf_u8[begin:end]
    if dtype != torch.uint8:
        piece = piece.view(dtype)
    return piece.view(shape)


def stage_into(layout: ShardLayout, tensors: dict[str, torch.Tensor], buf_u8: torch.Tensor,
               stream=None, names: Collection[str] | None = None, header: bool = True) -> None:
    """Copy the header and every tensor into the staging buffer (a uint8 tensor of >= total bytes).

    CPU tensors are copied with torch's parallel copy; CUDA tensors with non_blocking copies on
    ``stream`` (the caller synchronizes). Non-contiguous tensors are gathered by the copy itself.
    ``names`` / ``header`` stage a part (an overlapped save copies small tensors first, the rest behind).
    """
    if header:
        n = len(layout.header_bytes)
        buf_u8[:n].copy_(torch.frombuffer(bytearray(layout.header_bytes), dtype=torch.uint8))
    for name, e in layout.header.tensors.items():
        if e.nbytes == 0 or (names is not None and name not in names):
            continue
        t = tensors[name]
        off = layout.header.data_offset
        dst = staging_view(buf_u8, off + e.begin, off + e.end, t.dtype, tuple(t.shape))
        if t.is_cuda and stream is not None:
            with torch.cuda.stream(stream):
                dst.copy_(t, non_blocking=True)
        else:
            dst.copy_(t)


@dataclass(frozen=True)
class Placement:
    """Where a tensor of a shard lies in the tensor it is part of: a global tensor's slice
    starts at ``offsets`` of ``shape``; a rank's own tensor is whole (offsets 0, its own shape)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    is_global: bool = True


def describe(layout: ShardLayout, view: memoryview | ShardBytes, file: str,
             places: dict[str, Placement] | None = None) -> dict[str, TensorInfo]:
    """The manifest description of a shard: every chunk with its byte range, its global offsets
    and the xxh3 of its bytes in ``view`` (the staged shard, or its ShardBytes). Tensors missing
    from ``places`` are the rank's own."""
    places = places or {}
    ranges = [(c.begin, c.end) for name in layout.header.tensors for c in layout.chunks[name]]
    sums = iter(xxh3_ranges(view, ranges))
    out: dict[str, TensorInfo] = {}
    for name, e in layout.header.tensors.items():
        p = places.get(name) or Placement((0,) * len(e.shape), e.shape, False)
        chunks = []
        for c in layout.chunks[name]:
            offsets = (p.offsets[0] + c.row0, *p.offsets[1:]) if e.shape else ()
            chunks.append(ChunkInfo(file, c.begin, c.end, offsets, c.shape, next(sums)))
        out[name] = TensorInfo(name, e.dtype, p.shape, chunks, p.is_global)
    return out


class ShardBytes:
    """A shard's bytes straight from the tensors it holds (no staging copy): ``parts`` is what a
    writer writes in order, and slicing by file offsets gives the bytes of any chunk (a chunk never
    spans two tensors). Only for contiguous CPU tensors that stay unchanged until written."""

    def __init__(self, layout: ShardLayout, tensors: dict[str, torch.Tensor]) -> None:
        self.parts: list[memoryview] = [memoryview(layout.header_bytes)]
        self._starts: list[int] = [0]
        for name, e in layout.header.tensors.items():
            if e.nbytes == 0:
                continue
            t = tensors[name]
            if t.device.type != "cpu" or not t.is_contiguous():
                raise FormatError(f"tensor {name!r} must be a contiguous CPU tensor to be written unstaged")
            self._starts.append(layout.header.data_offset + e.begin)
            self.parts.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B"))

    def __getitem__(self, s: slice) -> memoryview:
        i = bisect.bisect_right(self._starts, s.start) - 1
        base = self._starts[i]
        return self.parts[i][s.start - base : s.stop - base]
