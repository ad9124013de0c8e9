"""Fixed slots: the free-slot bookkeeping every KV tier shares, and the in-memory slot pool.

A tier's capacity is a fixed number of equal slots cut once from memory allocated once (or from
preallocated slab files); a block never allocates, it takes a free slot. ``FreeSlots`` is which
slots are free: plain data, changed only under the router's lock. ``SlotPool`` adds the memory
the slots are cut from; where that memory lives (host DRAM, accelerator memory) is all its
subclasses decide (``dram.DramTier``, ``device.DeviceTier``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from tierio.io.buffers import ALIGN, align_up
from tierio.kv.stats import KVTier


class FreeSlots:
    """Which of ``nslots`` slots are free. Low slots are handed out first (they are the ones
    faulted in and, on NVMe, the ones already written once)."""

    def __init__(self, nslots: int, used: Iterable[int] = ()) -> None:
        taken = set(used)
        self.nslots = nslots
        self._free = [s for s in range(nslots - 1, -1, -1) if s not in taken]  # pop() gives the lowest

    @property
    def used(self) -> int:
        return self.nslots - len(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def free_list(self) -> list[int]:
        return list(self._free)


class SlotPool(FreeSlots):
    """Slots of the block size rounded up to 4 KiB, cut from one region of memory allocated when
    the pool is made. Subclasses allocate the region and say how a slot's bytes are viewed."""

    kind: ClassVar[KVTier]

    def __init__(self, nslots: int, block_bytes: int) -> None:
        super().__init__(nslots)
        self.block_bytes = block_bytes
        self.slot_bytes = self.slot_size(block_bytes)

    @staticmethod
    def slot_size(block_bytes: int) -> int:
        return align_up(block_bytes, ALIGN)

    @classmethod
    def slots_for(cls, budget: int, block_bytes: int) -> int:
        """Whole slots in a budget of ``budget`` bytes."""
        return budget // cls.slot_size(block_bytes)

    @property
    def region_bytes(self) -> int:
        return self.nslots * self.slot_bytes

    def span(self, slot: int) -> tuple[int, int]:
        """Where ``slot``'s block bytes start and end in the region."""
        start = slot * self.slot_bytes
        return start, start + self.block_bytes

    def block(self, slot: int) -> Any:
        """The block bytes of ``slot``: a flat uint8 view into the region (no copy)."""
        raise NotImplementedError


__all__ = ["FreeSlots", "SlotPool"]
