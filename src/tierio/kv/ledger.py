"""The KV cache's ledger: every change of a block's state, made under one lock, with no I/O.

The router (``router.KVCache``) moves bytes; before and after each transfer it asks the ledger,
holding ``ledger.lock``, to take or give back slots, readers and pins. Keeping every transition
here, and nothing else, is what lets ``problems`` state the invariants the router relies on:
each slot of a tier is free, in hand (taken by a thread about to attach it), in limbo (its copy
was dropped while still being read) or held by exactly one copy; a LEAVING copy is counted in
``leaving`` of its tier and has its write-down queued in that tier's ``writes`` or running on
some thread.

The memory tiers (``pools``: the optional device pool, DRAM) are kept alike: puts and prefetches
fill their slots, and their least recently used blocks are written down to the tier below, the
device tier's into DRAM and DRAM's to NVMe and the shared store. Each tier has its own queue of
write-downs, so finishing a device block's write-down (which needs a DRAM slot, and may run a
DRAM write-down for it) never waits on the device tier's own queue.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from tierio.io.engine import Request
from tierio.kv.config import KVConfig
from tierio.kv.entries import LOCAL_TIERS, MEMORY_TIERS, Copy, Directory, Entry, State
from tierio.kv.slab import SlabTier
from tierio.kv.slabindex import SlotRecord
from tierio.kv.slots import FreeSlots, SlotPool
from tierio.kv.stats import Counters, Tier


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


class Ledger:
    """Bookkeeping of one cache. Every method expects ``lock`` to be held by the caller."""

    def __init__(self, config: KVConfig, pools: dict[Tier, SlotPool], counters: Counters) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)  # notified whenever a memory slot is freed
        self.pools = pools                           # the memory tiers present: DEVICE, DRAM
        self.dram = pools.get(Tier.DRAM)
        self.nvme: SlabTier | None = None
        self.shared = False                          # a shared store is configured
        self.counters = counters
        self.dir = Directory(ghost_limit=4 * sum(p.nslots for p in pools.values()) + 1024)
        self.writes: dict[Tier, deque[Request[None]]] = {t: deque() for t in MEMORY_TIERS}  # not yet reaped
        self.writing = dict.fromkeys(MEMORY_TIERS, 0)  # write-downs started and not finished
        self.leaving = dict.fromkeys(MEMORY_TIERS, 0)  # copies in state LEAVING
        self.limbo: dict[Tier, set[int]] = {t: set() for t in LOCAL_TIERS}
        self.in_hand: dict[Tier, set[int]] = {t: set() for t in MEMORY_TIERS}  # taken, not yet attached

    # -- what goes where --------------------------------------------------------------------------
    def admitted(self, e: Entry) -> bool:
        """May ``e`` be written below DRAM (used often enough, and a tier there)?"""
        return e.uses >= self.config.admit_uses and (self.nvme is not None or self.shared)

    def loses(self, tier: Tier):
        """``loses(tier)(e)``: evicting ``e``'s copy in ``tier`` drops the block from the cache."""
        if tier is Tier.DEVICE:  # written down into DRAM, unless there is none
            return lambda e: self.dram is None and e.dram is None and e.nvme is None
        if tier is Tier.DRAM:
            return lambda e: e.device is None and e.nvme is None and not self.admitted(e)
        return lambda e: e.device is None and e.dram is None

    def recover(self, records: list[SlotRecord]) -> None:
        """Enter blocks a previous process committed to the NVMe tier, oldest first (LRU order survives)."""
        for rec in records:
            e = self.dir.add(rec.key, rec.parent)
            e.checksum = rec.checksum
            self.dir.attach(e, Copy(Tier.NVME, rec.slot, State.READY))
        for e in self.dir.entries.values():
            e.children = 0
        for e in self.dir.entries.values():  # counted once all are in: parents may come after children
            p = self.dir.entries.get(e.parent)
            if p is not None:
                p.children += 1

    # -- slots ----------------------------------------------------------------------------------
    def _slots(self, tier: Tier) -> FreeSlots:
        pool = self.nvme if tier is Tier.NVME else self.pools.get(tier)
        assert pool is not None, tier
        return pool

    def take_slot(self, tier: Tier) -> int | None:
        """A free slot of memory tier ``tier``, in hand until its taker attaches or releases it."""
        slot = self._slots(tier).alloc()
        if slot is not None:
            self.in_hand[tier].add(slot)
        return slot

    def release(self, tier: Tier, slot: int) -> None:
        self._slots(tier).release(slot)
        if tier in self.pools:
            self.space.notify_all()

    def nvme_slot(self, protect: frozenset[bytes]) -> int | None:
        assert self.nvme is not None
        slot = self.nvme.alloc()
        if slot is None:
            victim = self.dir.victim(Tier.NVME, self.loses(Tier.NVME), protect)
            if victim is not None:
                self.drop_copy(victim, Tier.NVME)
                slot = self.nvme.alloc()
        return slot

    def attach_filling(self, tier: Tier, key: bytes, parent: bytes, slot: int, *, unless_cached: bool,
                       use: bool = False) -> tuple[Entry, Copy | None]:
        """Attach ``slot`` of memory tier ``tier`` (in hand) to ``key``'s block as a FILLING copy.
        When another thread got there first (the block has a copy in ``tier`` now, or any copy if
        ``unless_cached``) the slot is released instead and the copy is None. ``use``: count a use
        of the block either way (a put)."""
        self.in_hand[tier].discard(slot)
        e = self.dir.entries.get(key)
        if e is not None and (e.has_copies() if unless_cached else e.copy(tier) is not None):
            e.uses += use
            self.release(tier, slot)
            return e, None
        e = e or self.dir.add(key, parent)
        e.uses += use
        c = Copy(tier, slot, State.FILLING)
        self.dir.attach(e, c)
        return e, c

    def filled(self, e: Entry, c: Copy, ok: bool) -> threading.Event | None:
        """A FILLING copy is done: readable, or (not ``ok``) dropped. Returns the event its waiters
        wait on, to be set once the lock is released."""
        event, c.filled = c.filled, None
        if ok:
            c.state = State.READY
        else:
            self.drop_copy(e, c.tier)
        return event

    # -- copies ---------------------------------------------------------------------------------
    def drop_copy(self, e: Entry, tier: Tier) -> None:
        """Remove ``e``'s copy in ``tier`` and free its slot (the entry goes too once it has no
        copy and no pin). A copy still being read leaves its slot in limbo until the last reader."""
        c = self.dir.detach(e, tier)
        if c is None:
            return
        if c.state is State.LEAVING:
            self.leaving[tier] -= 1
        if c.readers:
            self.limbo[tier].add(c.slot)
        else:
            self.release(tier, c.slot)
        if self.dir.forget(e):
            self.counters.dropped += 1

    def free_if_done(self, e: Entry, c: Copy) -> None:
        if c.state is State.LEAVING and c.written and c.readers == 0 and e.copy(c.tier) is c:
            self.drop_copy(e, c.tier)

    def reader(self, key: bytes, order: tuple[Tier, ...] = LOCAL_TIERS
               ) -> tuple[Entry | None, Copy | None, threading.Event | None]:
        """The entry of ``key``, its first readable copy in ``order`` (now read: readers + 1), or
        the event to wait on while a copy in a memory tier is being filled (made by the first
        waiter: most fills have none)."""
        e = self.dir.entries.get(key)
        if e is None:
            return None, None, None
        c = e.fastest_readable(order)
        if c is not None:
            c.readers += 1
            return e, c, None
        f = e.filling()
        if f is None or f.tier not in order:
            return e, None, None
        if f.filled is None:
            f.filled = threading.Event()
        return e, None, f.filled

    def hold_dram(self, chain: list[Entry]) -> dict[int, Copy]:
        """Take a reader on every readable DRAM copy of ``chain`` (by position)."""
        held = {}
        for i, e in enumerate(chain):
            c = e.dram
            if c is not None and c.readable:
                c.readers += 1
                held[i] = c
        return held

    def unread(self, e: Entry, c: Copy) -> None:
        """A transfer finished reading ``c``."""
        c.readers -= 1
        if c.readers == 0 and c.slot in self.limbo[c.tier] and e.copy(c.tier) is not c:
            self.limbo[c.tier].discard(c.slot)
            self.release(c.tier, c.slot)
        elif c.tier in self.pools:
            self.free_if_done(e, c)
        self.dir.forget(e)

    # -- write-downs ----------------------------------------------------------------------------
    def start_write_down(self, e: Entry, tier: Tier, *, evict: bool) -> WriteDown | None:
        """Begin moving ``e``'s copy in memory tier ``tier`` down. Returns the job to run outside
        the lock, or None when nothing needs writing (when evicting, the copy was dropped at once)."""
        src = e.copy(tier)
        assert src is not None and src.state is State.READY
        if tier is Tier.DEVICE:
            dst, upload = None, False
            needed = self.dram is not None and e.dram is None  # a DRAM copy (even one on its way) will do
        else:
            dst = None
            if self.admitted(e) and e.nvme is None and self.nvme is not None:
                slot = self.nvme_slot(frozenset((e.key,)))
                if slot is not None:
                    dst = Copy(Tier.NVME, slot, State.FILLING)
                    self.dir.attach(e, dst)
            upload = self.shared and self.admitted(e)
            needed = dst is not None or upload
            if evict and not needed and not self.admitted(e) and e.nvme is None:
                self.counters.not_admitted += 1
        if not needed:
            if evict:
                self.drop_copy(e, tier)
            return None
        src.readers += 1
        if evict:
            src.state = State.LEAVING
            self.leaving[tier] += 1
        self.writing[tier] += 1
        return WriteDown(e, src, dst, evict, upload)

    def excess_write_downs(self) -> list[WriteDown]:
        """For each memory tier above its high watermark, the write-downs (at most ``depth`` in
        flight per tier) that bring it back to its low one. The caller queues them in ``writes``
        before releasing the lock, so a thread that needs a slot always finds the request to run
        itself."""
        jobs = []
        for tier, pool in self.pools.items():
            below = self.dram is not None if tier is Tier.DEVICE else self.nvme is not None or self.shared
            if not below:
                continue  # nothing below: blocks leave only when a put needs their slot
            wm, n = self.config.watermarks, pool.nslots
            if pool.used - self.leaving[tier] <= wm.high * n:
                continue
            writes = self.writes[tier]
            while writes and writes[0].future.done():
                writes.popleft()
            loses = self.loses(tier)
            while pool.used - self.leaving[tier] > wm.low * n and self.writing[tier] < self.config.depth:
                victim = self.dir.victim(tier, loses)
                if victim is None:
                    break
                job = self.start_write_down(victim, tier, evict=True)
                if job is not None:
                    jobs.append(job)
        return jobs

    def finish_write_down(self, job: WriteDown, ok: bool, checksum: int | None, block_bytes: int
                          ) -> threading.Event | None:
        """A write-down is over (``ok``: its copy below is complete). Returns the event waiters on
        a DRAM copy filled from the device tier wait on, to be set once the lock is released."""
        e, src, dst = job.entry, job.src, job.dst
        self.writing[src.tier] -= 1
        event = None
        if dst is not None and dst.tier is Tier.DRAM:
            event = self.filled(e, dst, ok)
            self.counters.demoted += ok
        elif dst is not None:
            if ok:
                dst.state = State.READY
                e.checksum = checksum
                self.counters.written_down += 1
                self.counters.written_bytes += block_bytes
            else:
                self.dir.detach(e, Tier.NVME)
                self.release(Tier.NVME, dst.slot)
        src.readers -= 1
        if job.evict:
            src.written = True
            self.free_if_done(e, src)
        self.dir.forget(e)
        return event

    # -- pins and explicit eviction -------------------------------------------------------------
    def pin(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            e = self.dir.entries.get(k)
            if e is None or not e.has_copies():
                break
            e.pins += 1
            n += 1
        return n

    def unpin(self, keys: list[bytes]) -> None:
        for k in keys:
            e = self.dir.entries.get(k)
            if e is None or e.pins == 0:
                break
            e.pins -= 1
            self.dir.forget(e)

    def evict(self, keys: list[bytes], tiers: tuple[Tier, ...]) -> int:
        n = 0
        for k in keys:
            e = self.dir.entries.get(k)
            if e is None or e.pins:
                continue
            for t in tiers:
                c = e.copy(t)
                if c is not None and c.state is State.READY and not c.readers:
                    self.drop_copy(e, t)
                    n += 1
        return n

    # -- checks ---------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        slots: dict[Tier, tuple[int, list[int]]] = {}
        for tier, pool in self.pools.items():
            slots[tier] = (pool.nslots, pool.free_list() + sorted(self.limbo[tier]) + sorted(self.in_hand[tier]))
        if self.nvme is not None:
            slots[Tier.NVME] = (self.nvme.nslots, self.nvme.free_list() + sorted(self.limbo[Tier.NVME]))
        out = self.dir.problems(slots)
        for tier in MEMORY_TIERS:
            leaving = sum(1 for e in self.dir.entries.values()
                          if (c := e.copy(tier)) is not None and c.state is State.LEAVING)
            if self.leaving[tier] != leaving:
                out.append(f"the count of LEAVING {tier.value} copies is off")
        return out

    def pinned_and_reading(self) -> tuple[int, int]:
        entries = self.dir.entries.values()
        return (sum(1 for e in entries if e.pins),
                sum(c.readers for e in entries for t in LOCAL_TIERS if (c := e.copy(t)) is not None))


__all__ = ["Ledger", "WriteDown"]
