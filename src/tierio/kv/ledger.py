"""The KV cache's ledger: which blocks exist, where their copies are, who uses them, and every
change of that state, made under one lock with no I/O.

Ownership: the ledger is the only code that changes an ``Entry`` or a ``Copy`` (its fields, the
entries by key, the LRU orders, the ghost uses), and only while ``lock`` is held by the caller of
its methods. The cache (``cache.KVCache`` and the modules it is built from) moves bytes: before
and after each transfer it calls a ledger method, holding ``lock``, to take or give back slots,
readers and pins, and reads entries only through what those methods return (under the lock, or
fields nobody changes while it holds a reader on a copy). Tiers own their bytes and free lists;
the ledger takes and gives back their slots. Counters are the cache's, under the same lock.

Invariants (``problems``, stated in ``invariants``): each slot is free, in hand, in limbo (its
copy dropped while still read) or held by exactly one copy; a LEAVING copy is counted in
``leaving`` and has its write-down queued in its tier's ``writes`` or running on some thread.

The memory tiers (``pools``: the optional device pool, DRAM) are kept alike: puts and prefetches fill their slots,
and their least recently used blocks (prefix-aware LRU, see ``entries``) are written down, the device tier's into
DRAM and DRAM's to NVMe and the shared store. Each tier has its own queue of write-downs, so finishing a device
block's write-down (which needs a DRAM slot, and may run a DRAM write-down for it) never waits on the device tier's
own queue. A leased block keeps its leaving copy while no copy below stands in (a failed write, an evicted one).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from tierio.io.engine import Request
from tierio.kv.config import KVConfig
from tierio.kv.entries import LOCAL_TIERS, MEMORY_TIERS, Copy, Entry, State, WriteDown
from tierio.kv.invariants import entry_problems, leaving_problems, pinned_and_reading
from tierio.kv.results import Move
from tierio.kv.stats import Counters, KVTier
from tierio.kv.tiers.slab import SlabTier
from tierio.kv.tiers.slabindex import SlotRecord
from tierio.kv.tiers.slots import FreeSlots, SlotPool

SCAN_LIMIT = 1024  # candidates looked at per eviction before settling for a fallback


class Ledger:
    """Bookkeeping of one cache. Every method expects ``lock`` to be held by the caller."""

    def __init__(self, config: KVConfig, pools: dict[KVTier, SlotPool], counters: Counters) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)  # notified whenever a memory slot is freed
        self.pools = pools                           # the memory tiers present: DEVICE, DRAM
        self.dram = pools.get(KVTier.DRAM)
        self.nvme: SlabTier | None = None
        self.shared = False                          # a shared store is configured
        self.counters = counters
        self._entries: dict[bytes, Entry] = {}
        self._lru: dict[KVTier, OrderedDict[bytes, Entry]] = {t: OrderedDict() for t in LOCAL_TIERS}
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # uses of blocks that left (bounded)
        self._ghost_limit = 4 * sum(p.nslots for p in pools.values()) + 1024
        self.writes: dict[KVTier, deque[Request[None]]] = {t: deque() for t in MEMORY_TIERS}  # not yet reaped
        self.writing = dict.fromkeys(MEMORY_TIERS, 0)  # write-downs started and not finished
        self.leaving = dict.fromkeys(MEMORY_TIERS, 0)  # copies in state LEAVING
        self.limbo: dict[KVTier, set[int]] = {t: set() for t in LOCAL_TIERS}
        self.in_hand: dict[KVTier, set[int]] = {t: set() for t in MEMORY_TIERS}  # taken, not yet attached

    def open_lower(self, nvme: SlabTier | None, shared: bool) -> None:
        """The tiers below DRAM the cache opened (the NVMe tier's blocks widen the ghost memory)."""
        self.nvme, self.shared = nvme, shared
        if nvme is not None:
            self._ghost_limit += 4 * nvme.nslots

    # -- entries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def _add(self, key: bytes, parent: bytes) -> Entry:
        e = Entry(key, parent, uses=self._ghost.pop(key, 0))
        self._entries[key] = e
        p = self._entries.get(parent)
        if p is not None:
            p.children += 1
        return e

    def _forget(self, e: Entry) -> bool:
        """Remove an entry that has no copy and no pin; its uses are remembered. True if removed."""
        if e.has_copies() or e.pins or self._entries.get(e.key) is not e:
            return False
        del self._entries[e.key]
        p = self._entries.get(e.parent)
        if p is not None and p.children > 0:
            p.children -= 1
        self._ghost[e.key] = e.uses
        self._ghost.move_to_end(e.key)
        while len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)
        return True

    def _attach(self, e: Entry, c: Copy) -> None:
        setattr(e, c.tier.value, c)  # the copy fields are named after the tiers
        self._lru[c.tier][e.key] = e
        self._where(e)

    def _detach(self, e: Entry, tier: KVTier) -> Copy | None:
        c = e.copy(tier)
        if c is None:
            return None
        setattr(e, tier.value, None)
        self._lru[tier].pop(e.key, None)
        self._where(e)
        return c

    @staticmethod
    def _where(e: Entry) -> None:
        e.where = next((t for t in LOCAL_TIERS if e.copy(t) is not None), None)

    def recover(self, records: list[SlotRecord]) -> None:
        """Enter blocks a previous process committed to the NVMe tier, oldest first (LRU order survives)."""
        for rec in records:
            e = self._add(rec.key, rec.parent)
            e.checksum = rec.checksum
            self._attach(e, Copy(KVTier.NVME, rec.slot, State.READY))
        for e in self._entries.values():
            e.children = 0
        for e in self._entries.values():  # counted once all are in: parents may come after children
            p = self._entries.get(e.parent)
            if p is not None:
                p.children += 1

    def prefix_tiers(self, keys: Sequence[bytes]) -> list[KVTier]:
        """The fastest tier of each block of the longest cached prefix of ``keys``."""
        tiers: list[KVTier] = []
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.where is None:
                break
            tiers.append(e.where)
        return tiers

    def use_cached(self, key: bytes) -> Entry | None:
        """A put of ``key``: its entry, with a use counted, when the cache holds a copy of it."""
        e = self._entries.get(key)
        if e is None or not e.has_copies():
            return None
        e.uses += 1
        return e

    def use_chain(self, keys: Sequence[bytes]) -> list[Entry]:
        """A get of ``keys``: the entries of the leading keys the cache knows, each used, touched."""
        chain = []
        for k in keys:
            e = self._entries.get(k)
            if e is None:
                break
            e.uses += 1
            chain.append(e)
        self.touch(chain)
        return chain

    def touch(self, chain: Iterable[Entry]) -> None:
        """Mark a chain used, tail first, so its head ends up the most recently used."""
        for e in reversed(list(chain)):
            for tier in LOCAL_TIERS:
                if e.copy(tier) is not None:
                    self._lru[tier].move_to_end(e.key)

    def set_checksum(self, e: Entry, checksum: int) -> None:  # a block read from the shared store
        e.checksum = checksum

    # -- what goes where --------------------------------------------------------------------------
    def admitted(self, e: Entry) -> bool:
        """May ``e`` be written below DRAM (used often enough, and a tier there)?"""
        return e.uses >= self.config.admit_uses and (self.nvme is not None or self.shared)

    def loses(self, tier: KVTier) -> Callable[[Entry], bool]:
        """``loses(tier)(e)``: evicting ``e``'s copy in ``tier`` drops the block from the cache."""
        if tier is KVTier.DEVICE:  # written down into DRAM, unless there is none
            return lambda e: self.dram is None and e.dram is None and e.nvme is None
        if tier is KVTier.DRAM:
            return lambda e: e.device is None and e.nvme is None and not self.admitted(e)
        return lambda e: e.device is None and e.dram is None

    def _victim(self, tier: KVTier, protect: frozenset[bytes] = frozenset(), *, strict: bool = True) -> Entry | None:
        """The least recently used copy in ``tier`` that nobody reads, pins or fills. A block whose
        eviction loses it while it has cached children is taken only when nothing else is
        evictable. Keys in ``protect`` are never taken (``strict``), or never taken when taking
        them loses them (a put longer than DRAM may send its own first blocks down a tier, but
        never drop them)."""
        loses = self.loses(tier)
        fallback = None
        for n, (key, e) in enumerate(self._lru[tier].items()):
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

    # -- slots ----------------------------------------------------------------------------------
    def _slots(self, tier: KVTier) -> FreeSlots:
        pool = self.nvme if tier is KVTier.NVME else self.pools.get(tier)
        assert pool is not None, tier
        return pool

    def take_slot(self, tier: KVTier) -> int | None:
        """A free slot of memory tier ``tier``, in hand until its taker attaches or releases it."""
        slot = self._slots(tier).alloc()
        if slot is not None:
            self.in_hand[tier].add(slot)
        return slot

    def release(self, tier: KVTier, slot: int) -> None:
        self._slots(tier).release(slot)
        if tier in self.pools:
            self.space.notify_all()

    def evict_one(self, tier: KVTier, protect: frozenset[bytes], *, strict: bool) -> tuple[bool, WriteDown | None]:
        """Start evicting ``tier``'s best victim: (found one, its write-down or None if dropped at once)."""
        victim = self._victim(tier, protect, strict=strict)
        if victim is None:
            return False, None
        return True, self.start_write_down(victim, tier, evict=True)

    def queue_write(self, job: WriteDown, request: Request[None]) -> None:
        """``job`` started on the pool: queued with its tier (so a thread needing a slot can run it)."""
        self.writes[job.src.tier].append(request)

    def next_write(self, tiers: Sequence[KVTier] = MEMORY_TIERS) -> Request[None] | None:
        """Take the oldest queued write-down of the first of ``tiers`` that has one (to wait on it)."""
        queue = next((self.writes[t] for t in tiers if self.writes[t]), None)
        return queue.popleft() if queue is not None else None

    def _nvme_slot(self, protect: frozenset[bytes]) -> int | None:
        assert self.nvme is not None
        slot = self.nvme.alloc()
        if slot is None:
            victim = self._victim(KVTier.NVME, protect)
            if victim is not None:
                self.drop_copy(victim, KVTier.NVME)
                slot = self.nvme.alloc()
        return slot

    def attach_filling(self, tier: KVTier, key: bytes, parent: bytes, slot: int, *, unless_cached: bool,
                       use: bool = False) -> tuple[Entry, Copy | None]:
        """Attach ``slot`` of memory tier ``tier`` (in hand) to ``key``'s block as a FILLING copy.
        When another thread got there first (the block has a copy in ``tier`` now, or any copy if
        ``unless_cached``) the slot is released instead and the copy is None. ``use``: count a use
        of the block either way (a put)."""
        self.in_hand[tier].discard(slot)
        e = self._entries.get(key)
        if e is not None and (e.has_copies() if unless_cached else e.copy(tier) is not None):
            e.uses += use
            self.release(tier, slot)
            return e, None
        e = e or self._add(key, parent)
        e.uses += use
        c = Copy(tier, slot, State.FILLING)
        self._attach(e, c)
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
    def drop_copy(self, e: Entry, tier: KVTier) -> None:
        """Remove ``e``'s copy in ``tier`` and free its slot (the entry goes too once it has no
        copy and no pin). A copy still being read leaves its slot in limbo until the last reader."""
        c = self._detach(e, tier)
        if c is None:
            return
        if c.state is State.LEAVING:
            self.leaving[tier] -= 1
        if c.readers:
            self.limbo[tier].add(c.slot)
        else:
            self.release(tier, c.slot)
        if self._forget(e):
            self.counters.dropped += 1

    def mark_failed(self, e: Entry, c: Copy) -> None:
        """``c`` failed a read or a check: nobody gets it again (unless it was replaced already)."""
        if e.copy(c.tier) is c:
            self.drop_copy(e, c.tier)

    def _free_if_done(self, e: Entry, c: Copy) -> None:
        """Free a leaving copy written down and read by nobody, unless leased with no other READY copy."""
        if c.state is State.LEAVING and c.written and c.readers == 0 and e.copy(c.tier) is c:
            if e.pins and not e.ready_besides(c):
                c.state, c.written, self.leaving[c.tier] = State.READY, False, self.leaving[c.tier] - 1
            else:
                self.drop_copy(e, c.tier)

    def reader(self, key: bytes, order: tuple[KVTier, ...] = LOCAL_TIERS
               ) -> tuple[Entry | None, Copy | None, threading.Event | None]:
        """The entry of ``key``, its first readable copy in ``order`` (now read: readers + 1), or
        the event to wait on while a copy in a memory tier is being filled (made by the first
        waiter: most fills have none)."""
        e = self._entries.get(key)
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
            self._free_if_done(e, c)
        self._forget(e)

    # -- moving up ------------------------------------------------------------------------------
    def promotion_source(self, key: bytes) -> tuple[Move | None, Entry | None, Copy | None]:
        """Where a promotion of ``key`` into DRAM reads from: (an outcome when there is nothing to
        do, the entry, its NVMe copy now read, or None for the shared store)."""
        e = self._entries.get(key)
        if e is not None and (e.dram is not None or e.device is not None):
            return Move.PRESENT, e, None
        src = e.nvme if e is not None and e.nvme is not None and e.nvme.readable else None
        if (e is None and not self.shared) or (e is not None and src is None):
            return Move.FAILED, e, None
        if src is not None:
            src.readers += 1
        return None, e, src

    def in_memory(self, key: bytes) -> tuple[bool, bool]:
        """Whether ``key``'s block has a copy (ready or not) in the device tier, and in DRAM."""
        e = self._entries.get(key)
        return e is not None and e.device is not None, e is not None and e.dram is not None

    # -- write-downs ----------------------------------------------------------------------------
    def start_write_down(self, e: Entry, tier: KVTier, *, evict: bool) -> WriteDown | None:
        """Begin moving ``e``'s copy in memory tier ``tier`` down. Returns the job to run outside
        the lock, or None when nothing needs writing (when evicting, the copy was dropped at once)."""
        src = e.copy(tier)
        assert src is not None and src.state is State.READY
        if tier is KVTier.DEVICE:
            dst, upload = None, False
            needed = self.dram is not None and e.dram is None  # a DRAM copy (even one on its way) will do
        else:
            dst = None
            if self.admitted(e) and e.nvme is None and self.nvme is not None:
                slot = self._nvme_slot(frozenset((e.key,)))
                if slot is not None:
                    dst = Copy(KVTier.NVME, slot, State.FILLING)
                    self._attach(e, dst)
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

    def attach_demotion(self, job: WriteDown, slot: int) -> bool:
        """Attach DRAM ``slot`` (in hand) as a device write-down's FILLING copy; False: one exists."""
        _, job.dst = self.attach_filling(KVTier.DRAM, job.entry.key, job.entry.parent, slot, unless_cached=False)
        return job.dst is not None

    def flush_jobs(self, tier: KVTier, also: Callable[[Entry], bool]) -> list[WriteDown]:
        """Write-downs (keeping the copy) of ``tier``'s admitted blocks with no NVMe copy, if ``also``."""
        jobs = []
        for e in list(self._lru[tier].values()):
            c = e.copy(tier)
            if c is not None and c.state is State.READY and e.nvme is None and self.admitted(e) and also(e):
                job = self.start_write_down(e, tier, evict=False)
                if job is not None:
                    jobs.append(job)
        return jobs

    def excess_write_downs(self) -> list[WriteDown]:
        """For each memory tier above its high watermark, the write-downs (at most ``depth`` in
        flight per tier) that bring it back to its low one. The caller queues them in ``writes``
        before releasing the lock, so a thread that needs a slot always finds the request to run
        itself."""
        jobs = []
        for tier, pool in self.pools.items():
            below = self.dram is not None if tier is KVTier.DEVICE else self.nvme is not None or self.shared
            if not below:
                continue  # nothing below: blocks leave only when a put needs their slot
            wm, n = self.config.watermarks, pool.nslots
            if pool.used - self.leaving[tier] <= wm.high * n:
                continue
            writes = self.writes[tier]
            while writes and writes[0].future.done():
                writes.popleft()
            while pool.used - self.leaving[tier] > wm.low * n and self.writing[tier] < self.config.depth:
                victim = self._victim(tier)
                if victim is None:
                    break
                job = self.start_write_down(victim, tier, evict=True)
                if job is not None:
                    jobs.append(job)
        return jobs

    def finish_write_down(self, job: WriteDown, ok: bool, checksum: int | None, block_bytes: int) -> threading.Event | None:
        """A write-down is over (``ok``: its copy below is complete). Returns the event waiters on
        a DRAM copy filled from the device tier wait on, to be set once the lock is released."""
        e, src, dst = job.entry, job.src, job.dst
        self.writing[src.tier] -= 1
        event = None
        if dst is not None and dst.tier is KVTier.DRAM:
            event = self.filled(e, dst, ok)
            self.counters.demoted += ok
        elif dst is not None:
            if ok:
                dst.state, e.checksum = State.READY, checksum
                self.counters.written_down += 1
                self.counters.written_bytes += block_bytes
            else:
                self._detach(e, KVTier.NVME)
                self.release(KVTier.NVME, dst.slot)
        src.readers -= 1
        if job.evict:
            src.written = True
            self._free_if_done(e, src)
        self._forget(e)
        return event

    # -- pins and explicit eviction -------------------------------------------------------------
    def pin(self, keys: list[bytes]) -> int:
        for n, k in enumerate(keys):
            e = self._entries.get(k)
            if e is None or not e.has_copies():
                return n
            e.pins += 1
        return len(keys)

    def unpin(self, keys: list[bytes]) -> None:
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.pins == 0:
                break
            e.pins -= 1
            self._forget(e)

    def evict(self, keys: list[bytes], tiers: tuple[KVTier, ...]) -> int:
        n = 0
        for k in keys:
            e = self._entries.get(k)
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
        slots: dict[KVTier, tuple[int, list[int]]] = {}
        for tier, pool in self.pools.items():
            slots[tier] = (pool.nslots, pool.free_list() + sorted(self.limbo[tier]) + sorted(self.in_hand[tier]))
        if self.nvme is not None:
            slots[KVTier.NVME] = (self.nvme.nslots, self.nvme.free_list() + sorted(self.limbo[KVTier.NVME]))
        return entry_problems(self._entries, self._lru, slots) + leaving_problems(self._entries.values(), self.leaving)

    def pinned_and_reading(self) -> tuple[int, int]:
        return pinned_and_reading(self._entries.values())


__all__ = ["Ledger"]
