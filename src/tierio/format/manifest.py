"""The checkpoint manifest: the commit record of one step, and its strict reader.

A checkpoint is ``step_<9 digits>/`` holding ``rank_<5 digits>.safetensors`` per rank and
``manifest.json``, written last. The manifest is the only thing that makes the directory a
checkpoint. It holds the schema version, the step, UTC time, world size and, per rank, the shard
file, its size, the state tree (JSON leaves for non-tensors) and every tensor's dtype, global
shape and chunks (file, byte range, global offsets, shape, xxh3).

Version 2 adds what a cluster needs (a manifest without these features is still written as
version 1, byte for byte as before):

* **global tensors** (``"global": true``): slices of one tensor spread over ranks (DTensor,
  TensorSlice); each rank lists the chunks it wrote, with their global offsets; state trees name
  them with ``{"__global__": name}``; a manifest may carry one ``tree`` for the whole job (a
  checkpoint written through torch.distributed.checkpoint);
* **records by reference**: with thousands of ranks the per-rank entries do not fit one manifest,
  so a rank entry may instead name the rank's record file in the step directory with its size and
  xxh3 (``"record": {"name", "bytes", "xxh3"}``); a reader loads only the records it needs;
* **chunk references** (incremental checkpoints): a chunk whose ``file`` is
  ``step_<9 digits>/rank_<5 digits>.safetensors`` lies in that shard of an *earlier* step of the
  same checkpoint directory, unchanged (its xxh3 says so). A reference always names the file that
  holds the bytes (never a chain through another reference), so references cannot form a cycle; a
  reference to the same or a later step is refused as corrupt or hostile.

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

from tierio.errors import ConfigError, FormatError
from tierio.format.safetensors import ITEMSIZES
from tierio.format.statetree import MAX_JSON_DEPTH, tensor_refs
from tierio.io.untrusted import (
    MAX_EXPANSION, Fields, brief, check_dict, check_hex, check_plain_name, estimated_memory, expansion_ok, loads, parser,
)

SCHEMA = "tierio.checkpoint"
SCHEMA_VERSION = 2  # the newest this tierio reads and writes
READABLE_VERSIONS = (1, 2)
# thousands of ranks with hundreds of tensors each; parsing one costs at most
# io.untrusted.MAX_EXPANSION times its size (floods of tiny values are refused unparsed)
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 50
MAX_WORLD_SIZE = 1 << 20
MAX_DIMS = 64
MAX_CHUNKS = 1 << 24
MANIFEST_NAME = "manifest.json"
# in ``extra``: the committer's own entry refers to earlier steps (the manifest may name records only)
INCREMENTAL_FIELD = "tierio.incremental"
# a chunk in a shard of an earlier step: "step_000000010/rank_00000.safetensors"
_REF_RE = re.compile(r"step_(\d{9})/(rank_\d{5}\.safetensors)")


def ref_step(file: str) -> int | None:
    """The earlier step a chunk's ``file`` refers to, or None for a file of the step itself."""
    m = _REF_RE.fullmatch(file) if "/" in file else None
    return int(m.group(1)) if m else None


def ref_file(step: int, name: str) -> str:
    """The reference to file ``name`` of ``step`` (as a later step's chunk names it)."""
    return f"step_{step:09d}/{name}"


def file_key(step: int, file: str) -> str:
    """The store key of a chunk's ``file`` in a checkpoint of ``step``: a file of the step itself
    lives in its directory; a reference already names the earlier step's directory."""
    return file if "/" in file else f"step_{step:09d}/{file}"



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

    @property
    def is_ref(self) -> bool:
        """In a shard of an earlier step (an incremental checkpoint's unchanged chunk)."""
        return "/" in self.file


@dataclass
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]  # global shape
    chunks: list[ChunkInfo]
    is_global: bool = False  # a slice of a tensor spread over ranks (else this rank's own tensor)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass(frozen=True)
class RecordRef:
    """A rank's record file (its manifest entry, written beside its shard), named by a manifest."""

    name: str
    bytes: int
    xxh3: str


@dataclass
class RankEntry:
    rank: int
    file: str
    bytes: int
    tree: Any
    tensors: dict[str, TensorInfo]
    record: RecordRef | None = None  # set: tree and tensors live in that record (not loaded here)

    @property
    def loaded(self) -> bool:
        return self.record is None

    @property
    def refs(self) -> set[str]:
        """The files of earlier steps this (loaded) entry's chunks refer to."""
        return {c.file for t in self.tensors.values() for c in t.chunks if c.is_ref}


@dataclass
class Manifest:
    step: int
    world_size: int
    ranks: list[RankEntry]
    time: str = ""
    timestamp: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    tree: Any = None  # one state tree for every rank (global tensors only), when ranks carry none

    @property
    def version(self) -> int:
        """1 unless the manifest uses a feature of version 2 (old readers refuse it cleanly)."""
        v2 = self.tree is not None or any(
            not r.loaded or any(t.is_global for t in r.tensors.values()) or r.refs for r in self.ranks)
        return 2 if v2 else 1

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def incremental(self) -> bool:
        """Some chunks lie in earlier steps' shards (as far as the loaded entries and the
        committer's mark tell): the shards alone do not hold the state."""
        return self.extra.get(INCREMENTAL_FIELD) is True or any(r.refs for r in self.ranks)

    @property
    def files(self) -> list[str]:
        """Every file of the checkpoint but the manifest: shards, and records by reference."""
        return [r.file for r in self.ranks] + [r.record.name for r in self.ranks if r.record is not None]

    @property
    def num_tensors(self) -> int:
        return sum(len(r.tensors) for r in self.ranks)

    def to_json(self) -> dict:
        doc = {
            "schema": SCHEMA,
            "version": self.version,
            "step": self.step,
            "time": self.time,
            "timestamp": self.timestamp,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
            "extra": self.extra,
            "ranks": [rank_to_json(r) for r in self.ranks],
        }
        if self.tree is not None:
            doc["tree"] = self.tree
        return doc

    def encode(self) -> bytes:
        # Large manifests are written compactly: indentation would add a third to their size.
        return _encode(self.to_json(), f"manifest of step {self.step}", compact=not all(r.loaded for r in self.ranks))


# Manifests up to this size (a handful of tensors) are indented for people reading them. Indented
# JSON comes from the pure-Python encoder, run on a background thread during training: a 16 KiB
# manifest held the GIL for tens of milliseconds, taken from the step (docs/integrations.md).
READABLE_BYTES = 4 << 10


def _encode(doc: dict, what: str, compact: bool = False) -> bytes:
    """The JSON of a manifest or record, refused here if the reader's limits would refuse it:
    a checkpoint that saves must also restore. Compact JSON comes from the C encoder (indented
    JSON does not: it costs ~4 s per MB); small manifests are indented for people."""
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if not compact and len(raw) <= READABLE_BYTES:
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


def _tensor_json(t: TensorInfo) -> dict:
    doc: dict[str, Any] = {
        "dtype": t.dtype,
        "shape": list(t.shape),
        "chunks": [
            {"file": c.file, "range": [c.begin, c.end], "offsets": list(c.offsets), "shape": list(c.shape), "xxh3": c.xxh3}
            for c in t.chunks
        ],
    }
    if t.is_global:
        doc["global"] = True
    return doc


def rank_to_json(r: RankEntry) -> dict:
    if r.record is not None:
        return {"rank": r.rank, "file": r.file, "bytes": r.bytes,
                "record": {"name": r.record.name, "bytes": r.record.bytes, "xxh3": r.record.xxh3}}
    return {
        "rank": r.rank,
        "file": r.file,
        "bytes": r.bytes,
        "tree": r.tree,
        "tensors": {t.name: _tensor_json(t) for t in r.tensors.values()},
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


def _chunk(doc: Any, cw: str, rank: int, file: str, size: int, shape: tuple[int, ...], dt: str, isz: int,
           refs: bool = False) -> ChunkInfo:
    c = check_dict(doc, cw)
    cfile = c.get("file")
    if cfile != file:
        if refs and type(cfile) is str and ref_step(cfile) is not None:
            file, size = cfile, MAX_FILE_BYTES  # a reference: the earlier step's shard (checked by check_refs)
        else:
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


def _tensor(name: str, doc: Any, tw: str, rank: int, file: str, size: int, version: int) -> TensorInfo:
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
    is_global = version >= 2 and info.get("global", False) is True
    chunks = [_chunk(c, f"{tw} chunk {i}", rank, file, size, shape, dt, isz, version >= 2)
              for i, c in enumerate(chunks_doc)]
    return TensorInfo(name, dt, shape, chunks, is_global)


def _record_ref(doc: Any, w: str) -> RecordRef:
    f = Fields(doc, f"{w} record")
    return RecordRef(check_name(f.doc.get("name"), f"{w} record"), f.int("bytes", 0, MAX_MANIFEST_BYTES), f.hex("xxh3", 16))


@parser
def parse_rank(doc: Any, where: str, version: int = SCHEMA_VERSION) -> RankEntry:
    rank = Fields(doc, where).int("rank", 0, MAX_WORLD_SIZE - 1)
    w = f"{where} rank {rank}"
    d = Fields(doc, w)
    file = check_name(d.doc.get("file"), w)
    size = d.int("bytes", 0, MAX_FILE_BYTES)
    if version >= 2 and "record" in d.doc:
        ref = _record_ref(d.doc["record"], w)
        if ref.name in (file, MANIFEST_NAME):
            raise FormatError(f"{w}: record {ref.name!r} is also the shard or the manifest")
        return RankEntry(rank, file, size, None, {}, ref)
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str, int]] = []
    for name, info in d.obj("tensors").doc.items():
        t = _tensor(name, info, f"{w} tensor {name!r}", rank, file, size, version)
        tensors[name] = t
        spans.extend((c.begin, c.end, name, i) for i, c in enumerate(t.chunks) if c.end > c.begin and not c.is_ref)
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise FormatError(f"{w}: {a[2]!r} chunk {a[3]} and {b[2]!r} chunk {b[3]} overlap in {file}; the manifest is corrupt or hostile")
    tree = d.doc.get("tree")
    for ref in tensor_refs(tree):
        if ref not in tensors or tensors[ref].is_global:
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
    if version not in READABLE_VERSIONS or type(version) is not int:
        raise FormatError(f"{where}: manifest version {brief(version)} is not supported (this tierio reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade tierio")
    step = doc.int("step", 0, 10**9 - 1)
    if expect_step is not None and step != expect_step:
        raise FormatError(f"{where}: manifest says step {step} but lives in the directory of step {expect_step}")
    world = doc.int("world_size", 1, MAX_WORLD_SIZE)
    ranks_doc = doc.list("ranks", MAX_WORLD_SIZE)
    if len(ranks_doc) != world:
        raise FormatError(f"{where}: expected {world} rank entries, found {len(ranks_doc)}")
    ranks = [parse_rank(r, where, version) for r in ranks_doc]
    files = set()
    for i, r in enumerate(ranks):
        if r.rank != i:
            raise FormatError(f"{where}: rank entries out of order (entry {i} is rank {r.rank})")
        for name in [r.file] + ([r.record.name] if r.record is not None else []):
            if name in files or name == MANIFEST_NAME:
                raise FormatError(f"{where}: file {name!r} is claimed twice")
            files.add(name)
    total = doc.int("total_bytes", 0, MAX_FILE_BYTES * MAX_WORLD_SIZE, default=None)
    if total is not None and total != sum(r.bytes for r in ranks):
        raise FormatError(f"{where}: total_bytes {total} is not the sum of the ranks' {sum(r.bytes for r in ranks)} bytes")
    t = doc.str("time", 64, default="")
    ts = doc.float("timestamp", 0.0, default=0.0)
    extra = doc.obj("extra", default=None)
    tree = doc.doc.get("tree") if version >= 2 else None
    if tensor_refs(tree):
        raise FormatError(f"{where}: the job-wide state tree refers to a rank's own tensor; it may name global tensors only")
    man = Manifest(step, world, ranks, t, float(ts), {} if extra is None else extra.doc, tree)
    check_globals(man, where)
    for r in ranks:
        check_refs(r, step, where)
    return man


def check_refs(entry: RankEntry, step: int, where: str) -> None:
    """Every chunk reference of ``entry`` (in a checkpoint of ``step``) names an earlier step: a
    reference to the step itself or a later one could form a cycle and is refused."""
    for t in entry.tensors.values():
        for i, c in enumerate(t.chunks):
            ref = ref_step(c.file) if c.is_ref else None
            if ref is not None and ref >= step:
                raise FormatError(
                    f"{where}: step {step} rank {entry.rank} tensor {t.name!r} chunk {i} refers to {c.file}, which is not "
                    "an earlier step: a reference cycle; the manifest is corrupt or hostile")


def check_globals(man: Manifest, where: str) -> None:
    """The global tensors of the loaded rank entries agree on dtype and shape, and when every entry
    is loaded, every global tensor the trees name is described by some rank."""
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for r in man.ranks:
        for t in r.tensors.values():
            if not t.is_global:
                continue
            first = seen.setdefault(t.name, (t.dtype, t.shape, r.rank))
            if first[:2] != (t.dtype, t.shape):
                raise FormatError(
                    f"{where}: global tensor {t.name!r} is {t.dtype} {list(t.shape)} in rank {r.rank}'s entry ({r.file}) "
                    f"but {first[0]} {list(first[1])} in rank {first[2]}'s; the manifest is corrupt or hostile")
    if not all(r.loaded for r in man.ranks):
        return
    for tree, who in [(man.tree, "the job-wide state tree")] + [(r.tree, f"rank {r.rank}'s state tree") for r in man.ranks]:
        for ref in tensor_refs(tree, ("__global__",)):
            if ref not in seen:
                raise FormatError(f"{where}: {who} refers to global tensor {brief(ref)}, which no rank's entry describes")


def encode_record(step: int, world_size: int, entry: RankEntry, extra: dict | None = None) -> bytes:
    """A rank's record: its manifest entry, written beside its shard once the shard is durable.
    ``extra`` is what the step's manifest will say beside the entries (the run, the reason): a step
    found only on node-local tiers has no manifest, and its records say it instead."""
    version = 2 if any(t.is_global for t in entry.tensors.values()) or entry.refs else 1
    doc = {"schema": SCHEMA + ".fragment", "version": version, "step": step, "world_size": world_size,
           "entry": rank_to_json(entry)}
    if extra:
        doc["extra"] = extra
    return _encode(doc, f"record of rank {entry.rank}", compact=True)


@dataclass(frozen=True)
class RecordHead:
    """What a record says beside its entry: its step, the world size of the save and its ``extra``."""

    step: int
    world_size: int
    extra: dict


@parser
def parse_record_head(raw: bytes, where: str) -> RecordHead:
    """A record's head, before its entry is checked (only FormatError comes out)."""
    doc = _load_json(raw, where, MAX_MANIFEST_BYTES)
    if doc.doc.get("schema") != SCHEMA + ".fragment":
        raise FormatError(f"{where}: not a tierio checkpoint record")
    extra = doc.obj("extra", default=None)
    return RecordHead(doc.int("step", 0, 10**9 - 1), doc.int("world_size", 1, MAX_WORLD_SIZE),
                      {} if extra is None else extra.doc)


@parser
def parse_record(raw: bytes, where: str, step: int, world_size: int) -> RankEntry:
    """Strictly parse a rank's record (only FormatError comes out)."""
    doc = _load_json(raw, where, MAX_MANIFEST_BYTES)
    version = doc.doc.get("version")
    if doc.doc.get("schema") != SCHEMA + ".fragment" or version not in READABLE_VERSIONS or type(version) is not int:
        raise FormatError(f"{where}: not a tierio checkpoint record")
    got_step, got_world = doc.doc.get("step"), doc.doc.get("world_size")
    if type(got_step) is not int or type(got_world) is not int or got_step != step or got_world != world_size:
        raise FormatError(
            f"{where}: fragment is for step {brief(got_step)} / world size {brief(got_world)}, "
            f"expected step {step} / world size {world_size}; all ranks must save the same steps with the same world size"
        )
    entry = parse_rank(doc.doc.get("entry"), where, version)
    if not entry.loaded:
        raise FormatError(f"{where}: a record must hold its rank's entry, not refer to another record")
    check_refs(entry, step, where)
    return entry
