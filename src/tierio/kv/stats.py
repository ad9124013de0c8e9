"""What a KV cache reports: per-tier occupancy and hits, and counters of every decision and failure."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tierio.stats import Stats


class KVTier(str, enum.Enum):
    """Where a block is: the optional pool in accelerator memory, host memory, the local NVMe
    slabs, or the shared store (fastest first)."""

    DEVICE = "device"
    DRAM = "dram"
    NVME = "nvme"
    SHARED = "shared"


@dataclass
class Counters(Stats):
    """Monotonic counts since the cache opened (blocks unless named otherwise)."""

    lookups: int = 0
    lookup_keys: int = 0
    stored: int = 0              # blocks put into the cache
    already_cached: int = 0      # puts of a block the cache held
    put_dropped: int = 0         # puts that found no slot (every slot pinned or in transfer)
    served: int = 0              # blocks a get delivered
    missed: int = 0              # blocks a get was asked for and did not deliver
    served_device: int = 0
    served_dram: int = 0
    served_nvme: int = 0
    served_shared: int = 0
    demoted: int = 0             # blocks copied from the device tier down into DRAM (evicted or flushed)
    written_down: int = 0        # blocks written from DRAM to NVMe (or the shared store)
    written_bytes: int = 0
    not_admitted: int = 0        # blocks dropped from DRAM without a write: used fewer than admit_uses times
    dropped: int = 0             # blocks that left the cache entirely (eviction, errors)
    prefetched: int = 0          # blocks a prefetch brought up a tier
    prefetch_late: int = 0       # prefetches skipped because their deadline had passed
    uploaded: int = 0            # blocks written to the shared store
    integrity_errors: int = 0    # checksum, key or size mismatches on a read: counted as misses
    unauthenticated: int = 0     # shared-store blocks without a valid MAC under the secret: misses
    io_errors: int = 0           # failed reads or writes: counted as misses
    disk_full: int = 0           # ENOSPC while creating or writing a tier
    timeouts: int = 0            # waits for another thread's transfer that ran out of time
    recovered: int = 0           # NVMe blocks found committed when the tier opened
    discarded: int = 0           # NVMe index records found torn, damaged or out of range when it opened


@dataclass
class TierStats(Stats):
    tier: KVTier
    slots: int
    used: int
    slot_bytes: int
    direct: bool = False         # NVMe: slabs opened with O_DIRECT

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        return self.used * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes}


@dataclass
class KVStats(Stats):
    blocks: int
    block_bytes: int
    tiers: list[TierStats]
    counters: Counters
    pinned: int                  # blocks held by pin()/lease()
    reading: int                 # copies being read right now
    fetch_latency_s: float       # NVMe block fetch latency the router uses (measured once reads happen)
    shared: str | None = None
    device: str | None = None    # where the device tier's pool lives ("cuda:0"; "cpu" standing in), if there is one
    notes: list[str] = field(default_factory=list)


__all__ = ["Counters", "KVStats", "KVTier", "TierStats"]
