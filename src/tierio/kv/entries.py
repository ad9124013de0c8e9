"""The router's bookkeeping: which blocks exist, where their copies are, who is using them.

Everything here is plain data, changed only under the router's lock, and no I/O happens while it
is held. A block (an ``Entry``) has at most one copy per local tier (device, DRAM, NVMe); a
``Copy`` names its slot and its state:

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
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tierio.kv.stats import Tier

SCAN_LIMIT = 1024  # candidates looked at per eviction before settling for a fallback
LOCAL_TIERS = (Tier.DEVICE, Tier.DRAM, Tier.NVME)  # the tiers with slots, fastest first
MEMORY_TIERS = (Tier.DEVICE, Tier.DRAM)            # slot pools in memory: filled by puts and prefetches


class State(enum.IntEnum):
    FILLING = 0
    READY = 1
    LEAVING = 2


@dataclass(slots=True, eq=False)
class Copy:
    tier: Tier
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
    where: Tier | None = None    # the fastest tier holding a copy (what lookup reports)

    def copy(self, tier: Tier) -> Copy | None:
        if tier is Tier.DRAM:
            return self.dram
        if tier is Tier.NVME:
            return self.nvme
        return self.device if tier is Tier.DEVICE else None

    def set_copy(self, tier: Tier, c: Copy | None) -> None:
        if tier is Tier.DRAM:
            self.dram = c
        elif tier is Tier.NVME:
            self.nvme = c
        else:
            self.device = c

    def fastest_readable(self, order: tuple[Tier, ...] = LOCAL_TIERS) -> Copy | None:
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


class Directory:
    """Entries by key, an LRU order per tier, and the uses of blocks that left (the frequency
    filter's memory, bounded)."""

    def __init__(self, ghost_limit: int) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.lru: dict[Tier, OrderedDict[bytes, Entry]] = {t: OrderedDict() for t in LOCAL_TIERS}
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.ghost_limit = ghost_limit

    # -- entries --------------------------------------------------------------------------------
    def add(self, key: bytes, parent: bytes) -> Entry:
        e = Entry(key, parent, uses=self.ghost.pop(key, 0))
        self.entries[key] = e
        p = self.entries.get(parent)
        if p is not None:
            p.children += 1
        return e

    def forget(self, e: Entry) -> bool:
        """Remove an entry that has no copy and no pin; its uses are remembered. True if removed."""
        if e.has_copies() or e.pins or self.entries.get(e.key) is not e:
            return False
        del self.entries[e.key]
        p = self.entries.get(e.parent)
        if p is not None and p.children > 0:
            p.children -= 1
        self.ghost[e.key] = e.uses
        self.ghost.move_to_end(e.key)
        while len(self.ghost) > self.ghost_limit:
            self.ghost.popitem(last=False)
        return True

    # -- copies ---------------------------------------------------------------------------------
    def attach(self, e: Entry, c: Copy) -> None:
        e.set_copy(c.tier, c)
        self.lru[c.tier][e.key] = e
        self._where(e)

    def detach(self, e: Entry, tier: Tier) -> Copy | None:
        c = e.copy(tier)
        if c is None:
            return None
        e.set_copy(tier, None)
        self.lru[tier].pop(e.key, None)
        self._where(e)
        return c

    @staticmethod
    def _where(e: Entry) -> None:
        e.where = next((t for t in LOCAL_TIERS if e.copy(t) is not None), None)

    def touch(self, chain: Iterable[Entry]) -> None:
        """Mark a chain used, tail first, so its head ends up the most recently used."""
        for e in reversed(list(chain)):
            for tier in LOCAL_TIERS:
                if e.copy(tier) is not None:
                    self.lru[tier].move_to_end(e.key)

    # -- eviction -------------------------------------------------------------------------------
    def victim(self, tier: Tier, loses: Callable[[Entry], bool], protect: frozenset[bytes] = frozenset(),
               *, strict: bool = True) -> Entry | None:
        """The least recently used copy in ``tier`` that nobody reads, pins or fills. ``loses(e)``:
        evicting it drops the block from the cache; such a block with cached children is taken only
        when nothing else is evictable. Keys in ``protect`` are never taken (``strict``), or never
        taken when taking them loses them (a put longer than DRAM may send its own first blocks
        down a tier, but never drop them)."""
        fallback = None
        for n, (key, e) in enumerate(self.lru[tier].items()):
            if n >= SCAN_LIMIT:
                break
            c = e.copy(tier)
            if c is None or c.state is not State.READY or c.readers or e.pins:
                continue
            if key in protect and (strict or loses(e)):
                continue
            if e.children and loses(e):
                fallback = fallback or e
                continue
            return e
        return fallback

    # -- checks ---------------------------------------------------------------------------------
    def problems(self, tiers: dict[Tier, tuple[int, list[int]]]) -> list[str]:
        """Broken invariants, for tests and ``KVCache.check``: ``tiers`` maps each tier to its
        slot count and its free list."""
        out: list[str] = [f"{t.value}: a slot listed free twice" for t, (_, free) in tiers.items() if len(set(free)) != len(free)]
        tiers = {t: (n, set(free)) for t, (n, free) in tiers.items()}
        used: dict[Tier, dict[int, bytes]] = {t: {} for t in tiers}
        for key, e in self.entries.items():
            if e.key != key:
                out.append(f"entry {key.hex()} filed under another key")
            if e.pins < 0:
                out.append(f"{key.hex()}: negative pins")
            if not e.has_copies() and not e.pins:
                out.append(f"{key.hex()}: no copy and no pin, still listed")
            for tier in LOCAL_TIERS:
                c = e.copy(tier)
                if c is None:
                    if key in self.lru[tier]:
                        out.append(f"{key.hex()}: in the {tier.value} LRU without a copy there")
                    continue
                if tier not in tiers:
                    out.append(f"{key.hex()}: a copy in absent tier {tier.value}")
                    continue
                if c.readers < 0:
                    out.append(f"{key.hex()}: negative readers in {tier.value}")
                if key not in self.lru[tier]:
                    out.append(f"{key.hex()}: {tier.value} copy missing from its LRU")
                nslots, free = tiers[tier]
                if not 0 <= c.slot < nslots:
                    out.append(f"{key.hex()}: {tier.value} slot {c.slot} out of range")
                if c.slot in free:
                    out.append(f"{key.hex()}: {tier.value} slot {c.slot} is both free and in use")
                if c.slot in used[tier]:
                    out.append(f"{tier.value} slot {c.slot} held by two blocks")
                used[tier][c.slot] = key
        for tier, (nslots, free) in tiers.items():
            if len(used[tier]) + len(free) != nslots:
                out.append(f"{tier.value}: {len(used[tier])} used + {len(free)} free != {nslots} slots")
            if len(self.lru[tier]) != len(used[tier]):
                out.append(f"{tier.value}: LRU lists {len(self.lru[tier])} blocks, {len(used[tier])} hold slots")
        return out


__all__ = ["LOCAL_TIERS", "MEMORY_TIERS", "Copy", "Directory", "Entry", "State"]
