"""The on-disk format of a Megatron-LM indexed dataset: the ``.idx`` header and index, dtype codes and
the file names of a prefix (what the writer and the reader of tierio.data.indexed both use)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierio.errors import ConfigError, FormatError
from tierio.io.durable import atomic_write
from tierio.io.files import os_error
from tierio.io.paths import open_regular
from tierio.io.untrusted import parser

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}

# Megatron's threshold: a vocabulary below 65,500 tokens fits uint16, otherwise int32.
UINT16_VOCAB_LIMIT = 65500


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """The smallest token dtype Megatron-LM would pick for a vocabulary of ``vocab_size``."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype: Any) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        names = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise ConfigError(f"dtype {dt} has no Megatron code; use one of {names}")
    return _CODE_OF[dt]


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def strip_suffix(path: str | Path) -> str:
    """Accept ``corpus``, ``corpus.bin`` or ``corpus.idx`` and return the prefix ``corpus``."""
    s = str(path)
    for suffix in (".idx", ".bin"):
        if s.endswith(suffix):
            return s[: -len(suffix)]
    return s


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequence_count: int
    document_count: int  # entries of document_indices, i.e. documents + 1


def read_header(path: str | Path) -> IndexHeader:
    p = Path(path)
    fd = open_data_file(p, "reading index")
    try:
        head = os.pread(fd, HEADER_SIZE, 0)
    except OSError as exc:
        raise os_error(exc, p, "reading index") from exc
    finally:
        os.close(fd)
    return parse_header(head, str(p))


def open_data_file(path: Path, doing: str) -> int:
    """A descriptor of an existing regular file: a FIFO or device in its place is refused, not
    waited on (a reader would block forever on a FIFO nobody writes)."""
    try:
        return open_regular(path)
    except OSError as exc:
        raise os_error(exc, path, doing) from exc


@parser
def parse_header(head: bytes, where: str) -> IndexHeader:
    """The fixed header at the start of an ``.idx`` (``head`` = its first HEADER_SIZE bytes)."""
    if len(head) < HEADER_SIZE:
        raise FormatError(f"{where}: index is {len(head)} bytes, shorter than its {HEADER_SIZE}-byte header; the file is truncated, rebuild it")
    if head[:9] != MAGIC:
        raise FormatError(f"{where}: not a Megatron MMIDIDX index (magic {head[:9]!r}); pass the .idx written with its .bin")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != VERSION:
        raise FormatError(f"{where}: index version {version} is not supported (only version {VERSION})")
    code = head[17]
    if code not in DTYPE_CODES:
        raise FormatError(f"{where}: unknown dtype code {code} in index header; the file is corrupt")
    n, d = struct.unpack_from("<QQ", head, 18)
    return IndexHeader(DTYPE_CODES[code], int(n), int(d))


def index_parts(
    dtype: Any, sequence_lengths: np.ndarray, document_indices: np.ndarray, sequence_modes: np.ndarray | None = None,
) -> list[bytes]:
    """The bytes of an ``.idx`` in order; pointers are derived from the lengths."""
    dt = np.dtype(dtype)
    lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dt.itemsize
    docs = np.ascontiguousarray(document_indices, dtype=np.int64)
    parts = [
        MAGIC,
        struct.pack("<Q", VERSION),
        struct.pack("<B", dtype_code(dt)),
        struct.pack("<Q", len(lengths)),
        struct.pack("<Q", len(docs)),
        lengths.tobytes(),
        pointers.tobytes(),
        docs.tobytes(),
    ]
    if sequence_modes is not None:
        parts.append(np.ascontiguousarray(sequence_modes, dtype=np.int8).tobytes())
    return parts


def write_index(
    path: str | Path,
    dtype: Any,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: np.ndarray | None = None,
) -> None:
    """Write an ``.idx`` file alone, atomically (temp + fsync + rename). A new dataset's pair is
    published together by :class:`IndexedDatasetWriter` instead."""
    atomic_write(Path(path), index_parts(dtype, sequence_lengths, document_indices, sequence_modes), direct=False)


class _Growable:
    """An append-only numpy array that doubles its capacity (amortised O(1), no Python lists)."""

    def __init__(self, dtype: Any, capacity: int = 1024) -> None:
        self._a = np.empty(capacity, dtype=dtype)
        self._n = 0

    def append(self, value: int) -> None:
        if self._n == len(self._a):
            self._a = np.resize(self._a, 2 * len(self._a))
        self._a[self._n] = value
        self._n += 1

    def extend(self, values: np.ndarray) -> None:
        need = self._n + len(values)
        if need > len(self._a):
            self._a = np.resize(self._a, max(need, 2 * len(self._a)))
        self._a[self._n : need] = values
        self._n = need

    def __len__(self) -> int:
        return self._n

    def view(self) -> np.ndarray:
        return self._a[: self._n]
