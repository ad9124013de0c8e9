"""The cache's bookkeeping records: which blocks exist, where their copies are, who is using them.

Everything here is plain data with read-only helpers; only ``ledger.Ledger`` changes it, under its
lock, and no I/O happens while that is held. A block (an ``Entry``) has at most one copy per local
tier (device, DRAM, NVMe); a ``Copy`` names its slot and its state:

* ``FILLING``: the slot is taken and bytes are arriving; nobody reads it (a reader waits on
  ``filled``, with a deadline; the first reader to wait creates it);
* ``READY``: readable;
* ``LEAVING``: readable while it is written to the tier below (device to DRAM, DRAM to NVMe); its
  slot is freed once the write is done and its last reader has finished.

A slot is in exactly one place: its tier's free list, or one copy. ``readers`` counts transfers
reading a copy right now and ``pins`` counts leases on the block: neither kind is ever evicted.

Eviction is least-recently-used per tier and prefix-aware: a chain is touched from its tail to its
head, so within a chain the head is always the most recently used and the tail leaves first; and a
block whose eviction would lose it while blocks that extend it are cached is passed over while any
other candidate exists (without its parent, a block is unreachable).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from tierio.kv.stats import KVTier

LOCAL_TIERS = (KVTier.DEVICE, KVTier.DRAM, KVTier.NVME)  # the tiers with slots, fastest first
MEMORY_TIERS = (KVTier.DEVICE, KVTier.DRAM)            # slot pools in memory: filled by puts and prefetches


class State(enum.IntEnum):
    FILLING = 0
    READY = 1
    LEAVING = 2


@dataclass(slots=True, eq=False)
class Copy:
    tier: KVTier
    slot: int
    state: State = State.FILLING
    readers: int = 0
    filled: threading.Event | None = None
    written: bool = False  # LEAVING: the write below has finished

    @property
    def readable(self) -> bool:
        return self.state is not State.FILLING


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    parent: bytes
    device: Copy | None = None
    dram: Copy | None = None
    nvme: Copy | None = None
    checksum: int | None = None  # xxh3-64 of the block, once it has been computed (written down or read back)
    pins: int = 0
    uses: int = 0
    children: int = 0
    where: KVTier | None = None    # the fastest tier holding a copy (what lookup reports)

    def copy(self, tier: KVTier) -> Copy | None:
        if tier is KVTier.DRAM:
            return self.dram
        if tier is KVTier.NVME:
            return self.nvme
        return self.device if tier is KVTier.DEVICE else None

    def fastest_readable(self, order: tuple[KVTier, ...] = LOCAL_TIERS) -> Copy | None:
        """The first readable copy in ``order``."""
        for tier in order:
            c = self.copy(tier)
            if c is not None and c.readable:
                return c
        return None

    def filling(self) -> Copy | None:
        """A copy in a memory tier whose bytes are still arriving (what a reader can wait for)."""
        for tier in MEMORY_TIERS:
            c = self.copy(tier)
            if c is not None and c.state is State.FILLING:
                return c
        return None

    def has_copies(self) -> bool:
        return self.device is not None or self.dram is not None or self.nvme is not None

    def ready_besides(self, c: Copy) -> bool:
        """A READY copy other than ``c``."""
        return any(x is not None and x is not c and x.state is State.READY for x in (self.device, self.dram, self.nvme))


@dataclass(eq=False)
class WriteDown:
    """One block going from its copy in a memory tier (``src``) to the tier below: from DRAM to
    the NVMe tier and/or the shared store, or from the device tier into DRAM."""

    entry: Entry
    src: Copy             # the copy written down (LEAVING when it is being evicted)
    dst: Copy | None      # the copy being filled below; None when only the shared store is written, or
                          # (device) until the write-down has found a DRAM slot
    evict: bool           # free the source copy once written
    upload: bool = False  # also write the block to the shared store (from DRAM)


__all__ = ["LOCAL_TIERS", "MEMORY_TIERS", "Copy", "Entry", "State", "WriteDown"]
