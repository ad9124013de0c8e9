"""Rings of pre-faulted shared-memory batch slots that DataLoader workers fill in place.

A stock DataLoader worker allocates a fresh shared-memory segment for every batch, faults its
pages in, and hands its descriptor to the main process over a socket: for token batches (a
memcpy of work) that costs more than producing the batch. With a ring, each worker owns
``slots_per_worker`` slots allocated once before the workers start; it writes a batch straight
into its next slot and sends only the slot number. The main process wraps the slot in tensor
views and marks the slot free again when the last view of that batch is garbage collected.

A worker never overwrites a slot that is still referenced: if the training loop keeps old
batches alive and the next slot is taken, the worker falls back to a fresh tensor for that
batch (the ordinary, slower path). Correctness never depends on how batches are used.

``BatchRing`` holds int64 token windows (TokenWindowDataset); ``FieldRing`` holds the fixed-size
fields of a StreamingDataset batch, of any dtype, packed into one block per slot.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

FREE, FILLED = 0, 1
SLOT_ALIGN = 64  # each field of a FieldRing slot starts on a cache line


@dataclass(frozen=True)
class RingRef:
    """What a worker sends instead of a batch: which slot, how many rows are valid."""

    slot: int
    rows: int


@dataclass(frozen=True)
class RingBatch:
    """What a worker sends for a batch whose fixed-size fields it wrote into a FieldRing slot:
    the slot, how many rows are valid, and the batch's other fields as they are."""

    slot: int
    rows: int
    rest: dict[str, Any] = field(default_factory=dict)


class _Slots:
    """Per-worker slots of shared memory and their FREE/FILLED flags (see the module doc)."""

    def __init__(self, num_workers: int, slots_per_worker: int) -> None:
        import torch

        self.num_workers = num_workers
        self.slots_per_worker = slots_per_worker
        self.state = torch.zeros(num_workers * slots_per_worker, dtype=torch.int32).share_memory_()
        self._next: dict[int, int] = {}  # per worker process: its next slot (process-local)
        self._state_np: np.ndarray | None = None  # a view of ``state``, made once per process

    def _flags(self) -> np.ndarray:
        if self._state_np is None:
            self._state_np = self.state.numpy()
        return self._state_np

    def acquire(self, worker_id: int) -> int | None:
        """Worker side: the worker's next slot if it is free (marked FILLED), else None."""
        k = self._next.get(worker_id, 0)
        self._next[worker_id] = (k + 1) % self.slots_per_worker
        slot = worker_id * self.slots_per_worker + k
        st = self._flags()
        if st[slot] != FREE:
            return None
        st[slot] = FILLED
        return slot

    def release(self, slot: int) -> None:
        """Mark ``slot`` free (done by the finalizer of its last view; by a worker that gives up on it)."""
        self._flags()[slot] = FREE


class BatchRing(_Slots):
    def __init__(self, num_workers: int, slots_per_worker: int, row_shape: tuple[int, ...], batch_size: int) -> None:
        import torch

        super().__init__(num_workers, slots_per_worker)
        n = num_workers * slots_per_worker
        # share_memory_() copies into a new shared segment, so every page is faulted in here, once
        self.data = torch.zeros((n, batch_size, *row_shape), dtype=torch.int64).share_memory_()
        self._data_np = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_data_np"] = state["_state_np"] = None
        return state

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def materialize(self, ref: RingRef) -> Any:
        """Tensor over a filled slot; the slot is freed when the last user of its memory is gone.

        The tensor is built with ``torch.frombuffer`` over a per-batch numpy view of the slot:
        its storage keeps that view alive, and so does every tensor view or ``.numpy()`` array
        derived from it. Only when all of them are gone does the finalizer free the slot.
        """
        import torch

        if self._data_np is None:
            self._data_np = self.data.numpy()
        holder = self._data_np[ref.slot, : ref.rows]
        weakref.finalize(holder, self.release, ref.slot)
        return torch.frombuffer(holder, dtype=torch.int64).view(holder.shape)


@dataclass(frozen=True)
class RingField:
    """One fixed-size field of a FieldRing slot: up to ``batch_size`` rows of ``shape`` at ``offset``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    def nbytes(self, rows: int) -> int:
        return rows * math.prod(self.shape) * self.dtype.itemsize


class FieldRing(_Slots):
    """Slots holding one batch of several fixed-size fields, packed into one block of shared
    bytes per slot. Every tensor handed out for a batch views that block through one per-batch
    object, so the slot is free again only when the last of them (or of their views) is gone."""

    def __init__(self, num_workers: int, slots_per_worker: int, fields: Sequence[tuple[str, Any, tuple[int, ...]]],
                 batch_size: int) -> None:
        import torch

        super().__init__(num_workers, slots_per_worker)
        self.batch_size = batch_size
        self.fields, size = _place(fields, batch_size)
        n = num_workers * slots_per_worker
        # share_memory_() copies into a new shared segment, so every page is faulted in here, once
        self.data = torch.zeros((n, size), dtype=torch.uint8).share_memory_()
        self._bytes: np.ndarray | None = None

    @staticmethod
    def slot_bytes(fields: Sequence[tuple[str, Any, tuple[int, ...]]], batch_size: int) -> int:
        """Bytes of one slot holding a batch of ``fields``."""
        return _place(fields, batch_size)[1]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_bytes"] = state["_state_np"] = None
        return state

    def _block(self, slot: int) -> np.ndarray:
        if self._bytes is None:
            self._bytes = self.data.numpy()
        return self._bytes[slot]

    def views(self, slot: int, rows: int) -> dict[str, np.ndarray]:
        """Worker side: writable arrays ``[rows, *shape]`` of each field in ``slot``."""
        block = self._block(slot)
        return {f.name: block[f.offset : f.offset + f.nbytes(rows)].view(f.dtype).reshape(rows, *f.shape)
                for f in self.fields}

    def materialize(self, batch: RingBatch) -> dict[str, Any]:
        """Main side: the batch as tensors over its slot, with the fields that came outside it."""
        import torch

        holder = self._block(batch.slot).view()  # one object per batch, kept alive by every tensor
        weakref.finalize(holder, self.release, batch.slot)
        out: dict[str, Any] = {}
        for f in self.fields:
            count = batch.rows * math.prod(f.shape)
            out[f.name] = torch.frombuffer(holder, dtype=torch_dtype(f.dtype), offset=f.offset,
                                           count=count).view(batch.rows, *f.shape) if count else \
                torch.empty((batch.rows, *f.shape), dtype=torch_dtype(f.dtype))
        out.update(batch.rest)
        return out


def _place(fields: Sequence[tuple[str, Any, tuple[int, ...]]], batch_size: int) -> tuple[tuple[RingField, ...], int]:
    """Each field's place in a slot (aligned), and the slot's size."""
    placed = []
    at = 0
    for name, dtype, shape in fields:
        f = RingField(name, np.dtype(dtype), tuple(shape), at)
        placed.append(f)
        at += -(-f.nbytes(batch_size) // SLOT_ALIGN) * SLOT_ALIGN
    return tuple(placed), max(at, SLOT_ALIGN)


@lru_cache(maxsize=64)
def torch_dtype(dt: np.dtype) -> Any:
    """The torch dtype of a numpy dtype (cached: asking torch costs a tensor each time)."""
    import torch

    return torch.from_numpy(np.empty(0, dt)).dtype
