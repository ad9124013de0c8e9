"""The WebDataset layout: samples as members of plain POSIX tar files, plus a sidecar index.

A shard of this layout is

    shard-000000.tar        samples as tar members "<key>.<field>.npy" (numpy .npy payloads)
    shard-000000.idx.npy    per-sample index: byte offset and size of each field, xxh3 of the sample

Any tar tool, and ``webdataset.WebDataset(url)``, reads the shards as they are; the index gives a
sample with one ranged read or one slice of a mapped file, without scanning the tar. Each member
carries a 512-byte header and padding and each payload a .npy header, so this layout costs ~1 KiB
per sample field over the raw bytes: the compact container (``tierio.data.columns``) is the
default, this one is there for tools that read WebDataset shards (``ShardWriter(format="tar")``,
``tierio data export --webdataset``).
"""

from __future__ import annotations

import io
import math
import os
import re
import struct
import tarfile
import tokenize
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tierio.data.shardinfo import ShardInfo
from tierio.errors import ConfigError, FormatError, IntegrityError
from tierio.io.checksum import StreamingChecksum, xxh3
from tierio.io.files import map_readonly, os_error
from tierio.io.paths import open_regular
from tierio.io.untrusted import MAX_COUNT, PARSE_ERRORS, parser, parsing

TAR_HEADER = 512  # every field of every sample is a tar member behind its own 512-byte header
NPY_HEADER_MAX = 10_000  # numpy's own limit on the header of a .npy it will read
NPY_MAGIC = b"\x93NUMPY"
FIELD_NAME = re.compile(r"[^./\x00]{1,255}")  # a field name is part of a tar member's name


def encode_npy(arr: np.ndarray) -> bytes:
    a = np.asarray(arr)
    if not a.flags.c_contiguous:  # not np.ascontiguousarray: that turns a 0-d array into a 1-d one
        a = a.copy(order="C")
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, allow_pickle=False)
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


def index_row_bytes(nfields: int) -> int:
    """Bytes of one sample's row in a shard index: offset and size of each field, and an xxh3."""
    return 8 * (2 * nfields + 1)

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


class TarShardBuilder:
    """Collects samples as tar members in memory until the shard holds ``shard_size`` bytes."""

    def __init__(self, fields: list[str], shard_size: int) -> None:
        self.fields = fields
        self.shard_size = shard_size
        self._fresh()

    def _fresh(self) -> None:
        self._buf = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buf, mode="w", format=tarfile.USTAR_FORMAT)
        self._rows: list[list[int]] = []

    @property
    def samples(self) -> int:
        return len(self._rows)

    def add(self, sample: dict[str, Any], number: int) -> bool:
        """Add sample ``number`` of the dataset; True once the shard is full."""
        missing = [f for f in self.fields if f not in sample]
        if missing:
            raise ConfigError(f"sample {number} lacks field(s) {missing}")
        key = f"{number:012d}"
        row: list[int] = []
        h = StreamingChecksum()
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
        return self._buf.tell() >= self.shard_size

    def build(self) -> tuple[memoryview, bytes]:
        """The shard's bytes and its index file; the builder starts a new shard afterwards."""
        self._tar.close()
        data = self._buf.getbuffer()
        index = encode_npy(np.asarray(self._rows, dtype=np.int64))
        self._fresh()
        return data, index


class ShardFile:
    """A local shard file, memory-mapped; ``sample(i)`` returns zero-copy arrays per field."""

    def __init__(self, path: str | Path, index: np.ndarray, fields: list[str], on_close: Any = None) -> None:
        """``on_close``: called once when the shard is closed (e.g. to release a cache lock)."""
        self.path = Path(path)
        self.fields = fields
        self.index = index
        self._on_close = on_close
        try:
            self._mm: Any = map_readonly(self.path)  # a FIFO in its place is refused, not waited on
        except BaseException:
            if on_close is not None:
                on_close()
            raise
        size = len(self._mm)
        spans = index[:, : 2 * len(fields)]
        if spans.size and (int(spans.min()) < 0 or int(spans.max()) > size or int((spans[:, 0::2] + spans[:, 1::2]).max()) > size):
            self.close()
            raise FormatError(f"{self.path}: shard is {size} bytes but its index points outside it; the shard is truncated or the index corrupt")

    def __len__(self) -> int:
        return len(self.index)

    def sample(self, i: int) -> dict[str, np.ndarray]:
        row = self.index[i]
        return {f: decode_npy(self._mm, int(row[2 * j]), int(row[2 * j + 1])) for j, f in enumerate(self.fields)}

    def take(self, ids: np.ndarray, copy: bool = True, out: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """A batch of samples: fields of one shape stacked (one copy), others as lists (``out`` is
        not used: tar shards carry no field types to size it by)."""
        rows = [self.sample(int(i)) for i in ids]
        out: dict[str, Any] = {}
        for f in self.fields:
            arrays = [r[f] for r in rows]
            if arrays and all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays):
                out[f] = np.stack(arrays)
            else:
                out[f] = [a.copy() for a in arrays] if copy else arrays
        return out

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
