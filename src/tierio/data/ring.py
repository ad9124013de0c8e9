"""A ring of pre-faulted shared-memory batch slots that DataLoader workers fill in place.

A stock DataLoader worker allocates a fresh shared-memory segment for every batch, faults its
pages in, and hands its descriptor to the main process over a socket: for token batches (a
memcpy of work) that costs more than producing the batch. With a ring, each worker owns
``slots_per_worker`` slots allocated once before the workers start; it writes a batch straight
into its next slot and sends only the slot number. The main process wraps the slot in tensor
views and marks the slot free again when the last view of that batch is garbage collected.

A worker never overwrites a slot that is still referenced: if the training loop keeps old
batches alive and the next slot is taken, the worker falls back to a fresh tensor for that
batch (the ordinary, slower path). Correctness never depends on how batches are used.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

FREE, FILLED = 0, 1


@dataclass(frozen=True)
class RingRef:
    """What a worker sends instead of a batch: which slot, how many rows are valid."""

    slot: int
    rows: int


class BatchRing:
    def __init__(self, num_workers: int, slots_per_worker: int, row_shape: tuple[int, ...], batch_size: int) -> None:
        import torch

        self.num_workers = num_workers
        self.slots_per_worker = slots_per_worker
        n = num_workers * slots_per_worker
        # share_memory_() copies into a new shared segment, so every page is faulted in here, once
        self.data = torch.zeros((n, batch_size, *row_shape), dtype=torch.int64).share_memory_()
        self.state = torch.zeros(n, dtype=torch.int32).share_memory_()
        self._next: dict[int, int] = {}  # per worker process: its next slot (process-local)
        self._data_np = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_data_np"] = None
        return state

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # -- worker side ---------------------------------------------------------------------------
    def acquire(self, worker_id: int) -> int | None:
        """The worker's next slot if it is free (marked FILLED), else None."""
        k = self._next.get(worker_id, 0)
        self._next[worker_id] = (k + 1) % self.slots_per_worker
        slot = worker_id * self.slots_per_worker + k
        st = self.state.numpy()
        if st[slot] != FREE:
            return None
        st[slot] = FILLED
        return slot

    # -- main side -----------------------------------------------------------------------------
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
        weakref.finalize(holder, self._release, ref.slot)
        return torch.frombuffer(holder, dtype=torch.int64).view(holder.shape)

    def _release(self, slot: int) -> None:
        self.state.numpy()[slot] = FREE
