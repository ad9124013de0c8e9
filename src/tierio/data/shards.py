"""Sample shards: plain POSIX tar files (what the ``webdataset`` library reads) plus an index.

A dataset is a key prefix in any Store holding

    shard-000000.tar        samples as tar members "<key>.<field>.npy" (numpy .npy payloads)
    shard-000000.idx.npy    per-sample index: byte offset and size of each field, xxh3 of the sample
    ...
    index.json              the manifest, written last (the commit): fields, sample counts,
                            each shard's size and xxh3-64, each index file's xxh3

Shards are cut at ``shard_size`` (default 64 MiB): large sequential objects keep object stores
and parallel filesystems at full speed and keep metadata operations per byte low. The sidecar
index gives random access to any sample with one ranged read or one slice of a mapped file,
without scanning the tar. Any tar tool, and ``webdataset.WebDataset(url)``, can read the shards
as they are; the index and manifest are extra files they ignore.
"""

from __future__ import annotations

import ast
import io
import json
import mmap
import os
import struct
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError
from tierio.io.checksum import xxh3
from tierio.io.files import os_error
from tierio.storage.base import Store, read_bytes
from tierio.units import parse_size

MANIFEST = "index.json"
FORMAT = "tierio-shards"
VERSION = 1
DEFAULT_SHARD_SIZE = 64 << 20


def _store(store_or_url: Store | str | Path) -> Store:
    if isinstance(store_or_url, (str, Path)):
        from tierio.storage import open_store

        return open_store(store_or_url)
    return store_or_url


def encode_npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


@lru_cache(maxsize=4096)
def _npy_header(head: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """Parse a .npy header (cached: headers repeat for samples of the same shape)."""
    if head[:6] != b"\x93NUMPY":
        raise FormatError("sample field is not a .npy array")
    major = head[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", head, 8)
        start = 10
    else:
        (hlen,) = struct.unpack_from("<I", head, 8)
        start = 12
    d = ast.literal_eval(head[start : start + hlen].decode("latin1"))
    dtype = np.dtype(d["descr"])
    if dtype.hasobject or d.get("fortran_order"):
        raise FormatError("sample field holds objects or Fortran-ordered data; shards carry plain arrays only")
    return dtype, tuple(d["shape"]), start + hlen


def decode_npy(buf, offset: int = 0, size: int | None = None) -> np.ndarray:
    """Zero-copy view of a .npy payload inside ``buf`` (bytes, mmap or memoryview)."""
    mv = memoryview(buf)
    end = len(mv) if size is None else offset + size
    first = bytes(mv[offset : min(end, offset + 12)])
    major = first[6] if len(first) > 6 else 1
    hlen = struct.unpack_from("<H" if major == 1 else "<I", first, 8)[0] if len(first) >= 12 else 0
    head = bytes(mv[offset : offset + (10 if major == 1 else 12) + hlen])
    dtype, shape, data_start = _npy_header(head)
    count = int(np.prod(shape)) if shape else 1
    if offset + data_start + count * dtype.itemsize > end:
        raise FormatError("sample field is shorter than its .npy header says; the shard is corrupt")
    return np.frombuffer(mv, dtype=dtype, count=count, offset=offset + data_start).reshape(shape)


@dataclass
class ShardInfo:
    key: str
    size: int
    xxh3: str
    samples: int
    first_sample: int
    index_key: str
    index_size: int
    index_xxh3: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Manifest:
    fields: list[str]
    shards: list[ShardInfo]
    num_samples: int
    meta: dict[str, Any]
    fingerprint: str = ""  # xxh3 of the manifest bytes

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def max_shard_size(self) -> int:
        return max((s.size for s in self.shards), default=0)


def load_manifest(store_or_url: Store | str | Path, where: str | None = None) -> Manifest:
    store = _store(store_or_url)
    where = where or store.url
    try:
        raw = read_bytes(store, MANIFEST)
    except NotFoundError:
        raise NotFoundError(f"no {MANIFEST} under {where}: not a shard dataset, or it was never completed (the manifest is written last)") from None
    try:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise FormatError(f"{where}/{MANIFEST} is not a {FORMAT} v{VERSION} manifest")
        shards = [ShardInfo(**s) for s in doc["shards"]]
        man = Manifest(list(doc["fields"]), shards, int(doc["num_samples"]), dict(doc.get("meta") or {}), xxh3(raw))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise FormatError(f"{where}/{MANIFEST} is malformed ({exc}); rewrite the dataset") from None
    total = 0
    for s in man.shards:
        if s.first_sample != total or s.samples < 0:
            raise FormatError(f"{where}/{MANIFEST}: sample counts of {s.key} are inconsistent; the manifest is corrupt")
        total += s.samples
    if total != man.num_samples:
        raise FormatError(f"{where}/{MANIFEST}: shards hold {total} samples, manifest says {man.num_samples}")
    return man


def parse_index(raw: bytes, info: ShardInfo, nfields: int, where: str) -> np.ndarray:
    """The sidecar index of one shard, verified: int64 [samples, 2*fields + 1]."""
    got = xxh3(raw)
    if got != info.index_xxh3:
        raise IntegrityError(f"{where}: index checksum mismatch (expected xxh3 {info.index_xxh3}, got {got}); this copy is corrupt")
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as exc:
        raise FormatError(f"{where}: unreadable shard index ({exc})") from None
    if arr.dtype != np.int64 or arr.shape != (info.samples, 2 * nfields + 1):
        raise FormatError(f"{where}: shard index has shape {arr.shape}, expected ({info.samples}, {2 * nfields + 1})")
    return arr


class ShardWriter:
    """Write samples (dicts of field -> array) into tar shards of at least ``shard_size`` bytes.

    Each finished shard and its index are uploaded to ``store`` under ``prefix``; ``close()``
    writes the manifest last. Use as a context manager: on error no manifest is written, so
    readers never see a half-written dataset.
    """

    def __init__(
        self, store: Store | str | Path, fields: Iterable[str], *, shard_size: int | str = DEFAULT_SHARD_SIZE,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.store = _store(store)
        self.fields = list(fields)
        if not self.fields or any(("." in f or "/" in f or not f) for f in self.fields):
            raise ConfigError(f"field names must be non-empty and contain no '.' or '/': {self.fields}")
        self.shard_size = parse_size(shard_size)
        if self.shard_size < 1:
            raise ConfigError("shard_size must be positive")
        self.meta = dict(meta or {})
        self.shards: list[ShardInfo] = []
        self.num_samples = 0
        self._reset()
        self.manifest: Manifest | None = None

    def _reset(self) -> None:
        self._buf = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buf, mode="w", format=tarfile.USTAR_FORMAT)
        self._rows: list[list[int]] = []

    def write(self, sample: dict[str, Any]) -> None:
        missing = [f for f in self.fields if f not in sample]
        if missing:
            raise ConfigError(f"sample {self.num_samples} lacks field(s) {missing}")
        key = f"{self.num_samples:012d}"
        row: list[int] = []
        h = xxhash.xxh3_64()
        for f in self.fields:
            payload = encode_npy(np.asarray(sample[f]))
            info = tarfile.TarInfo(f"{key}.{f}.npy")
            info.size = len(payload)
            info.mode = 0o444
            header_at = self._tar.offset
            self._tar.addfile(info, io.BytesIO(payload))
            row += [header_at + tarfile.BLOCKSIZE, len(payload)]  # USTAR: one 512-byte header
            h.update(payload)
        digest = h.intdigest()
        row.append(digest - (1 << 64) if digest >= (1 << 63) else digest)  # stored as int64
        self._rows.append(row)
        self.num_samples += 1
        if self._buf.tell() >= self.shard_size:
            self._flush()

    def write_all(self, samples: Iterable[dict[str, Any]]) -> None:
        for s in samples:
            self.write(s)

    def _flush(self) -> None:
        if not self._rows:
            return
        self._tar.close()
        data = self._buf.getbuffer()
        n = len(self.shards)
        key = f"shard-{n:06d}.tar"
        ikey = f"shard-{n:06d}.idx.npy"
        index = np.asarray(self._rows, dtype=np.int64)
        raw_index = encode_npy(index)
        self.store.put_buffers(key, [data])
        self.store.put_buffers(ikey, [raw_index])
        first = self.num_samples - len(self._rows)
        self.shards.append(ShardInfo(key, len(data), xxh3(data), len(self._rows), first, ikey, len(raw_index), xxh3(raw_index)))
        del data
        self._reset()

    def close(self) -> Manifest:
        if self.manifest is not None:
            return self.manifest
        self._flush()
        doc = {
            "format": FORMAT, "version": VERSION, "fields": self.fields, "num_samples": self.num_samples,
            "meta": self.meta, "shards": [s.to_dict() for s in self.shards],
        }
        raw = json.dumps(doc, indent=1).encode()
        self.store.put_buffers(MANIFEST, [raw])
        self.manifest = Manifest(self.fields, self.shards, self.num_samples, self.meta, xxh3(raw))
        return self.manifest

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


def write_packed_shards(packed, store: Store | str | Path, *, shard_size: int | str = DEFAULT_SHARD_SIZE) -> Manifest:
    """Write every pack of a PackedDataset as a sample {tokens, seqlens} (tokens in the corpus dtype)."""
    meta = {"kind": "packed", "seq_len": packed.plan.seq_len, "algorithm": packed.plan.algorithm, "source": packed.plan.source}
    with ShardWriter(store, ["tokens", "seqlens"], shard_size=shard_size, meta=meta) as w:
        for i in range(len(packed)):
            tokens, lens = packed.pack_tokens(i)
            w.write({"tokens": tokens, "seqlens": lens})
    return w.manifest  # type: ignore[return-value]


def verify_file(path: str | Path, expected: str, size: int, where: str) -> None:
    """Stream a local file through xxh3 and compare (IntegrityError naming ``where``)."""
    p = Path(path)
    h = xxhash.xxh3_64()
    n = 0
    try:
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(8 << 20)
            mv = memoryview(buf)
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                h.update(mv[:got])
                n += got
    except OSError as exc:
        raise os_error(exc, p, "verifying") from exc
    if n != size:
        raise IntegrityError(f"{where}: {n} bytes, manifest says {size}; the copy is truncated or wrong")
    got_hex = f"{h.intdigest():016x}"
    if got_hex != expected:
        raise IntegrityError(f"{where}: checksum mismatch (expected xxh3 {expected}, got {got_hex}); this copy is corrupt")


class ShardFile:
    """A local shard file, memory-mapped; ``sample(i)`` returns zero-copy arrays per field."""

    def __init__(self, path: str | Path, index: np.ndarray, fields: list[str], on_close: Any = None) -> None:
        """``on_close``: called once when the shard is closed (e.g. to release a cache lock)."""
        self.path = Path(path)
        self.fields = fields
        self.index = index
        self._on_close = on_close
        try:
            with open(self.path, "rb") as f:  # the mapping keeps its own descriptor
                size = os.fstat(f.fileno()).st_size
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            if on_close is not None:
                on_close()
            raise os_error(exc, self.path, "opening shard") from exc
        if len(index):
            last = index[:, 0 : 2 * len(fields) : 2] + index[:, 1 : 2 * len(fields) : 2]
            if int(last.max()) > size:
                self.close()
                raise FormatError(f"{self.path}: shard is {size} bytes but its index points past the end; the shard is truncated")

    def __len__(self) -> int:
        return len(self.index)

    def sample(self, i: int) -> dict[str, np.ndarray]:
        row = self.index[i]
        return {f: decode_npy(self._mm, int(row[2 * j]), int(row[2 * j + 1])) for j, f in enumerate(self.fields)}

    def close(self) -> None:
        # the mapping is left to the garbage collector: samples handed out may still view it
        self._mm = b""
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()


def iter_tar_samples(path: str | Path) -> Iterator[dict[str, Any]]:
    """Read a shard sequentially with the standard library only (no index): grouping by key."""
    current: dict[str, Any] = {}
    key = None
    with tarfile.open(path, mode="r") as tar:
        for m in tar:
            if not m.isfile():
                continue
            base = m.name.rsplit("/", 1)[-1]
            k, _, rest = base.partition(".")
            if key is not None and k != key:
                yield current
                current = {}
            key = k
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            name = rest[:-4] if rest.endswith(".npy") else rest
            current[name] = np.load(io.BytesIO(data), allow_pickle=False) if rest.endswith(".npy") else data
            current["__key__"] = k
    if current:
        yield current
