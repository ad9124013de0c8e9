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
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tierio.errors import FormatError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
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
    return torch_dtype(name).itemsize


@dataclass(frozen=True)
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


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """Validate the 8-byte length prefix; returns N."""
    if len(prefix) < 8 or file_size < 8:
        raise FormatError(f"{where}: file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: header claims {n} bytes, above the {MAX_HEADER_BYTES}-byte limit; the file is corrupt or hostile")
    if 8 + n > file_size:
        raise FormatError(f"{where}: header claims {n} bytes but the file is only {file_size} bytes; the file is truncated")
    return n


def parse_header(raw: bytes, file_size: int, where: str) -> Header:
    """Strictly parse the JSON header (``raw`` = the N header bytes) of a file of ``file_size`` bytes."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{where}: header is not valid JSON ({exc}); the file is corrupt") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: header must be a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{where}: __metadata__ must map strings to strings")
    data_size = file_size - 8 - len(raw)
    entries: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise FormatError(f"{where}: entry {name!r} is not an object")
        dt = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if not isinstance(dt, str):
            raise FormatError(f"{where}: tensor {name!r} has no dtype")
        size = itemsize(dt) if dt in _ST_TO_TORCH else None
        if size is None:
            raise FormatError(f"{where}: tensor {name!r} has unknown dtype {dt!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise FormatError(f"{where}: tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise FormatError(f"{where}: tensor {name!r} has invalid data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_size:
            raise FormatError(
                f"{where}: tensor {name!r} spans bytes {begin}..{end} of a {data_size}-byte data section; "
                "the file is truncated or the header is corrupt"
            )
        if end - begin != math.prod(shape) * size:
            raise FormatError(f"{where}: tensor {name!r} has {end - begin} bytes but shape {shape} of {dt} needs {math.prod(shape) * size}")
        entries[name] = TensorEntry(name, dt, tuple(shape), begin, end)
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.begin)
    for a, b in zip(ordered, ordered[1:]):
        if b.begin < a.end:
            raise FormatError(f"{where}: tensors {a.name!r} and {b.name!r} overlap in the data section")
    return Header(entries, meta, len(raw))


def read_header_from(read: "callable", file_size: int, where: str) -> Header:
    """Parse a header using ``read(offset, length) -> bytes`` (a file, a store key, a buffer)."""
    n = header_length(read(0, 8), file_size, where)
    return parse_header(read(8, n), file_size, where)
