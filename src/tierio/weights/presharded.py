"""Pre-sharded models for restarts at one tensor-parallel degree: one safetensors file per rank
and an index, so a restarted rank reads its own file, sequentially, and nothing else.

    OUT/tp-rank-00001-of-00004.safetensors    rank 1's slices (metadata: rank, size, source digest)
    OUT/tierio-tp.json                        the index, written last: TP degree, rules, the
                                              source's files with their xxh3, each rank file's
                                              size and xxh3 per 2 MiB window

A load checks before reading that the index asks for the same degree (another one is refused
with the command that re-shards), that the rank's file has the recorded size and names the same
source digest, and while reading that every window matches its xxh3; a mismatch names the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierio.errors import ConfigError, FormatError, IntegrityError
from tierio.format.safetensors import build_header, dtype_name
from tierio.io.checksum import StreamingChecksum, xxh3
from tierio.io.untrusted import Fields, check_hex, check_plain_name, parser, read_json_file
from tierio.stats import Stats
from tierio.storage.local import LocalStore
from tierio.weights.record import SUM_WINDOW, CacheRecord, FileRecord
from tierio.weights.sources import PRESHARDED_INDEX as INDEX
from tierio.weights.sliced import with_rules
from tierio.weights.sources import ModelSource, resolve
from tierio.weights.tp import RuleList, TensorParallel

VERSION = 1
INDEX_LIMIT = 64 << 20
MAX_RANKS = 4096


def rank_file(rank: int, size: int) -> str:
    return f"tp-rank-{rank:05d}-of-{size:05d}.safetensors"


@dataclass
class ShardReport(Stats):
    """What :func:`shard_model` wrote."""

    out: str
    tp: int
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    source_bytes: int = 0


def _file_sums(path: Path) -> tuple[str, dict[int, str]]:
    """(whole-file xxh3, xxh3 per SUM_WINDOW window by offset) of a local file."""
    whole, sums = StreamingChecksum(), {}
    with open(path, "rb") as f:
        at = 0
        while chunk := f.read(SUM_WINDOW):
            whole.update(chunk)
            sums[at] = xxh3(chunk)
            at += len(chunk)
    return whole.hexdigest(), sums


def _source_sums(src: ModelSource) -> dict[str, str]:
    if not src.local:
        raise ConfigError(f"{src.url}: pre-sharding reads a local model (fetch it first: tierio weights fetch)")
    return {s.key: _file_sums(s.path)[0] for s in src.shards}  # type: ignore[arg-type]


def shard_model(source: str | os.PathLike, out: str | os.PathLike, tp: int, rules: RuleList | None = None) -> ShardReport:
    """Write one safetensors file per rank of a ``tp``-way group, then the index (``rules`` as for
    :class:`TensorParallel`; None: the preset of the model's config.json)."""
    from tierio.weights.loader import load  # here: the loader imports this module

    src = resolve(source)
    sums = _source_sums(src)
    digest = xxh3(json.dumps(sums, sort_keys=True).encode())
    spec = with_rules(TensorParallel(0, tp, rules), src)
    store = LocalStore(out)
    report = ShardReport(str(store.root), tp, source_bytes=src.total_bytes)
    files = []
    for rank in range(tp):
        tensors = load(src, shard=TensorParallel(rank, tp, spec.rules), mapped=False)
        meta = {"format": "pt", "tierio.tp.rank": str(rank), "tierio.tp.size": str(tp), "tierio.tp.source": digest}
        header, h = build_header(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()), meta)
        parts = [memoryview(header)] + [memoryview(tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy())
                                        for n in h.tensors if tensors[n].numel()]
        name = rank_file(rank, tp)
        report.bytes += store.put_buffers(name, parts)
        whole, windows = _file_sums(store.root / name)
        files.append({"file": name, "rank": rank, "bytes": (store.root / name).stat().st_size, "xxh3": whole,
                      "windows": {str(k): v for k, v in windows.items()}})
        report.files.append(name)
        del tensors
    index = {"format": "tierio-tp", "version": VERSION, "tp": tp, "rules": [[p, repr(r)] for p, r in spec.rules],
             "source": {"url": src.url, "digest": digest, "files": sums}, "files": files, "window": SUM_WINDOW}
    store.put_buffers(INDEX, [json.dumps(index, indent=1).encode()])  # last: the directory is complete
    report.files.append(INDEX)
    return report


@dataclass
class RankFile:
    """One rank's file as the index records it."""

    path: Path
    size: int
    digest: str  # the source's
    record: CacheRecord  # its window checksums, as weights.record checks them


@parser
def parse_index(raw_doc: object, where: str, root: Path, spec: TensorParallel) -> RankFile:
    """The index's entry for ``spec``'s rank; ConfigError for another TP degree, FormatError when damaged."""
    f = Fields(raw_doc, where)
    f.const("format", "tierio-tp")
    f.const("version", VERSION)
    tp = f.int("tp", 1, MAX_RANKS)
    if tp != spec.size:
        raise ConfigError(f"{root} is pre-sharded for {tp} tensor-parallel ranks, not {spec.size}: re-shard it "
                          f"(tierio weights shard SOURCE OUT --tp {spec.size}) or load the original model with shard=")
    digest = f.obj("source").hex("digest", 16)
    window = f.const("window", SUM_WINDOW)
    entries = f.list("files", MAX_RANKS)
    if len(entries) != tp:
        raise FormatError(f"{where}: {len(entries)} files listed for {tp} ranks")
    e = Fields(entries[spec.rank], f"{where}: files[{spec.rank}]")
    name = check_plain_name(e.str("file", 255), e.where)
    if e.int("rank", 0, MAX_RANKS) != spec.rank or name != rank_file(spec.rank, tp):
        raise FormatError(f"{e.where}: names {name!r}, expected {rank_file(spec.rank, tp)!r}")
    wins = e.obj("windows")
    sums = {}
    for k, v in wins.doc.items():
        if not (k.isascii() and k.isdigit() and len(k) < 20):
            raise FormatError(f"{wins.where}: {k[:40]!r} is not a byte offset")
        sums[int(k)] = check_hex(v, f"{wins.where}[{k}]", 16)
    size = e.int("bytes")
    rec = CacheRecord(str(root), "file", {name: FileRecord(size, 0.0, sums)}, [name], window, 0.0)
    return RankFile(root / name, size, digest, rec)


def open_rank(root: Path, spec: TensorParallel) -> tuple[ModelSource, CacheRecord]:
    """The source of ``spec``'s own file in a pre-sharded directory, checked against the index."""
    where = str(root / INDEX)
    rf = parse_index(read_json_file(where, missing="the directory is not pre-sharded", limit=INDEX_LIMIT), where, root, spec)
    try:
        size = rf.path.stat().st_size
    except FileNotFoundError:
        raise IntegrityError(f"{rf.path} is missing; the index {where} lists it: re-shard the model") from None
    if size != rf.size:
        raise IntegrityError(f"{rf.path} is {size} bytes but the index {where} records {rf.size}: re-shard the model")
    src = resolve(rf.path)
    meta = src.shards[0].header.metadata  # type: ignore[union-attr]
    want = {"tierio.tp.rank": str(spec.rank), "tierio.tp.size": str(spec.size), "tierio.tp.source": rf.digest}
    bad = [k for k, v in want.items() if meta.get(k) != v]
    if bad:
        raise IntegrityError(f"{rf.path} does not match the index {where} ({', '.join(bad)} differ): "
                             "it was cut from another model or another sharding; re-shard the model")
    return src, rf.record


def is_presharded(source: object) -> Path | None:
    """The directory when ``source`` is a local pre-sharded model, else None."""
    if isinstance(source, ModelSource) or "://" in str(source).removeprefix("file://"):
        return None
    p = Path(str(source).removeprefix("file://")).expanduser()
    return p if (p / INDEX).is_file() else None

__all__ = ["INDEX", "ShardReport", "is_presharded", "open_rank", "parse_index", "rank_file", "shard_model"]
