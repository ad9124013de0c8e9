"""The checkpoint manifest: the commit record of one step, and its strict reader.

A checkpoint is ``step_<9 digits>/`` holding ``rank_<5 digits>.safetensors`` per rank and
``manifest.json``, written last. The manifest is the only thing that makes the directory a
checkpoint. It holds the schema version, the step, UTC time, world size and, per rank, the shard
file, its size, the state tree (JSON leaves for non-tensors) and every tensor's dtype, global
shape and chunks (file, byte range, global offsets, shape, xxh3).

The reader trusts nothing: the size is bounded, file names must be plain names inside the step
directory, ranges must lie inside their file and not overlap, dtypes must be known, byte counts
must match shapes and checksums must be 16 hex digits.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tierio.errors import FormatError
from tierio.format.safetensors import itemsize, torch_dtype
from tierio.format.statetree import tensor_refs

SCHEMA = "tierio.checkpoint"
SCHEMA_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 50
MAX_WORLD_SIZE = 1 << 20
MAX_DIMS = 64

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_HEX_RE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class ChunkInfo:
    file: str
    begin: int  # absolute byte offset in ``file``
    end: int
    offsets: tuple[int, ...]  # global offsets of this chunk in the tensor
    shape: tuple[int, ...]
    xxh3: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]  # global shape
    chunks: list[ChunkInfo]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass
class RankEntry:
    rank: int
    file: str
    bytes: int
    tree: Any
    tensors: dict[str, TensorInfo]


@dataclass
class Manifest:
    step: int
    world_size: int
    ranks: list[RankEntry]
    time: str = ""
    timestamp: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def files(self) -> list[str]:
        return [r.file for r in self.ranks]

    @property
    def num_tensors(self) -> int:
        return sum(len(r.tensors) for r in self.ranks)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "step": self.step,
            "time": self.time,
            "timestamp": self.timestamp,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
            "extra": self.extra,
            "ranks": [rank_to_json(r) for r in self.ranks],
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, allow_nan=False).encode()


def utc_now() -> tuple[str, float]:
    ts = time.time()
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"), ts


def rank_to_json(r: RankEntry) -> dict:
    return {
        "rank": r.rank,
        "file": r.file,
        "bytes": r.bytes,
        "tree": r.tree,
        "tensors": {
            t.name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "chunks": [
                    {"file": c.file, "range": [c.begin, c.end], "offsets": list(c.offsets), "shape": list(c.shape), "xxh3": c.xxh3}
                    for c in t.chunks
                ],
            }
            for t in r.tensors.values()
        },
    }


# -- strict reading ----------------------------------------------------------------------------
def check_name(name: Any, where: str) -> str:
    """A file name confined to the step directory: no separators, no '..', no absolute paths."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise FormatError(f"{where}: file name {name!r} is not a plain name inside the checkpoint; the manifest is corrupt or hostile")
    return name


def _int(v: Any, where: str, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FormatError(f"{where}: expected an integer in {lo}..{hi}, got {v!r}")
    return v


def _ints(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        raise FormatError(f"{where}: expected a list of at most {MAX_DIMS} integers, got {v!r}")
    return tuple(_int(x, where) for x in v)


def _obj(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise FormatError(f"{where}: expected a JSON object")
    return v


def parse_rank(doc: Any, where: str) -> RankEntry:
    d = _obj(doc, where)
    rank = _int(d.get("rank"), f"{where}: rank", 0, MAX_WORLD_SIZE)
    w = f"{where} rank {rank}"
    file = check_name(d.get("file"), w)
    size = _int(d.get("bytes"), f"{w}: bytes")
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in _obj(d.get("tensors"), f"{w}: tensors").items():
        tw = f"{w} tensor {name!r}"
        info = _obj(info, tw)
        dt = info.get("dtype")
        if not isinstance(dt, str):
            raise FormatError(f"{tw}: missing dtype")
        try:
            torch_dtype(dt)
        except FormatError as exc:
            raise FormatError(f"{tw}: {exc}") from None
        isz = itemsize(dt)
        shape = _ints(info.get("shape"), f"{tw}: shape")
        if math.prod(shape) * isz > MAX_FILE_BYTES:
            raise FormatError(f"{tw}: shape {list(shape)} claims an absurd size; the manifest is corrupt or hostile")
        chunks_doc = info.get("chunks")
        if not isinstance(chunks_doc, list) or not chunks_doc:
            raise FormatError(f"{tw}: needs a non-empty list of chunks")
        chunks = []
        for i, c in enumerate(chunks_doc):
            cw = f"{tw} chunk {i}"
            c = _obj(c, cw)
            cfile = check_name(c.get("file"), cw)
            rng = _ints(c.get("range"), f"{cw}: range")
            offs = _ints(c.get("offsets"), f"{cw}: offsets")
            cshape = _ints(c.get("shape"), f"{cw}: shape")
            digest = c.get("xxh3")
            if len(rng) != 2 or rng[0] > rng[1]:
                raise FormatError(f"{cw}: range must be [begin, end] with begin <= end, got {list(rng)}")
            if cfile != file:
                raise FormatError(f"{cw}: names file {cfile!r} but rank {rank} writes {file!r}")
            if rng[1] > size:
                raise FormatError(f"{cw}: bytes {rng[0]}..{rng[1]} lie outside {file} ({size} bytes)")
            if len(offs) != len(shape) or len(cshape) != len(shape):
                raise FormatError(f"{cw}: offsets {list(offs)} and shape {list(cshape)} must have {len(shape)} dimensions")
            if any(o + s > g for o, s, g in zip(offs, cshape, shape)):
                raise FormatError(f"{cw}: offsets {list(offs)} + shape {list(cshape)} exceed the tensor's shape {list(shape)}")
            if rng[1] - rng[0] != math.prod(cshape) * isz:
                raise FormatError(f"{cw}: {rng[1] - rng[0]} bytes do not match shape {list(cshape)} of {dt}")
            if not isinstance(digest, str) or not _HEX_RE.fullmatch(digest):
                raise FormatError(f"{cw}: xxh3 must be 16 lowercase hex digits, got {digest!r}")
            chunks.append(ChunkInfo(cfile, rng[0], rng[1], offs, cshape, digest))
            if rng[1] > rng[0]:
                spans.append((rng[0], rng[1], f"{name!r} chunk {i}"))
        tensors[name] = TensorInfo(name, dt, shape, chunks)
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise FormatError(f"{w}: {a[2]} and {b[2]} overlap in {file}; the manifest is corrupt or hostile")
    tree = d.get("tree")
    for ref in tensor_refs(tree):
        if ref not in tensors:
            raise FormatError(f"{w}: the state tree refers to tensor {ref!r} which the manifest does not describe")
    return RankEntry(rank, file, size, tree, tensors)


def _load_json(raw: bytes, where: str, limit: int) -> dict:
    if len(raw) > limit:
        raise FormatError(f"{where} is {len(raw)} bytes, above the {limit}-byte limit; it is corrupt or hostile")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{where} is not valid JSON ({type(exc).__name__}: {exc}); this copy is corrupt") from None
    return _obj(doc, where)


def parse_manifest(raw: bytes, where: str, expect_step: int | None = None) -> Manifest:
    """Strictly parse manifest bytes; ``where`` names the copy in error messages."""
    doc = _load_json(raw, where, MAX_MANIFEST_BYTES)
    if doc.get("schema") != SCHEMA:
        raise FormatError(f"{where}: not a tierio checkpoint manifest (schema {doc.get('schema')!r})")
    version = doc.get("version")
    if version != SCHEMA_VERSION:
        raise FormatError(f"{where}: manifest version {version!r} is not supported (this tierio reads {SCHEMA_VERSION}); upgrade tierio")
    step = _int(doc.get("step"), f"{where}: step", 0, 10**9 - 1)
    if expect_step is not None and step != expect_step:
        raise FormatError(f"{where}: manifest says step {step} but lives in the directory of step {expect_step}")
    world = _int(doc.get("world_size"), f"{where}: world_size", 1, MAX_WORLD_SIZE)
    ranks_doc = doc.get("ranks")
    if not isinstance(ranks_doc, list) or len(ranks_doc) != world:
        raise FormatError(f"{where}: expected {world} rank entries")
    ranks = [parse_rank(r, where) for r in ranks_doc]
    files = set()
    for i, r in enumerate(ranks):
        if r.rank != i:
            raise FormatError(f"{where}: rank entries out of order (entry {i} is rank {r.rank})")
        if r.file in files or r.file == "manifest.json":
            raise FormatError(f"{where}: file {r.file!r} is claimed twice")
        files.add(r.file)
    t = doc.get("time", "")
    ts = doc.get("timestamp", 0.0)
    if not isinstance(t, str) or not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise FormatError(f"{where}: invalid time fields")
    extra = doc.get("extra") or {}
    return Manifest(step, world, ranks, t, float(ts), _obj(extra, f"{where}: extra"))


def encode_fragment(step: int, world_size: int, entry: RankEntry) -> bytes:
    return json.dumps({"schema": SCHEMA + ".fragment", "version": SCHEMA_VERSION, "step": step,
                       "world_size": world_size, "entry": rank_to_json(entry)}, allow_nan=False).encode()


def parse_fragment(raw: bytes, where: str, step: int, world_size: int) -> RankEntry:
    doc = _load_json(raw, where, MAX_MANIFEST_BYTES)
    if doc.get("schema") != SCHEMA + ".fragment" or doc.get("version") != SCHEMA_VERSION:
        raise FormatError(f"{where}: not a tierio manifest fragment")
    if doc.get("step") != step or doc.get("world_size") != world_size:
        raise FormatError(
            f"{where}: fragment is for step {doc.get('step')} / world size {doc.get('world_size')}, "
            f"expected step {step} / world size {world_size}; all ranks must save the same steps with the same world size"
        )
    return parse_rank(doc.get("entry"), where)
