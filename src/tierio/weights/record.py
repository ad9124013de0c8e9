"""The record of a weight-cache entry (``.tierio-cache.json``): what the entry holds, where it
came from, each shard window's xxh3; read back as untrusted bytes (a damaged record is a miss)."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from tierio.errors import FormatError, IntegrityError
from tierio.io.checksum import xxh3
from tierio.io.untrusted import Fields, check_hex, check_str, read_json_file
from tierio.storage.base import check_key
from tierio.weights.engine import Hook
from tierio.weights.sources import ModelSource, Shard

RECORD = ".tierio-cache.json"
VERSION = 1
RECORD_LIMIT = 64 << 20  # 500 GB in 16 MiB windows is ~1.3 MB of checksums
SUM_WINDOW = 2 << 20  # the checksum window: fills record one xxh3 per multiple of it
MAX_FILES = 100_000
KINDS = ("file", "hf", "dir", "tierio")
_OFFSET = re.compile(r"[0-9]{1,19}")


@dataclass
class FileRecord:
    size: int
    mtime: float = 0.0  # at the source (0 for companion files, which are not checked)
    sums: dict[int, str] = field(default_factory=dict)  # window offset -> xxh3 (shards only)


@dataclass
class CacheRecord:
    """What a committed entry holds and where it came from."""

    source: str
    kind: str  # as ModelSource.kind
    files: dict[str, FileRecord]  # relative name -> record (shards and companion files)
    order: list[str]  # the shard files, in source order
    chunk: int  # the checksum window of the fill
    created: float

    def local_path(self, entry: Path) -> Path:
        """What to load from: the file of a single-file model, else the entry directory."""
        return entry / self.order[0] if self.kind == "file" else entry

    def to_json(self) -> str:
        files = {k: {"size": f.size, "mtime": f.mtime, **({"xxh3": {str(o): h for o, h in f.sums.items()}} if f.sums else {})}
                 for k, f in self.files.items()}
        return json.dumps({
            "version": VERSION, "source": self.source, "kind": self.kind, "bytes": sum(f.size for f in self.files.values()),
            "files": files, "files_order": self.order, "chunk": self.chunk, "created": self.created,
        }, indent=1)

    @classmethod
    def from_doc(cls, doc: object, where: str) -> CacheRecord:
        """A record from an untrusted document; FormatError on anything odd (names must stay inside the entry)."""
        f = Fields(doc, where)
        f.const("version", VERSION)
        listed = f.obj("files")
        if len(listed.doc) > MAX_FILES:
            raise FormatError(f"{where}: more than {MAX_FILES} files")
        files = {check_key(k, where): _file_record(listed.obj(k)) for k in listed.doc}
        order = [check_key(check_str(k, where), where) for k in f.list("files_order", MAX_FILES)]
        if not order or any(k not in files for k in order):
            raise FormatError(f"{where}: 'files_order' must name files of 'files'")
        chunk = f.int("chunk", SUM_WINDOW, 1 << 30)
        if chunk % SUM_WINDOW:
            raise FormatError(f"{where}: field 'chunk' must be a multiple of {SUM_WINDOW}, got {chunk}")
        return cls(f.str("source", 8192), f.const("kind", *KINDS), files, order, chunk, f.float("created", 0.0))

    @classmethod
    def read(cls, entry: Path) -> CacheRecord:
        """The record of a committed entry (NotFoundError, or FormatError when it is damaged)."""
        path = entry / RECORD
        return cls.from_doc(read_json_file(path, missing="the entry has no record", limit=RECORD_LIMIT), str(path))


def _file_record(f: Fields) -> FileRecord:
    sums = f.obj("xxh3", default=None)
    checked: dict[int, str] = {}
    for k, v in (sums.doc.items() if sums is not None else ()):
        if not _OFFSET.fullmatch(k):
            raise FormatError(f"{sums.where}: {k[:40]!r} is not a byte offset")  # type: ignore[union-attr]
        checked[int(k)] = check_hex(v, f"{sums.where}[{k}]", 16)  # type: ignore[union-attr]
    return FileRecord(f.int("size"), f.float("mtime", 0.0, default=0.0), checked)


def stale_reason(record: CacheRecord, entry: Path, src: ModelSource | None) -> str | None:
    """Why a committed entry cannot be used (None when it is good): a file missing or of the wrong
    size in the cache, or (given the source) a shard that changed there."""
    for key, f in record.files.items():  # keys were checked relative when the record was read
        try:
            st = os.lstat(entry / key)
        except OSError:
            return f"{key} is missing from the cache"
        if st.st_size != f.size or not stat.S_ISREG(st.st_mode):
            return f"{key} has the wrong size in the cache"
    for s in src.shards if src is not None else ():
        f = record.files.get(s.key)  # type: ignore[assignment]
        if f is None or f.size != s.size or abs(f.mtime - s.mtime) > 1e-3:
            return f"{s.key} changed at the source"
    return None


FETCH_AGAIN = "run `tierio weights fetch` again or evict the entry"


def checksum_hook(record: CacheRecord, what: str = "cached", advice: str = FETCH_AGAIN) -> Hook:
    """Checks every window a full-verify load reads against the fill's recorded xxh3."""
    chunk = record.chunk
    sums = {k: f.sums for k, f in record.files.items()}

    def hook(shard: Shard, offset: int, view: memoryview, n: int) -> None:
        # Windows are whole multiples of the fill's checksum window (see engine).
        for rel in range(0, n, chunk):
            at, m = offset + rel, min(chunk, n - rel)
            want = sums.get(shard.key, {}).get(at)
            if want is None or xxh3(view[rel : rel + m]) != want:
                why = "have no recorded checksum" if want is None else "fail their checksum"
                raise IntegrityError(f"{what} {shard.where} bytes {at}..{at + m} {why}; {advice}")

    return hook


__all__ = ["CacheRecord", "FileRecord", "RECORD", "SUM_WINDOW", "checksum_hook", "stale_reason"]
