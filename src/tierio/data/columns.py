"""The compact shard container ("columns"): each field's samples stored contiguously.

A shard is one file holding one column per field, back to back, each starting at a multiple of
``ALIGN`` bytes:

* **fixed storage** (every sample of the field in this shard has the same shape): one C-ordered
  array ``[samples, *shape]``;
* **ragged storage** (samples differ along their first axis): the values ``[rows, *row_shape]``,
  then ``samples + 1`` little-endian int64 offsets into them (in rows).

Nothing else is in the file: no header, no per-sample framing. A shard is the raw sample bytes
plus at most ``ALIGN - 1`` bytes of padding per column (and 8 bytes per sample for a ragged
field), and any sample or run of samples of a field is one slice. Where each column starts and
its shape are in the dataset manifest, with the shard's xxh3 and the xxh3 of every ``window``
bytes (``columns_window_digests``), so a download is checked window by window as it arrives and a
copy is never read back to verify it. A reader checks every number of that layout against the
others and against the shard's size before making a view (``ColumnLayout.check``), and a ragged
field's offsets (from 0, non-decreasing, ending at its rows) before slicing by them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierio.errors import ConfigError, FormatError
from tierio.io.checksum import StreamingChecksum
from tierio.io.untrusted import MAX_COUNT, Fields

ALIGN = 64  # every column starts on a cache line, so every view is aligned for its dtype
MAX_NDIM = 16
KINDS = "biufc"  # bool, signed, unsigned, float, complex: plain numbers only
DEFAULT_WINDOW = 8 << 20  # bytes per checksum window: one ranged GET of a download
MIN_WINDOW, MAX_WINDOW = 64 << 10, 1 << 30


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- field types --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FieldType:
    """One field of a columns dataset: its dtype and the shape of a sample.

    ``variable``: samples differ in length along their first axis and ``shape`` is the shape of
    one row of it (``()`` for 1-D samples); otherwise every sample has exactly ``shape``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    variable: bool = False

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample (fixed) or of one row along the first axis (variable)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype.str, "shape": list(self.shape), "variable": self.variable}


def field_dtype(dtype: Any, where: str) -> np.dtype:
    """A dtype a column may hold: plain little-endian (or byte-order-free) numbers or bools."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        raise FormatError(f"{where}: {dtype!r:.40} is not a numpy dtype") from None
    if dt.kind not in KINDS or dt.fields is not None or dt.subdtype is not None or dt.byteorder == ">" \
            or dt.itemsize == 0:
        raise FormatError(f"{where}: dtype {dt.str} is not a plain little-endian number type")
    return dt


def parse_field_type(doc: Any, where: str, name: str) -> FieldType:
    f = Fields(doc, where)
    if f.str("name", 255) != name:
        raise FormatError(f"{where}: field type names {f.doc.get('name')!r:.80}, the fields list says {name!r}")
    dtype = field_dtype(f.str("dtype", 16), f"{where}: field 'dtype'")
    shape = f.ints("shape", MAX_NDIM, 0, MAX_COUNT)
    variable = f.const("variable", True, False)
    if math.prod(shape) * dtype.itemsize > MAX_COUNT:
        raise FormatError(f"{where}: shape {shape} of {dtype.str} is absurdly large")
    return FieldType(name, dtype, shape, variable)


# -- where each column lies in one shard ----------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """Where one field's samples lie in one shard: fixed storage (``offsets == -1``: ``shape`` per
    sample at ``offset``) or ragged storage (``rows`` rows of values at ``offset``, ``samples + 1``
    int64 offsets at ``offsets``)."""

    offset: int
    shape: tuple[int, ...] = ()
    rows: int = 0
    offsets: int = -1

    @property
    def ragged(self) -> bool:
        return self.offsets >= 0

    def to_json(self) -> dict[str, Any]:
        if self.ragged:
            return {"offset": self.offset, "rows": self.rows, "offsets": self.offsets}
        return {"offset": self.offset, "shape": list(self.shape)}


def parse_column(doc: Any, where: str) -> Column:
    f = Fields(doc, where)
    offset = f.int("offset")
    if "offsets" in f.doc:
        return Column(offset, rows=f.int("rows"), offsets=f.int("offsets"))
    return Column(offset, shape=f.ints("shape", MAX_NDIM))


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of a shard that one column piece occupies."""

    start: int
    end: int
    what: str


def column_spans(t: FieldType, col: Column, samples: int, where: str) -> list[Span]:
    """The byte ranges ``col`` claims, from its declared numbers only, checked against ``t``.

    Nothing is allocated: a shape claiming petabytes is a FormatError here, before any view."""
    w = f"{where}: field {t.name!r}"
    if col.ragged:
        if not t.variable:
            raise FormatError(f"{w} is fixed-size in the manifest but stored ragged in the shard")
        values = Span(col.offset, col.offset + col.rows * t.row_bytes, f"{t.name} values")
        index = Span(col.offsets, col.offsets + 8 * (samples + 1), f"{t.name} offsets")
        if col.offsets % 8:
            raise FormatError(f"{w}: offsets at byte {col.offsets} are not 8-byte aligned")
        spans = [values, index]
    else:
        expected = t.shape if not t.variable else None
        if expected is not None and col.shape != expected:
            raise FormatError(f"{w}: stored with shape {col.shape}, the manifest says {expected}")
        if t.variable and (len(col.shape) != len(t.shape) + 1 or col.shape[1:] != t.shape):
            raise FormatError(f"{w}: stored with shape {col.shape}, rows of the field are {t.shape}")
        spans = [Span(col.offset, col.offset + samples * math.prod(col.shape) * t.dtype.itemsize, t.name)]
    if col.offset % t.dtype.itemsize:
        raise FormatError(f"{w}: column at byte {col.offset} is not aligned for {t.dtype.str}")
    return spans


@dataclass(frozen=True)
class ColumnLayout:
    """A shard's columns with its field types: what a reader needs to make views."""

    types: tuple[FieldType, ...]
    columns: tuple[Column, ...]
    samples: int
    size: int

    def check(self, where: str) -> None:
        """Every column inside the shard, no two overlapping, and at least one byte per sample
        (so a declared sample count is bounded by the shard's real size)."""
        if len(self.columns) != len(self.types):
            raise FormatError(f"{where}: {len(self.columns)} columns for {len(self.types)} fields")
        spans = sorted((s for t, c in zip(self.types, self.columns) for s in column_spans(t, c, self.samples, where)),
                       key=lambda s: s.start)
        end = 0
        for s in spans:
            if s.start < end or s.end > self.size:
                raise FormatError(f"{where}: {s.what} at bytes {s.start}..{s.end} overlaps another column or lies "
                                  f"outside the {self.size}-byte shard; the manifest is corrupt")
            end = s.end
        used = sum(s.end - s.start for s in spans)
        if self.samples and used < self.samples:
            raise FormatError(f"{where}: {self.samples} samples cannot take only {used} bytes; the manifest is corrupt")


# -- writing ------------------------------------------------------------------------------------
class _ColumnBuffer:
    """One field's samples of the shard being filled. Starts as fixed storage in a buffer sized
    for the shard; the first sample of another length turns it ragged (values + offsets)."""

    def __init__(self, t: FieldType, capacity: int) -> None:
        self.type = t
        self.n = 0
        self.shape: tuple[int, ...] | None = None  # the shape of every sample while fixed
        self.fixed: np.ndarray | None = None
        self.values: np.ndarray | None = None  # ragged: rows, grown by doubling
        self.rows = 0
        self.ends: list[int] = []
        self.capacity = max(1, capacity)

    @property
    def nbytes(self) -> int:
        if self.values is not None:
            return self.rows * self.type.row_bytes + 8 * (self.n + 1)
        return self.n * (0 if self.shape is None else math.prod(self.shape) * self.type.dtype.itemsize)

    def append(self, a: np.ndarray) -> None:
        if self.values is None:
            if self.shape is None:
                self.shape = a.shape
                self.fixed = np.empty((self.capacity, *a.shape), self.type.dtype)
            if a.shape == self.shape:
                if self.n == len(self.fixed):  # type: ignore[arg-type]
                    self.fixed = _grown(self.fixed, 2 * self.n)  # type: ignore[arg-type]
                self.fixed[self.n] = a  # type: ignore[index]
                self.n += 1
                return
            self._to_ragged()
        if self.rows + len(a) > len(self.values):  # type: ignore[arg-type]
            self.values = _grown(self.values, max(2 * len(self.values), self.rows + len(a)))  # type: ignore[arg-type]
        self.values[self.rows : self.rows + len(a)] = a  # type: ignore[index]
        self.rows += len(a)
        self.ends.append(self.rows)
        self.n += 1

    def _to_ragged(self) -> None:
        k = self.shape[0] if self.shape else 0  # type: ignore[index]
        rows = self.fixed[: self.n].reshape(self.n * k, *self.type.shape)  # type: ignore[union-attr]
        self.values = _grown(rows, max(len(rows) * 2, 1024))
        self.rows = len(rows)
        self.ends = [k * (i + 1) for i in range(self.n)]
        self.fixed = None

    def pieces(self) -> list[np.ndarray]:
        """The column's arrays in file order: the samples, or the values and then their offsets."""
        if self.values is None:
            return [self.fixed[: self.n] if self.fixed is not None else np.empty(0, self.type.dtype)]
        offsets = np.empty(self.n + 1, "<i8")
        offsets[0] = 0
        offsets[1:] = self.ends
        return [self.values[: self.rows], offsets]

    def column(self, at: int, offsets_at: int) -> Column:
        if self.values is not None:
            return Column(at, rows=self.rows, offsets=offsets_at)
        return Column(at, shape=tuple(self.shape or ()))


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((rows, *a.shape[1:]), a.dtype)
    out[: len(a)] = a
    return out


@dataclass
class BuiltShard:
    """A finished shard in memory: its bytes as pieces in file order, and its layout."""

    pieces: list[memoryview]
    size: int
    samples: int
    columns: tuple[Column, ...]
    shapes: tuple[tuple[int, ...] | None, ...]  # per field: the one shape of every sample, or None (ragged)


class ShardBuilder:
    """Collects samples into column buffers until the shard holds ``shard_size`` bytes.

    A field's dtype and the shape of its rows are learnt from its first sample; its samples may
    then differ only in length along their first axis. ``self.rows[f]`` is that learnt type (a
    ``FieldType`` with ``variable`` True for arrays, False for scalars); which fields end up
    fixed-size is decided when the dataset is closed (``dataset_types``)."""

    def __init__(self, fields: Sequence[str], shard_size: int) -> None:
        self.fields = list(fields)
        self.shard_size = shard_size
        self.rows: dict[str, FieldType] = {}
        self._cols: list[_ColumnBuffer] = []
        self.samples = 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._cols)

    def add(self, sample: dict[str, Any], number: int) -> bool:
        """Add one sample (its number in the dataset, for messages); True once the shard is full."""
        arrays = [self._array(sample, f, number) for f in self.fields]
        if not self._cols:  # buffers sized from the first sample, so a shard of such samples never grows them
            row = sum(a.nbytes for a in arrays)
            capacity = self.shard_size // row + 1 if row else 1024
            self._cols = [_ColumnBuffer(self.rows[f], capacity) for f in self.fields]
        for c, a in zip(self._cols, arrays):
            c.append(a)
        self.samples += 1
        return self.nbytes >= self.shard_size

    def _array(self, sample: dict[str, Any], f: str, number: int) -> np.ndarray:
        try:
            a = np.asarray(sample[f])
        except KeyError:
            raise ConfigError(f"sample {number} lacks field {f!r}") from None
        t = self.rows.get(f)
        if t is None:
            t = self.rows[f] = FieldType(f, _learn_dtype(a, f), a.shape[1:], variable=a.ndim > 0)
        if a.dtype != t.dtype:
            if not np.can_cast(a.dtype, t.dtype, "same_kind"):
                raise ConfigError(f"field {f!r} of sample {number} is {a.dtype}, earlier samples were {t.dtype}")
            a = a.astype(t.dtype)
        if a.ndim != len(t.shape) + t.variable or (a.shape[1:] if t.variable else a.shape) != t.shape:
            raise ConfigError(
                f"field {f!r} of sample {number} has shape {a.shape}; samples of a field may differ only in "
                f"length along their first axis (rows of earlier ones: {t.shape}); "
                "write fields of other shapes with format='tar'")
        return a

    def build(self) -> BuiltShard:
        """The shard's bytes and layout; the builder starts a new shard afterwards."""
        pieces: list[memoryview] = []
        at = 0
        columns = []
        shapes = []
        for c in self._cols:
            starts = []
            for arr in c.pieces():
                if at % ALIGN:
                    pieces.append(memoryview(bytes(padded(at) - at)))
                    at = padded(at)
                starts.append(at)
                mv = memoryview(np.ascontiguousarray(arr)).cast("B")
                pieces.append(mv)
                at += len(mv)
            columns.append(c.column(starts[0], starts[1] if len(starts) > 1 else -1))
            shapes.append(None if c.values is not None else c.shape)
        built = BuiltShard(pieces, at, self.samples, tuple(columns), tuple(shapes))
        self._cols = []
        self.samples = 0
        return built


def _learn_dtype(a: np.ndarray, f: str) -> np.dtype:
    try:
        return field_dtype(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype, f"field {f!r}")
    except FormatError:
        raise ConfigError(f"field {f!r} holds {a.dtype}: the columns format stores plain numbers and bools; "
                          "write other data with format='tar'") from None


def dataset_types(rows: dict[str, FieldType], shapes: Sequence[tuple[tuple[int, ...] | None, ...]],
                  fields: Sequence[str]) -> list[FieldType]:
    """The field types a finished dataset declares, from what the builder learnt (``rows``) and each
    shard's per-field sample shape (None: stored ragged): a field is fixed-size when every shard
    stored it with the same shape, else variable with the shape of its rows."""
    out = []
    for j, f in enumerate(fields):
        t = rows[f]
        seen = {s[j] for s in shapes}
        if len(seen) == 1 and None not in seen:
            out.append(FieldType(f, t.dtype, tuple(seen.pop()), variable=False))  # type: ignore[arg-type]
        else:
            out.append(FieldType(f, t.dtype, t.shape, variable=True))
    return out


def window_digests(pieces: Sequence[memoryview], window: int) -> tuple[str, list[str]]:
    """xxh3 of the whole shard and of each ``window`` bytes of it, from its pieces in file order."""
    whole = StreamingChecksum()
    part = StreamingChecksum()
    digests: list[str] = []
    filled = 0
    for p in pieces:
        whole.update(p)
        pos = 0
        while pos < len(p):
            take = min(window - filled, len(p) - pos)
            part.update(p[pos : pos + take])
            filled += take
            pos += take
            if filled == window:
                digests.append(part.hexdigest())
                part = StreamingChecksum()
                filled = 0
    if filled:
        digests.append(part.hexdigest())
    return whole.hexdigest(), digests


def check_windows(size: int, window: int, digests: Sequence[str], where: str) -> None:
    if window & (window - 1) or not MIN_WINDOW <= window <= MAX_WINDOW:
        raise FormatError(f"{where}: checksum window {window} is not a power of two in {MIN_WINDOW}..{MAX_WINDOW}")
    if len(digests) != -(-size // window):
        raise FormatError(f"{where}: {len(digests)} window checksums for {size} bytes in windows of {window}")


# -- reading ------------------------------------------------------------------------------------
class ColumnShard:
    """Views of one columns shard over ``buf`` (a read-only mapping of a verified local copy).

    ``take(ids)`` gives a batch: for each fixed-size field one array ``[len(ids), *shape]`` (one
    gather, or a view of a run of consecutive samples when ``copy`` is False), for each variable
    field a list of arrays."""

    def __init__(self, buf: Any, layout: ColumnLayout, where: str) -> None:
        mv = memoryview(buf)
        if len(mv) != layout.size:
            raise FormatError(f"{where}: shard is {len(mv)} bytes, the manifest says {layout.size}; it is truncated")
        layout.check(where)  # cheap, and this object may be built from a layout nobody checked
        self.where = where
        self.layout = layout
        n = layout.samples
        self.fixed: dict[str, np.ndarray] = {}
        self.ragged: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t, col in zip(layout.types, layout.columns):
            if col.ragged:
                values = np.frombuffer(mv, t.dtype, col.rows * math.prod(t.shape), col.offset).reshape(col.rows, *t.shape)
                offs = np.frombuffer(mv, "<i8", n + 1, col.offsets)
                if n + 1 and (offs[0] != 0 or offs[-1] != col.rows or (n and int(np.diff(offs).min()) < 0)):
                    raise FormatError(f"{where}: the offsets of field {t.name!r} do not run from 0 to {col.rows} "
                                      "without going back; the shard is corrupt")
                self.ragged[t.name] = (values, offs)
            else:
                arr = np.frombuffer(mv, t.dtype, n * math.prod(col.shape), col.offset).reshape(n, *col.shape)
                if t.variable:  # a variable field whose samples in this shard happen to share a length
                    self.ragged[t.name] = (arr.reshape(n * (col.shape[0] if col.shape else 0), *t.shape),
                                           np.arange(n + 1, dtype=np.int64) * (col.shape[0] if col.shape else 0))
                else:
                    self.fixed[t.name] = arr

    def __len__(self) -> int:
        return self.layout.samples

    def take(self, ids: np.ndarray, copy: bool = True, out: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """The samples ``ids``; fixed-size fields named in ``out`` are gathered into those arrays."""
        got: dict[str, Any] = {}
        run = _run(ids)
        if out is not None and run is None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(self)):
            raise IndexError(f"{self.where}: sample ids {int(ids.min())}..{int(ids.max())} outside [0, {len(self)})")
        for name, arr in self.fixed.items():
            into = out.get(name) if out is not None else None
            if into is not None:
                if run is not None:
                    np.copyto(into, arr[run[0] : run[1]])
                else:  # ids checked above; mode="raise" would gather into a temporary and copy it again
                    np.take(arr, ids, axis=0, out=into, mode="clip")
                got[name] = into
            elif run is not None:
                v = arr[run[0] : run[1]]
                got[name] = v.copy() if copy else v
            else:
                got[name] = np.take(arr, ids, axis=0)
        for name, (values, offs) in self.ragged.items():
            got[name] = _ragged_take(values, offs, ids, copy)
        return got

    def sample(self, i: int) -> dict[str, np.ndarray]:
        """One sample as views (no copy)."""
        out: dict[str, np.ndarray] = {name: arr[i] for name, arr in self.fixed.items()}
        for name, (values, offs) in self.ragged.items():
            out[name] = values[int(offs[i]) : int(offs[i + 1])]
        return out


def _run(ids: np.ndarray) -> tuple[int, int] | None:
    """(a, b) when ``ids`` are exactly a, a+1, ..., b-1."""
    n = len(ids)
    if n == 0:
        return 0, 0
    a = int(ids[0])
    if int(ids[-1]) - a != n - 1:
        return None
    if n > 2 and not bool((np.diff(ids) == 1).all()):
        return None
    return a, a + n


def _ragged_take(values: np.ndarray, offs: np.ndarray, ids: np.ndarray, copy: bool) -> list[np.ndarray]:
    starts = offs[ids]
    ends = offs[ids + 1]
    if not copy:
        return [values[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
    lens = ends - starts
    total = int(lens.sum())
    if total == 0:
        return [values[0:0].copy() for _ in range(len(ids))]
    # one gather for the whole batch, then views of it: rows of sample k are starts[k] + 0..len-1
    begin = np.zeros(len(ids), np.int64)
    np.cumsum(lens[:-1], out=begin[1:])
    index = np.repeat(starts - begin, lens) + np.arange(total, dtype=np.int64)
    flat = np.take(values, index, axis=0)
    return np.split(flat, np.cumsum(lens[:-1]).tolist())


__all__ = [
    "ALIGN", "DEFAULT_WINDOW", "BuiltShard", "Column", "ColumnLayout", "ColumnShard", "FieldType", "ShardBuilder",
    "check_windows", "column_spans", "dataset_types", "field_dtype", "parse_column", "parse_field_type",
    "window_digests",
]
