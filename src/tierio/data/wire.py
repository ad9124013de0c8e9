"""Batches from a plain ``torch.utils.data.DataLoader``'s workers without torch's per-batch hand-off.

A worker of a plain DataLoader collates ``batch_size`` samples with ``default_collate`` into a
tensor born in a new shared-memory segment, and the loop receives it by file descriptor: a new
connection to the worker for every batch (about 3 ms a batch on a 2-core VM, against ~0.3 ms to
make a batch of 64 samples of 2 KiB). Two workers were then three times slower than none.

Inside a DataLoader worker, :class:`StreamingDataset` therefore hands out its fixed-size fields
as :class:`Row` (a plain ``ndarray`` subclass: any ``collate_fn`` of the user's sees arrays as
before), and registers a collate function for ``Row`` with ``default_collate`` in that worker
process only (the extension point torch documents, ``default_collate_fn_map``). It stacks the rows
straight into the next free slot of the worker's :class:`WireRing`, one segment of shared memory
made once per worker, and only a :class:`WireSlot` (segment name, slot, dtype, shape: ~150 bytes)
crosses the pipe. The loop maps the segment once per worker and turns each slot into a tensor
over it; the slot is free again when the last view of that tensor is gone. The loop gets the same
tensor type as without workers.

The dataset takes each gather of samples from its shards straight into slots of the ring
(:func:`take_rows`, one slot per fixed-size field). When the DataLoader collates exactly one
gather's rows, in order (the usual case: the gather is a batch), that slot crosses as it is, so
the batch is copied once, from the shard; any other batch is stacked into a fresh slot.

A slot holds the largest fixed-size field of as many rows as the first gather (or batch); a ring has
up to WIRE_SLOTS slots in WIRE_RING_BYTES. Without a free slot (the loop keeps many batches alive),
for batches too large for a ring, or where no shared memory can be made, the batch travels as its
bytes through the pipe (:class:`WireTensor`).
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import secrets
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")
WIRE_SLOTS = 16  # per worker at most: prefetched batches (2 by default) of a few fields, the loop's, spares
WIRE_MIN_SLOTS = 4  # fewer than this would keep a worker waiting for the loop: send bytes instead
WIRE_SLOT_MIN_BYTES = 256 << 10
WIRE_RING_BYTES = 64 << 20  # shared memory per worker at most
HEADER_BYTES = 64  # a flag byte per slot
FREE, FILLED = 0, 1


class Row(np.ndarray):
    """A sample's field in a DataLoader worker; behaves as its ndarray."""


class WireTensor:
    """A collated batch on its way to the loop as bytes: becomes ``torch.from_numpy(array)`` when unpickled."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        import torch

        return torch.from_numpy, (self.array,)


class WireRing:
    """One worker's slots of shared memory (a file in /dev/shm, mapped by the worker and the loop).

    The loop removes the file as soon as it has mapped it (the worker at its exit if the loop never
    did), so nothing stays behind in /dev/shm, even when the workers are killed; the memory goes
    when both mappings are gone."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        from multiprocessing.util import Finalize

        self.slot_bytes = -(-slot_bytes // 4096) * 4096
        self.slots = slots
        self.size_bytes = HEADER_BYTES + slots * self.slot_bytes
        self.name = f"tierio-wire-{os.getpid()}-{secrets.token_hex(6)}"
        path = SHM_DIR / self.name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size_bytes)
            self.map = mmap.mmap(fd, self.size_bytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.bytes[HEADER_BYTES:] = 0  # fault every page in now, not while a batch waits
        self.flags = self.bytes[:slots]
        self.next = 0
        self.pid = os.getpid()
        Finalize(self, _unlink, (path,), exitpriority=0)

    def acquire(self) -> int | None:
        """A free slot, marked FILLED; None when the loop still holds every slot."""
        for k in range(self.slots):
            slot = (self.next + k) % self.slots
            if self.flags[slot] == FREE:
                self.flags[slot] = FILLED
                self.next = (slot + 1) % self.slots
                return slot
        return None

    def view(self, slot: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        at = HEADER_BYTES + slot * self.slot_bytes
        return self.bytes[at : at + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


class WireSlot:
    """A collated batch left in a WireRing slot: becomes a tensor over that slot when unpickled."""

    __slots__ = ("ring", "slot", "dtype", "shape")

    def __init__(self, ring: WireRing, slot: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.ring, self.slot, self.dtype, self.shape = ring, slot, dtype, shape

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        r = self.ring
        return from_slot, (r.name, r.size_bytes, HEADER_BYTES + self.slot * r.slot_bytes, self.slot,
                           self.dtype.str, self.shape)


_maps: dict[str, np.ndarray] = {}  # in the loop: each worker's segment, mapped once


def from_slot(name: str, size_bytes: int, offset: int, slot: int, dtype: str, shape: tuple[int, ...]) -> Any:
    """The loop's side: a tensor over the batch in ``slot``; the slot is freed with its last view."""
    import torch

    from tierio.data.ring import torch_dtype

    seg = _maps.get(name)
    if seg is None:
        seg = _maps[name] = _map(name, size_bytes)
    dt = np.dtype(dtype)
    count = math.prod(shape)
    if not count:
        _release(seg, slot)
        return torch.from_numpy(np.empty(shape, dt))
    holder = seg[offset : offset + count * dt.itemsize]  # one object per batch, kept alive by every view
    weakref.finalize(holder, _release, seg, slot)
    return torch.frombuffer(holder, dtype=torch_dtype(dt), count=count).view(shape)


def _map(name: str, size_bytes: int) -> np.ndarray:
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise RuntimeError(f"DataLoader worker batch segment {path} is gone before the loop mapped it: "
                           "something removed files from /dev/shm while the loader ran") from None
    try:
        seg = np.frombuffer(mmap.mmap(fd, size_bytes), dtype=np.uint8)
    finally:
        os.close(fd)
    _unlink(path)  # mapped once for the worker's life (see _maps): the name is no longer needed
    for other in [n for n in _maps if not _alive(n)]:  # segments of workers that exited
        del _maps[other]  # batches still alive keep their mapping; it goes with them
    return seg


def _alive(name: str) -> bool:
    try:
        os.kill(int(name.split("-")[2]), 0)
    except (ProcessLookupError, ValueError, IndexError):
        return False
    except PermissionError:
        pass
    return True


def _release(seg: np.ndarray, slot: int) -> None:
    seg[slot] = FREE


def _unlink(path: Path | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


_ring: WireRing | None = None
_no_ring_pid: int | None = None  # a process where no shared memory could be made: bytes only


_largest_row_bytes = 0  # in a worker: the largest fixed-size field's bytes per sample


def _worker_ring(nbytes: int, rows: int) -> WireRing | None:
    """This worker's ring (made at its first batch: a slot holds that many rows of its largest
    field), or None to send bytes."""
    global _ring, _no_ring_pid
    pid = os.getpid()
    if _ring is not None and _ring.pid == pid:
        return _ring if nbytes <= _ring.slot_bytes else None
    if _no_ring_pid == pid:
        return None
    slot_bytes = max(WIRE_SLOT_MIN_BYTES, nbytes, _largest_row_bytes * rows)
    slots = min(WIRE_SLOTS, WIRE_RING_BYTES // slot_bytes)
    _ring = None
    if slots >= WIRE_MIN_SLOTS:  # else batches too large to hold a few of in WIRE_RING_BYTES
        try:
            _ring = WireRing(slot_bytes, slots)
        except OSError:  # no /dev/shm, or it is full
            pass
    if _ring is None:
        _no_ring_pid = pid
    return _ring


class _Gather:
    """One field of a gather taken into a ring slot: free again when its rows are gone, unless a
    batch took the slot as it is (the loop frees it then)."""

    __slots__ = ("ring", "slot", "ids", "handed")

    def __init__(self, ring: WireRing, slot: int) -> None:
        self.ring, self.slot, self.handed = ring, slot, False
        self.ids: list[int] = []


def _drop_gather(g: _Gather) -> None:
    if not g.handed:
        g.ring.flags[g.slot] = FREE


def take_rows(take: Callable[[dict[str, np.ndarray] | None], dict[str, Any]],
              fields: list[tuple[str, Any, tuple[int, ...]]], n: int) -> dict[str, Any]:
    """In a DataLoader worker: ``take(out)`` (a gather of ``n`` samples, writing fixed-size fields
    into the arrays of ``out``) with each field's arrays in a slot of this worker's ring, viewed as
    Row. Fields without a free slot are taken into private memory, as before."""
    global _largest_row_bytes
    sizes = [(name, np.dtype(dt), tuple(shape)) for name, dt, shape in fields]
    row_bytes = max((math.prod(shape) * dt.itemsize for _, dt, shape in sizes), default=0)
    _largest_row_bytes = max(_largest_row_bytes, row_bytes)
    ring = _worker_ring(n * row_bytes, n) if sizes else None
    out: dict[str, np.ndarray] = {}
    slots: dict[str, int] = {}
    for name, dt, shape in sizes if ring is not None else ():
        slot = ring.acquire() if n * math.prod(shape) * dt.itemsize <= ring.slot_bytes else None  # type: ignore[union-attr]
        if slot is not None:
            slots[name], out[name] = slot, ring.view(slot, dt, (n, *shape))  # type: ignore[union-attr]
    try:
        batch = take(out or None)
    except BaseException:
        for slot in slots.values():
            ring.flags[slot] = FREE  # type: ignore[union-attr]
        raise
    rows = rows_in_worker(batch)
    for name, slot in slots.items():
        v = rows[name]
        if isinstance(v, Row) and v.base is out[name]:  # taken in place: the slot holds the gather
            g = v._wire = _Gather(ring, slot)  # type: ignore[arg-type]
            weakref.finalize(v, _drop_gather, g)
        else:
            ring.flags[slot] = FREE  # type: ignore[union-attr]
    return rows


def columns(rows: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """Each field split into its samples (``list()`` makes the row views in C, several times cheaper
    than indexing per sample); a gather in a slot remembers which row objects it handed out."""
    cols = [(k, list(v)) for k, v in rows.items()]
    for k, col in cols:
        g = getattr(rows[k], "_wire", None)
        if g is not None:
            g.ids = list(map(id, col))
    return cols


def _whole_gather(batch: list[Row]) -> _Gather | None:
    """The gather whose slot holds exactly ``batch``: its row objects, all of them, in order."""
    g = getattr(batch[0].base, "_wire", None)
    if g is None or g.handed or len(batch) != len(g.ids) or not all(map(operator.eq, g.ids, map(id, batch))):
        return None
    return g


def collate_rows(batch: list[Row], *, collate_fn_map: Any = None) -> WireTensor | WireSlot:
    first = batch[0]
    shape = (len(batch), *first.shape)
    whole = _whole_gather(batch)
    if whole is not None:  # the rows are already in a slot, in order: it crosses as it is
        whole.handed = True
        return WireSlot(whole.ring, whole.slot, first.dtype, shape)
    nbytes = math.prod(shape) * first.dtype.itemsize
    ring = _worker_ring(nbytes, len(batch))
    slot = ring.acquire() if ring is not None else None
    if slot is None:
        return WireTensor(np.stack(batch).view(np.ndarray))
    try:
        np.stack(batch, out=ring.view(slot, first.dtype, shape))  # type: ignore[union-attr]
    except BaseException:
        ring.flags[slot] = FREE  # type: ignore[union-attr]
        raise
    return WireSlot(ring, slot, first.dtype, shape)  # type: ignore[arg-type]


_registered = False


def rows_in_worker(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with its fixed-size fields viewed as Row, and Row's collation registered in this
    process (call only in a DataLoader worker)."""
    global _registered, _largest_row_bytes
    if not _registered:
        from torch.utils.data._utils.collate import default_collate_fn_map

        default_collate_fn_map[Row] = collate_rows
        _registered = True
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.ndim > 1 and v.dtype.kind in "biuf":
            v = v.view(Row)
            _largest_row_bytes = max(_largest_row_bytes, v[0].nbytes if len(v) else 0)
        out[k] = v
    return out
