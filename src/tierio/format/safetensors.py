"""The safetensors container: dtype names, header layout, and a strict header parser.

Layout: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (relative to
the data section) plus an optional "__metadata__" of string to string. tierio writes headers
padded with spaces so the data section starts at a multiple of 64 and orders tensors by element
size, so every tensor starts at a multiple of its element size (views need no copy).

The parser trusts nothing: sizes are bounded, offsets must lie inside the file, tensors may not
overlap, dtypes must be known and byte counts must match shapes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio.errors import FormatError
from tierio.io.untrusted import MAX_COUNT, brief, check_dict, loads, parser

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
HEADER_FLOOR = 1 << 20  # room for metadata and empty tensors, whatever the data section
HEADER_BYTES_PER_DATA_BYTE = 128  # a one-byte scalar takes ~100 bytes of header JSON
MAX_DIMS = 64
DATA_ALIGN = 64

# safetensors dtype name -> torch dtype. Element sizes come from torch.
_ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu"):
    _ST_TO_TORCH["F8_E8M0"] = torch.float8_e8m0fnu
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}
ITEMSIZES: dict[str, int] = {k: v.itemsize for k, v in _ST_TO_TORCH.items()}  # element size by dtype name


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors name of a torch dtype ("BF16")."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no safetensors name; convert the tensor first") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _ST_TO_TORCH[name]
    except KeyError:
        raise FormatError(f"unknown dtype {name!r}; known: {', '.join(sorted(_ST_TO_TORCH))}") from None


def itemsize(name: str) -> int:
    size = ITEMSIZES.get(name)
    return torch_dtype(name).itemsize if size is None else size


@dataclass(frozen=True, slots=True)  # a header may describe tens of thousands
class TensorEntry:
    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Header:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    header_len: int = 0

    @property
    def data_offset(self) -> int:
        """File offset of the data section."""
        return 8 + self.header_len

    @property
    def data_bytes(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)


def build_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, Header]:
    """Lay out (name, dtype name, shape) tensors; returns (the 8 + N header bytes, Header).

    Larger element sizes go first so every tensor begins at a multiple of its element size.
    """
    items = sorted(tensors, key=lambda t: (-itemsize(t[1]), t[0]))
    entries: dict[str, TensorEntry] = {}
    pos = 0
    for name, dt, shape in items:
        if name in entries or name == "__metadata__":
            raise FormatError(f"duplicate or reserved tensor name {name!r}")
        n = math.prod(shape) * itemsize(dt)
        entries[name] = TensorEntry(name, dt, tuple(int(s) for s in shape), pos, pos + n)
        pos += n
    doc: dict = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for e in entries.values():
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    padded = -(-(8 + len(raw)) // DATA_ALIGN) * DATA_ALIGN - 8
    raw = raw + b" " * (padded - len(raw))
    return struct.pack("<Q", len(raw)) + raw, Header(entries, dict(doc.get("__metadata__", {})), len(raw))


def header_limit(data_bytes: int) -> int:
    """The largest header accepted in front of a data section of ``data_bytes``.

    A header describes tensors in the data section: about 100 bytes of JSON per tensor, and every
    tensor that is not empty holds at least one byte there. So beyond a floor (metadata and empty
    tensors), a header may be at most ``HEADER_BYTES_PER_DATA_BYTE`` times the data it describes:
    a huge header in front of little data is refused before it is read or parsed."""
    return min(MAX_HEADER_BYTES, HEADER_FLOOR + HEADER_BYTES_PER_DATA_BYTE * max(0, data_bytes))


@parser
def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """Validate the 8-byte length prefix against the file's real size; returns N."""
    if len(prefix) < 8 or file_size < 8:
        raise FormatError(f"{where}: file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: header claims {n} bytes, above the {MAX_HEADER_BYTES}-byte limit; the file is corrupt or hostile")
    if 8 + n > file_size:
        raise FormatError(f"{where}: header claims {n} bytes but the file is only {file_size} bytes; the file is truncated")
    data = file_size - 8 - n
    if n > header_limit(data):
        raise FormatError(
            f"{where}: header claims {n} bytes for a data section of {data} bytes, above the {header_limit(data)} bytes "
            "a header can need to describe it; the file is corrupt or hostile"
        )
    return n


def _dims_ok(v: Any) -> bool:
    return type(v) is list and len(v) <= MAX_DIMS and all(type(x) is int and 0 <= x <= MAX_COUNT for x in v)


def _entry(name: str, info: Any, data_size: int, where: str) -> TensorEntry:
    if type(info) is not dict:
        raise FormatError(f"{where}: entry {name!r} is not an object")
    dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    size = ITEMSIZES.get(dt) if type(dt) is str else None
    if size is None:
        raise FormatError(f"{where}: tensor {name!r} has unknown dtype {brief(dt)}")
    if not _dims_ok(shape) or math.prod(d for d in shape if d) > MAX_COUNT:
        raise FormatError(f"{where}: tensor {name!r} has an invalid shape {brief(shape)}")
    if not (type(offs) is list and len(offs) == 2 and all(type(o) is int for o in offs)):
        raise FormatError(f"{where}: tensor {name!r} has invalid data_offsets {brief(offs)}")
    begin, end = offs
    if not 0 <= begin <= end <= data_size:
        raise FormatError(
            f"{where}: tensor {name!r} spans bytes {begin}..{end} of a {data_size}-byte data section; "
            "the file is truncated or the header is corrupt"
        )
    if end - begin != math.prod(shape) * size:
        raise FormatError(f"{where}: tensor {name!r} has {end - begin} bytes but shape {shape} of {dt} needs {math.prod(shape) * size}")
    return TensorEntry(name, dt, tuple(shape), begin, end)


@parser
def parse_header(raw: bytes, file_size: int, where: str) -> Header:
    """Strictly parse the JSON header (``raw`` = the N header bytes) of a file of ``file_size`` bytes.

    Only FormatError comes out, whatever the bytes."""
    doc = check_dict(loads(raw, f"{where}: header", limit=header_limit(file_size - 8 - len(raw))), f"{where}: header")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{where}: __metadata__ must map strings to strings")
    data_size = file_size - 8 - len(raw)
    entries = {name: _entry(name, info, data_size, where) for name, info in doc.items()}
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.begin)
    for a, b in zip(ordered, ordered[1:]):
        if b.begin < a.end:
            raise FormatError(f"{where}: tensors {a.name!r} and {b.name!r} overlap in the data section")
    return Header(entries, meta, len(raw))


@parser
def read_header_from(read: Callable[[int, int], bytes], file_size: int, where: str) -> Header:
    """Parse a header using ``read(offset, length) -> bytes`` (a file, a store key, a buffer).

    The length prefix is checked against ``file_size`` before the header is read."""
    n = header_length(read(0, 8), file_size, where)
    raw = read(8, n)
    if len(raw) != n:
        raise FormatError(f"{where}: header ends after {len(raw)} of its {n} bytes; the file is truncated")
    return parse_header(raw, file_size, where)
