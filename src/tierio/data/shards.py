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

import io
import json
import math
import mmap
import os
import re
import struct
import tarfile
import tokenize
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
from tierio.io.paths import open_regular
from tierio.io.untrusted import MAX_COUNT, PARSE_ERRORS, Fields, loads, parser, parsing
from tierio.storage.base import Store, check_key, read_bytes
from tierio.units import parse_size

MANIFEST = "index.json"
FORMAT = "tierio-shards"
VERSION = 1
DEFAULT_SHARD_SIZE = 64 << 20
MAX_MANIFEST_BYTES = 64 << 20  # a million shards fit
MAX_SHARDS = 1 << 22
MAX_FIELDS = 1 << 10
TAR_HEADER = 512  # every field of every sample is a tar member behind its own 512-byte header
NPY_HEADER_MAX = 10_000  # numpy's own limit on the header of a .npy it will read
NPY_MAGIC = b"\x93NUMPY"
_FIELD = re.compile(r"[^./\x00]{1,255}")  # a field name is part of a tar member's name


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
def _npy_header(head: bytes) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape from the whole header of a .npy (preamble included), checked; cached:
    headers repeat for samples of the same shape. Parsed by numpy's own header reader."""
    with parsing("sample field (.npy header)"):
        version = (head[6], head[7])
        f = io.BytesIO(head[8:])
        try:
            if version == (1, 0):
                d = np.lib.format.read_array_header_1_0(f, max_header_size=NPY_HEADER_MAX)
            else:
                d = np.lib.format.read_array_header_2_0(f, max_header_size=NPY_HEADER_MAX)
        except tokenize.TokenError as exc:  # numpy tokenizes headers of old writers
            raise FormatError(f"sample field has a malformed .npy header ({exc})") from None
        shape, fortran, dtype = d
        if dtype.hasobject or fortran or dtype.itemsize == 0:
            raise FormatError("sample field holds objects, Fortran-ordered or zero-width data; shards carry plain arrays only")
        if len(shape) > 32 or min(shape, default=0) < 0 or math.prod(n for n in shape if n) * dtype.itemsize > MAX_COUNT:
            raise FormatError(f"sample field claims an absurd shape {shape}; the shard is corrupt")
        return dtype, tuple(shape)


def decode_npy(buf, offset: int = 0, size: int | None = None, *, what: str = "sample field") -> np.ndarray:
    """Zero-copy view of a .npy payload at ``buf[offset:offset+size]`` (bytes, mmap or memoryview).

    Every length is checked against the bytes there: a damaged array is a FormatError whose
    message starts with ``what``. Nothing is allocated from a declared shape."""
    mv = memoryview(buf)
    end = len(mv) if size is None else offset + size
    if not 0 <= offset <= end <= len(mv):
        raise FormatError(f"{what} at bytes {offset}..{end} lies outside its {len(mv)} bytes; the index is corrupt")
    first = bytes(mv[offset : min(end, offset + 12)])
    if len(first) < 10 or first[:6] != NPY_MAGIC or first[6] not in (1, 2, 3):
        raise FormatError(f"{what} is not a .npy array; it is corrupt")
    start = 10 if first[6] == 1 else 12
    if len(first) < start:
        raise FormatError(f"{what} is shorter than a .npy preamble; it is corrupt")
    hlen = struct.unpack_from("<H" if start == 10 else "<I", first, 8)[0]
    data_start = offset + start + hlen
    if hlen > NPY_HEADER_MAX or data_start > end:
        raise FormatError(f"{what} has a {hlen}-byte .npy header in {end - offset} bytes; it is corrupt")
    dtype, shape = _npy_header(bytes(mv[offset:data_start]))
    count = math.prod(shape)
    if data_start + count * dtype.itemsize > end:
        raise FormatError(f"{what} is shorter than its .npy header says; it is truncated")
    try:  # cannot fail after the checks above; a last net for numpy's own refusals
        return np.frombuffer(mv, dtype=dtype, count=count, offset=data_start).reshape(shape)
    except PARSE_ERRORS as exc:
        raise FormatError(f"{what} cannot be read as {dtype} {shape} ({exc}); it is corrupt") from None


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
    """Read and strictly parse a dataset's ``index.json`` (only TierioErrors come out)."""
    store = _store(store_or_url)
    where = where or store.url
    try:
        size = store.stat(MANIFEST).size
    except NotFoundError:
        raise NotFoundError(f"no {MANIFEST} under {where}: not a shard dataset, or it was never completed (the manifest is written last)") from None
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where}/{MANIFEST} is {size} bytes, above the {MAX_MANIFEST_BYTES}-byte limit; it is corrupt or hostile")
    return parse_manifest(read_bytes(store, MANIFEST, 0, size), f"{where}/{MANIFEST}")


def check_field(name: Any, where: str) -> str:
    """A field name: part of tar member names ``<key>.<field>.npy``, so no '.', '/' or NUL."""
    if not isinstance(name, str) or not _FIELD.fullmatch(name):
        raise FormatError(f"{where}: field name {name!r:.80} must be 1-255 characters without '.', '/' or NUL")
    return name


def _shard_info(doc: Any, where: str, manifest: str, nfields: int) -> ShardInfo:
    f = Fields(doc, where)
    info = ShardInfo(
        key=check_key(f.str("key", 1024), manifest),
        size=f.int("size"),
        xxh3=f.hex("xxh3", 16),
        samples=f.int("samples"),
        first_sample=f.int("first_sample"),
        index_key=check_key(f.str("index_key", 1024), manifest),
        index_size=f.int("index_size"),
        index_xxh3=f.hex("index_xxh3", 16),
    )
    # Declared counts are checked against declared sizes before anything is allocated from them:
    # every sample holds `nfields` tar members, and its index row is (2 * nfields + 1) int64s.
    if info.samples * nfields * TAR_HEADER > info.size:
        raise FormatError(f"{where}: {info.samples} samples of {nfields} fields cannot fit in {info.size} bytes of tar")
    header = info.index_size - info.samples * index_row_bytes(nfields)
    if not 0 < header <= NPY_HEADER_MAX + 12:
        raise FormatError(f"{where}: an index of {info.samples} samples cannot be {info.index_size} bytes")
    return info


def index_row_bytes(nfields: int) -> int:
    """Bytes of one sample's row in a shard index: offset and size of each field, and an xxh3."""
    return 8 * (2 * nfields + 1)


@parser
def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Strictly parse the bytes of a dataset manifest: typed fields, keys that stay inside the
    dataset, hex digests, and counts consistent with each other and with the declared sizes."""
    doc = Fields(loads(raw, where, limit=MAX_MANIFEST_BYTES), where)
    if doc.doc.get("format") != FORMAT or doc.doc.get("version") != VERSION or type(doc.doc.get("version")) is not int:
        raise FormatError(f"{where} is not a {FORMAT} v{VERSION} manifest")
    fields = [check_field(x, where) for x in doc.list("fields", MAX_FIELDS)]
    if not fields or len(set(fields)) != len(fields):
        raise FormatError(f"{where}: fields {fields!r:.200} must be distinct and at least one")
    num_samples = doc.int("num_samples")
    meta = doc.obj("meta", default=None)
    shards = [_shard_info(x, f"{where} shard {i}", where, len(fields)) for i, x in enumerate(doc.list("shards", MAX_SHARDS))]
    total = 0
    keys: set[str] = {MANIFEST}
    for s in shards:
        if s.first_sample != total:
            raise FormatError(f"{where}: sample counts of {s.key} are inconsistent; the manifest is corrupt")
        total += s.samples
        if s.key in keys or s.index_key in keys or s.key == s.index_key:
            raise FormatError(f"{where}: {s.key} or {s.index_key} is named twice; the manifest is corrupt")
        keys.update((s.key, s.index_key))
    if total != num_samples:
        raise FormatError(f"{where}: shards hold {total} samples, manifest says {num_samples}")
    return Manifest(fields, shards, num_samples, {} if meta is None else meta.doc, xxh3(raw))


@parser
def parse_index(raw: bytes, info: ShardInfo, nfields: int, where: str) -> np.ndarray:
    """The sidecar index of one shard, verified: int64 [samples, 2*fields + 1], read-only.

    Its size and checksum are those of the manifest, its row count is its size less its header
    over the row size, and every field it points at lies inside the shard."""
    if len(raw) != info.index_size:
        raise IntegrityError(f"{where}: index is {len(raw)} bytes, the manifest says {info.index_size}; this copy is truncated or wrong")
    got = xxh3(raw)
    if got != info.index_xxh3:
        raise IntegrityError(f"{where}: index checksum mismatch (expected xxh3 {info.index_xxh3}, got {got}); this copy is corrupt")
    row = index_row_bytes(nfields)
    if raw[:6] != NPY_MAGIC or raw[6] not in (1, 2, 3) or len(raw) < 12:
        raise FormatError(f"{where}: not a .npy shard index")
    start = 10 if raw[6] == 1 else 12
    hlen = struct.unpack_from("<H" if start == 10 else "<I", raw, 8)[0]
    data = start + hlen
    if data > len(raw) or (len(raw) - data) % row or (len(raw) - data) // row != info.samples:
        raise FormatError(f"{where}: a {len(raw)}-byte index with a {data}-byte header does not hold {info.samples} rows of {row} bytes")
    dtype, shape = _npy_header(raw[:data])
    if dtype != np.dtype("<i8") or shape != (info.samples, 2 * nfields + 1):
        raise FormatError(f"{where}: shard index is {dtype} {shape}, expected int64 ({info.samples}, {2 * nfields + 1})")
    arr = np.frombuffer(raw, dtype="<i8", count=info.samples * (2 * nfields + 1), offset=data).reshape(shape)
    spans = arr[:, : 2 * nfields]
    if spans.size and (int(spans.min()) < 0 or int(spans.max()) > info.size
                       or int((spans[:, 0::2] + spans[:, 1::2]).max()) > info.size):
        raise FormatError(f"{where}: the index points outside its {info.size}-byte shard; the index is corrupt")
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
        if not self.fields or len(set(self.fields)) != len(self.fields) or not all(
            isinstance(f, str) and _FIELD.fullmatch(f) for f in self.fields
        ):
            raise ConfigError(f"field names must be distinct, 1-255 characters, with no '.', '/' or NUL: {self.fields}")
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
        try:
            raw = json.dumps(doc, indent=1, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"dataset meta must be plain JSON without NaN or infinity: {exc}") from None
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
            fd = open_regular(self.path)  # a FIFO in its place is refused, not waited on
            try:  # the mapping keeps its own descriptor
                size = os.fstat(fd).st_size
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
            finally:
                os.close(fd)
        except OSError as exc:
            if on_close is not None:
                on_close()
            raise os_error(exc, self.path, "opening shard") from exc
        except BaseException:
            if on_close is not None:
                on_close()
            raise
        spans = index[:, : 2 * len(fields)]
        if spans.size and (int(spans.min()) < 0 or int(spans.max()) > size or int((spans[:, 0::2] + spans[:, 1::2]).max()) > size):
            self.close()
            raise FormatError(f"{self.path}: shard is {size} bytes but its index points outside it; the shard is truncated or the index corrupt")

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
    """Read a shard sequentially with the standard library only (no index): grouping by key.

    A damaged shard is a FormatError naming it."""
    try:
        yield from _tar_samples(path)
    except tarfile.TarError as exc:
        raise FormatError(f"{path} is not a readable tar shard ({exc}); the shard is corrupt") from None


def _open_shard(path: str | Path) -> int:
    try:
        return open_regular(path)
    except OSError as exc:
        raise os_error(exc, path, "opening shard") from exc


def _tar_samples(path: str | Path) -> Iterator[dict[str, Any]]:
    current: dict[str, Any] = {}
    key = None
    with parsing(str(path)), os.fdopen(_open_shard(path), "rb") as f, tarfile.open(fileobj=f, mode="r") as tar:
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
