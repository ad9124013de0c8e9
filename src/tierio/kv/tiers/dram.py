"""The host-DRAM tier: a slot pool in one preallocated host buffer.

The whole budget is one HostBuffer, faulted in once (and page-locked where CUDA exists, so copies
to the accelerator run asynchronously). Slot addresses are aligned, so the NVMe tier writes a slot
and reads into it with O_DIRECT, straight from and to the pool.
"""

from __future__ import annotations

import sys

import numpy as np

from tierio.io.buffers import HostBuffer
from tierio.kv.tiers.slots import SlotPool
from tierio.kv.stats import KVTier


def _cuda_in_use() -> bool:
    """Pin when this process can hand blocks to an accelerator. An engine imports torch before it
    opens its KV cache; a process that has not (a CLI, a test child) has no device tensors, and is
    spared importing torch only to learn that."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class DramTier(SlotPool):
    kind = KVTier.DRAM

    def __init__(self, nslots: int, block_bytes: int) -> None:
        super().__init__(nslots, block_bytes)
        self.buffer = HostBuffer(self.region_bytes, pin=_cuda_in_use())

    def block(self, slot: int) -> np.ndarray:
        start, end = self.span(slot)
        return self.buffer.array[start:end]

    def slot_view(self, slot: int) -> memoryview:
        """The whole aligned slot (block bytes and padding): what O_DIRECT writes and reads."""
        start = slot * self.slot_bytes
        return self.buffer.view[start:start + self.slot_bytes]


__all__ = ["DramTier"]
