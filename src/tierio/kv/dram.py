"""The host-DRAM tier: one preallocated pool of fixed slots.

The whole budget is one HostBuffer, faulted in once (and page-locked where CUDA exists, so copies
to the accelerator run asynchronously), cut into slots of the block size rounded up to 4 KiB. A
block never allocates: it takes a free slot, and the slot's address is aligned, so the NVMe tier
writes it and reads into it with O_DIRECT, straight from and to the slot.

Slot bookkeeping (which slots are free) is plain data changed only under the router's lock.
"""

from __future__ import annotations

import sys

import numpy as np

from tierio.io.buffers import ALIGN, HostBuffer, align_up
from tierio.kv.stats import Tier


def _cuda_in_use() -> bool:
    """Pin when this process can hand blocks to an accelerator. An engine imports torch before it
    opens its KV cache; a process that has not (a CLI, a test child) has no device tensors, and is
    spared importing torch only to learn that."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class DramTier:
    kind = Tier.DRAM

    def __init__(self, nslots: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slot_bytes = align_up(block_bytes, ALIGN)
        self.nslots = nslots
        self.buffer = HostBuffer(nslots * self.slot_bytes, pin=_cuda_in_use())
        self._free = list(range(nslots - 1, -1, -1))  # pop() hands out low slots first

    @classmethod
    def slots_for(cls, budget: int, block_bytes: int) -> int:
        return budget // align_up(block_bytes, ALIGN)

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

    def block(self, slot: int) -> np.ndarray:
        """The block bytes of ``slot`` (a uint8 view into the pool)."""
        start = slot * self.slot_bytes
        return self.buffer.array[start:start + self.block_bytes]

    def slot_view(self, slot: int) -> memoryview:
        """The whole aligned slot (block bytes and padding): what O_DIRECT writes and reads."""
        start = slot * self.slot_bytes
        return self.buffer.view[start:start + self.slot_bytes]


__all__ = ["DramTier"]
