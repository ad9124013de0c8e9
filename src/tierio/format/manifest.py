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
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from tierio.errors import ConfigError, FormatError
from tierio.format.safetensors import ITEMSIZES
from tierio.format.statetree import MAX_JSON_DEPTH, tensor_refs
from tierio.io.untrusted import (
    MAX_EXPANSION, Fields, brief, check_dict, check_hex, check_plain_name, estimated_memory, expansion_ok, loads, parser,
)

SCHEMA = "tierio.checkpoint"
SCHEMA_VERSION = 1
# thousands of ranks with hundreds of tensors each; parsing one costs at most
# io.untrusted.MAX_EXPANSION times its size (floods of tiny values are refused unparsed)
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 50
MAX_WORLD_SIZE = 1 << 20
MAX_DIMS = 64
MAX_CHUNKS = 1 << 24



@dataclass(frozen=True, slots=True)  # manifests hold hundreds of thousands of these
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
        return _encode(self.to_json(), f"manifest of step {self.step}")


def _encode(doc: dict, what: str) -> bytes:
    """The JSON of a manifest or fragment, refused here if the reader's limits would refuse it:
    a checkpoint that saves must also restore."""
    raw = json.dumps(doc, indent=1, allow_nan=False).encode()
    if len(raw) > MAX_MANIFEST_BYTES or not expansion_ok(raw):
        raise ConfigError(
            f"the {what} would be {len(raw)} bytes ({estimated_memory(raw) >> 20} MiB once parsed), beyond what "
            f"a manifest may hold ({MAX_MANIFEST_BYTES} bytes, {MAX_EXPANSION}x its size in memory): store large "
            "non-tensor state (long lists of numbers) as tensors, or save fewer, larger tensors"
        )
    return raw


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
    try:
        return check_plain_name(name, where)
    except FormatError:
        raise FormatError(f"{where}: file name {brief(name)} is not a plain name inside the checkpoint; the manifest is corrupt or hostile") from None


def _dims_ok(v: Any, max_len: int) -> bool:
    """The fast path of the checks below (no message built): a short list of sane integers."""
    return type(v) is list and len(v) <= max_len and all(type(x) is int and 0 <= x <= MAX_FILE_BYTES for x in v)


def _chunk(doc: Any, cw: str, rank: int, file: str, size: int, shape: tuple[int, ...], dt: str, isz: int) -> ChunkInfo:
    c = check_dict(doc, cw)
    cfile = c.get("file")
    if cfile != file:
        check_name(cfile, cw)
        raise FormatError(f"{cw}: names file {cfile!r} but rank {rank} writes {file!r}")
    rng, offs, cshape = c.get("range"), c.get("offsets"), c.get("shape")
    if not (_dims_ok(rng, 2) and _dims_ok(offs, MAX_DIMS) and _dims_ok(cshape, MAX_DIMS)):
        f = Fields(c, cw)  # the slow path only builds the message naming the bad field
        f.ints("range", 2, 0, MAX_FILE_BYTES), f.ints("offsets", MAX_DIMS, 0, MAX_FILE_BYTES), f.ints("shape", MAX_DIMS, 0, MAX_FILE_BYTES)
    if len(rng) != 2 or rng[0] > rng[1]:
        raise FormatError(f"{cw}: range must be [begin, end] with begin <= end, got {rng}")
    if rng[1] > size:
        raise FormatError(f"{cw}: bytes {rng[0]}..{rng[1]} lie outside {file} ({size} bytes)")
    cshape_t = tuple(cshape)
    if len(offs) != len(shape) or cshape_t != shape or any(offs):  # a slice (a whole tensor needs no more checks)
        if len(offs) != len(shape) or len(cshape) != len(shape):
            raise FormatError(f"{cw}: offsets {offs} and shape {cshape} must have {len(shape)} dimensions")
        if any(o + s > g for o, s, g in zip(offs, cshape, shape)):
            raise FormatError(f"{cw}: offsets {offs} + shape {cshape} exceed the tensor's shape {list(shape)}")
    if rng[1] - rng[0] != math.prod(cshape_t) * isz:
        raise FormatError(f"{cw}: {rng[1] - rng[0]} bytes do not match shape {cshape} of {dt}")
    digest = check_hex(c.get("xxh3"), f"{cw}: xxh3", 16)
    return ChunkInfo(file, rng[0], rng[1], tuple(offs), cshape_t, digest)


def _tensor(name: str, doc: Any, tw: str, rank: int, file: str, size: int) -> TensorInfo:
    info = check_dict(doc, tw)
    dt, shape = info.get("dtype"), info.get("shape")
    isz = ITEMSIZES.get(dt) if type(dt) is str else None
    if isz is None:
        raise FormatError(f"{tw}: unknown dtype {brief(dt)}; known: {', '.join(sorted(ITEMSIZES))}")
    if not _dims_ok(shape, MAX_DIMS):
        Fields(info, tw).ints("shape", MAX_DIMS, 0, MAX_FILE_BYTES)
    shape = tuple(shape)
    if math.prod(d for d in shape if d) * isz > MAX_FILE_BYTES:
        raise FormatError(f"{tw}: shape {list(shape)} claims an absurd size; the manifest is corrupt or hostile")
    chunks_doc = info.get("chunks")
    if type(chunks_doc) is not list or not chunks_doc or len(chunks_doc) > MAX_CHUNKS:
        Fields(info, tw).list("chunks", MAX_CHUNKS)
        raise FormatError(f"{tw}: needs a non-empty list of chunks")
    chunks = [_chunk(c, f"{tw} chunk {i}", rank, file, size, shape, dt, isz) for i, c in enumerate(chunks_doc)]
    return TensorInfo(name, dt, shape, chunks)


@parser
def parse_rank(doc: Any, where: str) -> RankEntry:
    rank = Fields(doc, where).int("rank", 0, MAX_WORLD_SIZE - 1)
    w = f"{where} rank {rank}"
    d = Fields(doc, w)
    file = check_name(d.doc.get("file"), w)
    size = d.int("bytes", 0, MAX_FILE_BYTES)
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str, int]] = []
    for name, info in d.obj("tensors").doc.items():
        t = _tensor(name, info, f"{w} tensor {name!r}", rank, file, size)
        tensors[name] = t
        spans.extend((c.begin, c.end, name, i) for i, c in enumerate(t.chunks) if c.end > c.begin)
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise FormatError(f"{w}: {a[2]!r} chunk {a[3]} and {b[2]!r} chunk {b[3]} overlap in {file}; the manifest is corrupt or hostile")
    tree = d.doc.get("tree")
    for ref in tensor_refs(tree):
        if ref not in tensors:
            raise FormatError(f"{w}: the state tree refers to tensor {brief(ref)} which the manifest does not describe")
    return RankEntry(rank, file, size, tree, tensors)


def _load_json(raw: bytes, where: str, limit: int) -> Fields:
    # a state tree nests deeper than the default limit of io.untrusted (see statetree.MAX_JSON_DEPTH)
    return Fields(loads(raw, where, limit=limit, max_depth=MAX_JSON_DEPTH + 8), where)


@parser
def parse_manifest(raw: bytes, where: str, expect_step: int | None = None) -> Manifest:
    """Strictly parse manifest bytes; ``where`` names the copy in error messages.

    Only FormatError comes out, whatever the bytes: callers fall back to another copy on it."""
    doc = _load_json(raw, where, MAX_MANIFEST_BYTES)
    if doc.doc.get("schema") != SCHEMA:
        raise FormatError(f"{where}: not a tierio checkpoint manifest (schema {brief(doc.doc.get('schema'))})")
    version = doc.doc.get("version")
    if version != SCHEMA_VERSION or type(version) is not int:
        raise FormatError(f"{where}: manifest version {brief(version)} is not supported (this tierio reads {SCHEMA_VERSION}); upgrade tierio")
    step = doc.int("step", 0, 10**9 - 1)
    if expect_step is not None and step != expect_step:
        raise FormatError(f"{where}: manifest says step {step} but lives in the directory of step {expect_step}")
    world = doc.int("world_size", 1, MAX_WORLD_SIZE)
    ranks_doc = doc.list("ranks", MAX_WORLD_SIZE)
    if len(ranks_doc) != world:
        raise FormatError(f"{where}: expected {world} rank entries, found {len(ranks_doc)}")
    ranks = [parse_rank(r, where) for r in ranks_doc]
    files = set()
    for i, r in enumerate(ranks):
        if r.rank != i:
            raise FormatError(f"{where}: rank entries out of order (entry {i} is rank {r.rank})")
        if r.file in files or r.file == "manifest.json":
            raise FormatError(f"{where}: file {r.file!r} is claimed twice")
        files.add(r.file)
    total = doc.int("total_bytes", 0, MAX_FILE_BYTES * MAX_WORLD_SIZE, default=None)
    if total is not None and total != sum(r.bytes for r in ranks):
        raise FormatError(f"{where}: total_bytes {total} is not the sum of the ranks' {sum(r.bytes for r in ranks)} bytes")
    t = doc.str("time", 64, default="")
    ts = doc.float("timestamp", 0.0, default=0.0)
    extra = doc.obj("extra", default=None)
    return Manifest(step, world, ranks, t, float(ts), {} if extra is None else extra.doc)


def encode_fragment(step: int, world_size: int, entry: RankEntry) -> bytes:
    return _encode({"schema": SCHEMA + ".fragment", "version": SCHEMA_VERSION, "step": step,
                    "world_size": world_size, "entry": rank_to_json(entry)}, f"manifest fragment of rank {entry.rank}")


@parser
def parse_fragment(raw: bytes, where: str, step: int, world_size: int) -> RankEntry:
    doc = _load_json(raw, where, MAX_MANIFEST_BYTES)
    version = doc.doc.get("version")
    if doc.doc.get("schema") != SCHEMA + ".fragment" or version != SCHEMA_VERSION or type(version) is not int:
        raise FormatError(f"{where}: not a tierio manifest fragment")
    got_step, got_world = doc.doc.get("step"), doc.doc.get("world_size")
    if type(got_step) is not int or type(got_world) is not int or got_step != step or got_world != world_size:
        raise FormatError(
            f"{where}: fragment is for step {brief(got_step)} / world size {brief(got_world)}, "
            f"expected step {step} / world size {world_size}; all ranks must save the same steps with the same world size"
        )
    return parse_rank(doc.doc.get("entry"), where)
