"""The KV cache's ledger: every change of a block's state, made under one lock, with no I/O.

The router (``router.KVCache``) moves bytes; before and after each transfer it asks the ledger,
holding ``ledger.lock``, to take or give back slots, readers and pins. Keeping every transition
here, and nothing else, is what lets ``problems`` state the invariants the router relies on:
each slot of a tier is free, in hand (taken by a thread about to attach it), in limbo (its copy
was dropped while still being read) or held by exactly one copy; a LEAVING copy is counted in
``leaving`` and has its write-down queued in ``writes`` or running on some thread.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from tierio.io.engine import Request
from tierio.kv.config import KVConfig
from tierio.kv.dram import DramTier
from tierio.kv.entries import Copy, Directory, Entry, State
from tierio.kv.slab import SlabTier
from tierio.kv.slabindex import SlotRecord
from tierio.kv.stats import Counters, Tier


@dataclass(eq=False)
class WriteDown:
    """One block going from its DRAM copy to the NVMe tier and/or the shared store."""

    entry: Entry
    src: Copy             # the DRAM copy (LEAVING when it is being evicted)
    dst: Copy | None      # the NVMe copy being filled; None when only the shared store is written
    evict: bool           # free the DRAM copy once written
    upload: bool          # also write the block to the shared store


class Ledger:
    """Bookkeeping of one cache. Every method expects ``lock`` to be held by the caller."""

    def __init__(self, config: KVConfig, dram: DramTier | None, counters: Counters) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)  # notified whenever a DRAM slot is freed
        self.dram = dram
        self.nvme: SlabTier | None = None
        self.shared = False                          # a shared store is configured
        self.counters = counters
        self.dir = Directory(ghost_limit=4 * (dram.nslots if dram else 0) + 1024)
        self.writes: deque[Request[None]] = deque()  # background write-downs not yet reaped
        self.writing = 0                             # write-downs started and not finished
        self.leaving = 0                             # DRAM copies in state LEAVING
        self.limbo: dict[Tier, set[int]] = {Tier.DRAM: set(), Tier.NVME: set()}
        self.in_hand: set[int] = set()               # DRAM slots taken, not yet attached to a copy

    # -- what goes where --------------------------------------------------------------------------
    def admitted(self, e: Entry) -> bool:
        """May ``e`` be written below DRAM (used often enough, and a tier there)?"""
        return e.uses >= self.config.admit_uses and (self.nvme is not None or self.shared)

    def loses_dram(self, e: Entry) -> bool:
        return e.nvme is None and not self.admitted(e)

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
    def take_dram_slot(self) -> int | None:
        assert self.dram is not None
        slot = self.dram.alloc()
        if slot is not None:
            self.in_hand.add(slot)  # until the taker attaches or releases it
        return slot

    def claim(self, slot: int) -> None:
        """The taker of ``slot`` is attaching or releasing it now."""
        self.in_hand.discard(slot)

    def release(self, tier: Tier, slot: int) -> None:
        if tier is Tier.DRAM:
            assert self.dram is not None
            self.dram.release(slot)
            self.space.notify_all()
        else:
            assert self.nvme is not None
            self.nvme.release(slot)

    def nvme_slot(self, protect: frozenset[bytes]) -> int | None:
        assert self.nvme is not None
        slot = self.nvme.alloc()
        if slot is None:
            victim = self.dir.victim(Tier.NVME, lambda e: e.dram is None, protect)
            if victim is not None:
                self.drop_copy(victim, Tier.NVME)
                slot = self.nvme.alloc()
        return slot

    def attach_filling(self, key: bytes, parent: bytes, slot: int, *, unless_cached: bool) -> tuple[Entry, Copy | None]:
        """Attach DRAM ``slot`` (in hand) to ``key``'s block as a FILLING copy. When another thread
        got there first (the block has a DRAM copy now, or any copy if ``unless_cached``) the slot
        is released instead and the copy is None."""
        self.claim(slot)
        e = self.dir.entries.get(key)
        if e is not None and (e.has_copies() if unless_cached else e.dram is not None):
            self.release(Tier.DRAM, slot)
            return e, None
        e = e or self.dir.add(key, parent)
        c = Copy(Tier.DRAM, slot, State.FILLING)
        self.dir.attach(e, c)
        return e, c

    def filled(self, e: Entry, c: Copy, ok: bool) -> threading.Event | None:
        """A FILLING copy is done: readable, or (not ``ok``) dropped. Returns the event its waiters
        wait on, to be set once the lock is released."""
        event, c.filled = c.filled, None
        if ok:
            c.state = State.READY
        else:
            self.drop_copy(e, Tier.DRAM)
        return event

    # -- copies ---------------------------------------------------------------------------------
    def drop_copy(self, e: Entry, tier: Tier) -> None:
        """Remove ``e``'s copy in ``tier`` and free its slot (the entry goes too once it has no
        copy and no pin). A copy still being read leaves its slot in limbo until the last reader."""
        c = self.dir.detach(e, tier)
        if c is None:
            return
        if c.state is State.LEAVING:
            self.leaving -= 1
        if c.readers:
            self.limbo[tier].add(c.slot)
        else:
            self.release(tier, c.slot)
        if self.dir.forget(e):
            self.counters.dropped += 1

    def free_if_done(self, e: Entry, c: Copy) -> None:
        if c.state is State.LEAVING and c.written and c.readers == 0 and e.dram is c:
            self.drop_copy(e, Tier.DRAM)

    def reader(self, key: bytes) -> tuple[Entry | None, Copy | None, threading.Event | None]:
        """The entry of ``key``, its fastest readable copy (now read: readers + 1), or the event to
        wait on while its DRAM copy is being filled (made by the first waiter: most fills have none)."""
        e = self.dir.entries.get(key)
        if e is None:
            return None, None, None
        c = e.fastest_readable()
        if c is not None:
            c.readers += 1
            return e, c, None
        if e.dram is None:
            return e, None, None
        if e.dram.filled is None:
            e.dram.filled = threading.Event()
        return e, None, e.dram.filled

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
        elif c.tier is Tier.DRAM:
            self.free_if_done(e, c)
        self.dir.forget(e)

    # -- write-downs ----------------------------------------------------------------------------
    def start_write_down(self, e: Entry, *, evict: bool) -> WriteDown | None:
        """Begin moving ``e``'s DRAM copy down. Returns the job to run outside the lock, or None
        when nothing needs writing (when evicting, the copy was dropped at once)."""
        src = e.dram
        assert src is not None and src.state is State.READY
        dst = None
        if self.admitted(e) and e.nvme is None and self.nvme is not None:
            slot = self.nvme_slot(frozenset((e.key,)))
            if slot is not None:
                dst = Copy(Tier.NVME, slot, State.FILLING)
                self.dir.attach(e, dst)
        upload = self.shared and self.admitted(e)
        if dst is None and not upload:
            if evict:
                if not self.admitted(e) and e.nvme is None:
                    self.counters.not_admitted += 1
                self.drop_copy(e, Tier.DRAM)
            return None
        src.readers += 1
        if evict:
            src.state = State.LEAVING
            self.leaving += 1
        self.writing += 1
        return WriteDown(e, src, dst, evict, upload)

    def excess_write_downs(self) -> list[WriteDown]:
        """Once DRAM is above its high watermark, the write-downs (at most ``depth`` in flight)
        that bring it back to its low one. The caller queues them in ``writes`` before releasing
        the lock, so a thread that needs a slot always finds the request to run itself."""
        if self.dram is None or (self.nvme is None and not self.shared):
            return []  # nothing below DRAM: blocks leave only when a put needs their slot
        wm, n = self.config.watermarks, self.dram.nslots
        if self.dram.used - self.leaving <= wm.high * n:
            return []
        while self.writes and self.writes[0].future.done():
            self.writes.popleft()
        jobs = []
        while self.dram.used - self.leaving > wm.low * n and self.writing < self.config.depth:
            victim = self.dir.victim(Tier.DRAM, self.loses_dram)
            if victim is None:
                break
            job = self.start_write_down(victim, evict=True)
            if job is not None:
                jobs.append(job)
        return jobs

    def finish_write_down(self, job: WriteDown, ok: bool, checksum: int | None, block_bytes: int) -> None:
        e, src, dst = job.entry, job.src, job.dst
        self.writing -= 1
        if dst is not None:
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
        if self.dram is not None:
            slots[Tier.DRAM] = (self.dram.nslots,
                                self.dram.free_list() + sorted(self.limbo[Tier.DRAM]) + sorted(self.in_hand))
        if self.nvme is not None:
            slots[Tier.NVME] = (self.nvme.nslots, self.nvme.free_list() + sorted(self.limbo[Tier.NVME]))
        out = self.dir.problems(slots)
        if self.leaving != sum(1 for e in self.dir.entries.values() if e.dram and e.dram.state is State.LEAVING):
            out.append("the count of LEAVING DRAM copies is off")
        return out

    def pinned_and_reading(self) -> tuple[int, int]:
        entries = self.dir.entries.values()
        return (sum(1 for e in entries if e.pins),
                sum((e.dram.readers if e.dram else 0) + (e.nvme.readers if e.nvme else 0) for e in entries))


__all__ = ["Ledger", "WriteDown"]
