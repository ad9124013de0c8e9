"""The KV cache: one engine-agnostic block store over host DRAM, local NVMe and a shared store.

An engine hashes a prompt into block keys, asks ``lookup`` for the longest cached prefix, ``get``s
those blocks into its own memory, computes the rest, and ``put``s the new blocks. Everything that
moves bytes runs on tierio's shared I/O pool and returns a ``Pending`` handle.

Routing (see docs/kv.md):

* **put** lands in DRAM. When DRAM use rises above its high watermark, the least recently used
  blocks are written down to NVMe in the background until it is back to the low watermark; a put
  that finds DRAM full writes a victim down itself rather than waiting on a queue.
* **admission**: a block leaving DRAM is written to NVMe (and the shared store) only once it has
  been used ``admit_uses`` times, counting earlier lives in the cache, so one-off blocks do not
  wear the NVMe; others are dropped.
* **eviction** is LRU per tier and prefix-aware (``entries``): tails leave before heads.
* **get** reads each block from the fastest tier holding it; blocks read from NVMe or the shared
  store are checked against their xxh3. **prefetch** brings blocks up into DRAM in chain order, so
  a resumed request uses its first blocks while later ones are still arriving (a get waits for a
  block that is being brought up instead of reading it twice).
* **failure is a miss**: a checksum mismatch, a short or failed read, a full disk or a timeout is
  counted, warned about once, and the block is not delivered; every reader count, pin and slot is
  released on every path, and no call waits without a deadline.

Locking: one lock guards all bookkeeping, every change of which is a ``ledger.Ledger`` method; no
I/O runs under it. A thread only ever waits for a transfer that is running on another thread, or
runs a queued one itself, so calls cannot deadlock each other however many threads use the cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Self

import numpy as np

from tierio.errors import ConfigError, DiskFullError, IntegrityError, NotFoundError, StorageError, TierioError
from tierio.io.engine import run_windows, submit
from tierio.io.files import bounce_pool
from tierio.kv.config import KVConfig
from tierio.kv.dram import DramTier
from tierio.kv.entries import Copy, Entry, State
from tierio.kv.ledger import Ledger, WriteDown
from tierio.kv.keys import BlockKey, Namespace, chain_keys, root_key
from tierio.kv.layout import BlockLayout
from tierio.kv.results import GetResult, Lookup, Pending, PrefetchResult, PutResult
from tierio.kv.rule import DecodeSLA, fetch_rule
from tierio.kv.shared import SharedTier, block_checksum
from tierio.kv.slab import SlabTier
from tierio.kv.slabindex import SlotRecord
from tierio.kv.stats import Counters, KVStats, Tier, TierStats
from tierio.kv.views import copy_in, copy_out, host_bytes, is_device_tensor, split

log = logging.getLogger("tierio.kv")

_IO_ERRORS = (TierioError, OSError)
INLINE_BYTES = 256 << 10  # puts and gets moving at most this much run on the caller's thread
COPY_CHUNK = 256 << 20    # DRAM gets copy runs of adjacent slots in pieces of this size


class KVCache:
    """A tiered KV block store for one model layout (see the module docstring).

    Not fork-safe: open it in the process that serves. Call ``close`` (or use ``with``) when done:
    it writes DRAM blocks down to NVMe (``persist_on_close``) so the next process finds them."""

    def __init__(self, layout: BlockLayout, namespace: Namespace, config: KVConfig | None = None) -> None:
        self.layout = layout
        self.namespace = namespace
        self.config = config = config or KVConfig()
        self.root = root_key(namespace, layout)
        self.block_bytes = layout.block_bytes
        self.counters = Counters()
        self._warned: set[str] = set()
        self._notes: list[str] = []
        self._fetch_latency = config.fetch_latency_s
        self._closed = False
        dram_slots = DramTier.slots_for(config.dram_bytes, self.block_bytes)
        if config.nvme_bytes and dram_slots < 2:
            raise ConfigError(f"KV cache: the NVMe tier is written from DRAM slots; give dram_bytes room for at least "
                              f"2 blocks of {self.block_bytes} bytes")
        self.dram = DramTier(dram_slots, self.block_bytes) if dram_slots else None
        self.nvme: SlabTier | None = None
        self.shared: SharedTier | None = None
        self._ledger = Ledger(config, self.dram, self.counters)
        self._lock = self._ledger.lock
        try:
            self._open_lower_tiers()
        except BaseException:
            self.close(persist=False)
            raise

    def _open_lower_tiers(self) -> None:
        c = self.config
        if c.nvme_bytes and c.nvme_dir is not None:
            try:
                tier = SlabTier(c.nvme_dir, self.block_bytes, c.nvme_bytes, slab_bytes=c.slab_bytes,
                                piece_bytes=c.piece_bytes, layout=self.layout.describe())
            except DiskFullError as exc:  # a cache is optional: serve from DRAM rather than not at all
                self.counters.disk_full += 1
                self._warn("nvme-off", f"{exc}; the NVMe KV tier is off, serving from DRAM only")
                tier = None
        else:
            tier = None
        if tier is not None:
            self._recover(tier)
            if tier.nslots:
                self.nvme = self._ledger.nvme = tier
                self._ledger.dir.ghost_limit += 4 * tier.nslots
            else:
                tier.close()
                self._warn("nvme-off", f"the NVMe tier under {c.nvme_dir} has no room for a block; serving from DRAM only")
        if c.shared_url:
            self.shared = SharedTier(c.shared_url, self.block_bytes)
            self._ledger.shared = True

    def _recover(self, tier: SlabTier) -> None:
        """Enter the blocks a previous process committed to ``tier`` (oldest first, so LRU order survives)."""
        report = tier.report
        for note in report.notes:
            self._warn(note, note)
        if report.disk_full:
            self.counters.disk_full += 1
        self.counters.discarded = report.discarded
        if report.discarded:
            self._warn("discarded", f"{tier.directory}: {report.discarded} index records were torn, damaged or out of "
                                    f"range and were discarded ({report.reasons})")
        self._ledger.recover(report.records)
        self.counters.recovered = len(report.records)

    # -- keys and lookups -----------------------------------------------------------------------
    def hash_blocks(self, token_ids: Any) -> list[BlockKey]:
        """Keys of every whole block of ``token_ids`` (see ``tierio.kv.keys``)."""
        return chain_keys(self.root, token_ids, self.layout.tokens)

    def lookup(self, keys: Sequence[bytes], sla: DecodeSLA | None = None, *, probe_shared: bool = True) -> Lookup:
        """The longest prefix of ``keys`` the cache holds and the tier of each block.

        With ``sla``, the decode-latency rule decides whether blocks on NVMe (or the shared store)
        may serve this request: if fetching them would cost more than the SLA's budget, the prefix
        stops before the first of them (the caller recomputes from there)."""
        tiers: list[Tier] = []
        with self._lock:
            self.counters.lookups += 1
            self.counters.lookup_keys += len(keys)
            entries = self._ledger.dir.entries
            for k in keys:
                e = entries.get(k)
                if e is None or e.where is None:
                    break
                tiers.append(e.where)
        if self.shared is not None and probe_shared:
            tiers.extend(self._probe_shared(keys[len(tiers):]))
        rule = None
        slow = [i for i, t in enumerate(tiers) if t is not Tier.DRAM]
        if sla is not None and slow:
            rule = fetch_rule(len(slow) / len(keys), self._fetch_latency, sla.decode_latency_s, sla.budget)
            if not rule.viable:
                tiers = tiers[:slow[0]]
        return Lookup(len(tiers), len(tiers) * self.layout.tokens, tiers, rule)

    def _probe_shared(self, keys: Sequence[bytes]) -> list[Tier]:
        found: list[Tier] = []
        assert self.shared is not None
        for k in keys:
            try:
                if not self.shared.exists(k):
                    break
            except _IO_ERRORS as exc:
                self._failed(exc, "probing the shared store")
                break
            found.append(Tier.SHARED)
        return found

    # -- put ------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Any, *, parent: bytes | None = None) -> Pending[PutResult]:
        """Store ``blocks`` (one buffer per key, or one buffer holding them back to back; host or
        accelerator memory) under ``keys``, a run of one chain. ``parent``: the key before
        ``keys[0]`` (None: ``keys[0]`` is its chain's first block). The sources are copied before
        the result is ready: keep them unchanged until then."""
        self._check_open()
        keys = list(keys)
        sources = [s if is_device_tensor(s) else host_bytes(s, self.block_bytes, f"put: block {i}", writable=False)
                   for i, s in enumerate(split(blocks, len(keys), self.block_bytes, "put: blocks"))]
        parents = [parent or self.root, *keys[:-1]]
        return Pending.run(partial(self._put, keys, parents, sources), self._inline(len(keys)))

    def _inline(self, blocks: int) -> bool:
        """Transfers this small run on the calling thread: a hand-off to the pool costs more."""
        return blocks * self.block_bytes <= INLINE_BYTES

    def _put(self, keys: list[bytes], parents: list[bytes], sources: list[Any]) -> PutResult:
        stored = cached = 0
        chain: list[Entry] = []
        led = self._ledger
        protect = frozenset(keys)
        for i, key in enumerate(keys):
            with self._lock:
                e = led.dir.entries.get(key)
                if e is not None and e.has_copies():
                    e.uses += 1
                    cached += 1
                    chain.append(e)
                    continue
            # A put longer than DRAM may send its own first blocks down a tier, never drop them.
            slot = self._dram_slot(protect, strict=False) if self.dram is not None else None
            if slot is None:  # the rest of the chain would be unreachable without this block
                dropped = len(keys) - i
                with self._lock:
                    self.counters.put_dropped += dropped
                return self._put_done(chain, stored, cached, dropped)
            e, filled = self._fill(key, parents[i], slot, sources[i])
            stored += filled
            cached += not filled
            chain.append(e)
            with self._lock:  # keep write-downs flowing while a long put fills DRAM
                self._write_down_excess()
        return self._put_done(chain, stored, cached, 0)

    def _fill(self, key: bytes, parent: bytes, slot: int, source: Any) -> tuple[Entry, bool]:
        """Copy one block into DRAM ``slot`` under ``key``; False when another thread stored it meanwhile."""
        assert self.dram is not None
        with self._lock:
            e, c = self._ledger.attach_filling(key, parent, slot, unless_cached=True)
            e.uses += 1
        if c is None:
            return e, False
        ok = False
        try:
            copy_in(self.dram.block(slot), source, "put: block")
            ok = True
        finally:
            with self._lock:
                event = self._ledger.filled(e, c, ok)
                self.counters.stored += ok
            if event is not None:
                event.set()
        return e, True

    def _put_done(self, chain: list[Entry], stored: int, cached: int, dropped: int) -> PutResult:
        with self._lock:
            self._ledger.dir.touch(chain)
            self.counters.already_cached += cached
            self._write_down_excess()
        return PutResult(stored, cached, dropped)

    # -- DRAM slots and write-downs -------------------------------------------------------------
    def _dram_slot(self, protect: frozenset[bytes], *, strict: bool = True) -> int | None:
        """A free DRAM slot, made by evicting if need be. Evicting runs the victim's write-down on
        this thread, or a queued one, or waits (bounded) for one running elsewhere: never for a
        request still in a queue. None when every slot is pinned, read or filling."""
        led = self._ledger
        deadline = time.monotonic() + self.config.io_timeout_s
        while True:
            job = req = None
            with led.space:
                slot = led.take_dram_slot()
                if slot is not None:
                    return slot
                if led.writes:  # finishing (or running) a write-down already begun frees a slot too
                    req = led.writes.popleft()
                elif (victim := led.dir.victim(Tier.DRAM, led.loses_dram, protect, strict=strict)) is not None:
                    job = led.start_write_down(victim, evict=True)
                elif not led.leaving:
                    return None
                elif time.monotonic() > deadline:
                    self.counters.timeouts += 1
                    return None
                else:  # every LEAVING copy's write is running somewhere: wait for one to free its slot
                    led.space.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                    continue
            if job is not None:
                self._write_down(job)
            elif req is not None:
                req.result()  # write-downs count their own I/O failures; anything else is a bug and surfaces

    def _write_down_excess(self) -> None:
        """Under the lock: start the write-downs the watermarks ask for, each queued in the same
        lock hold that marks its copy LEAVING (see ``Ledger.excess_write_downs``)."""
        for job in self._ledger.excess_write_downs():
            self._ledger.writes.append(submit(partial(self._write_down, job)))

    def _write_down(self, job: WriteDown) -> None:
        assert self.dram is not None
        e, data = job.entry, self.dram.block(job.src.slot)
        ok, checksum, error = False, e.checksum, None
        try:
            checksum = checksum if checksum is not None else block_checksum(data)
            if job.dst is not None:
                assert self.nvme is not None
                rec = SlotRecord(job.dst.slot, e.key, e.parent, checksum, self.nvme.next_seq())
                self.nvme.write(job.dst.slot, self.dram.slot_view(job.src.slot), rec)
            ok = True
            if job.upload:
                self._upload(e.key, data, checksum)
        except _IO_ERRORS as exc:
            error = exc
        finally:
            with self._lock:
                self._ledger.finish_write_down(job, ok, checksum, self.block_bytes)
        if error is not None:
            self._failed(error, "writing a block down")

    def _upload(self, key: bytes, data: np.ndarray, checksum: int) -> None:
        assert self.shared is not None
        try:
            if not self.shared.exists(key):
                self.shared.write(key, data, checksum)
                with self._lock:
                    self.counters.uploaded += 1
        except _IO_ERRORS as exc:  # the shared copy is optional: the local one stands
            self._failed(exc, "uploading a block to the shared store")

    # -- get ------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], out: Any) -> Pending[GetResult]:
        """Copy the blocks of ``keys`` into ``out`` (one buffer per key, or one buffer for all of
        them back to back; host or accelerator memory). The result says how many leading blocks
        arrived verified: use that many, recompute the rest."""
        self._check_open()
        keys = list(keys)
        flat = None
        if not isinstance(out, (list, tuple)) and not is_device_tensor(out):
            flat = host_bytes(out, len(keys) * self.block_bytes, "get: out", writable=True)
            dests: list[Any] = [flat[i * self.block_bytes:(i + 1) * self.block_bytes] for i in range(len(keys))]
        else:
            dests = [d if is_device_tensor(d) else host_bytes(d, self.block_bytes, f"get: out block {i}", writable=True)
                     for i, d in enumerate(split(out, len(keys), self.block_bytes, "get: out"))]
        return Pending.run(partial(self._get, keys, dests, flat), self._inline(len(keys)))

    def _get(self, keys: list[bytes], dests: list[Any], flat: np.ndarray | None) -> GetResult:
        led = self._ledger
        with self._lock:
            chain = []
            for k in keys:
                e = led.dir.entries.get(k)
                if e is None:
                    break
                e.uses += 1
                chain.append(e)
            led.dir.touch(chain)
            held = led.hold_dram(chain) if flat is not None else {}
        try:
            if held:
                assert flat is not None
                self._copy_runs(held, flat)
        finally:
            if held:
                with self._lock:
                    for i, c in held.items():
                        led.unread(chain[i], c)
        stop = threading.Event()  # set at the first miss: later blocks are useless without it

        def one(i: int) -> Tier | None:
            if i in held:
                return Tier.DRAM
            if stop.is_set():
                return None
            got = self._serve(keys[i], dests[i])
            if got is None:
                stop.set()
            return got

        rest = len(keys) - len(held)
        if rest * self.block_bytes <= self.config.piece_bytes:  # small: the pool would cost more than the copies
            served = [one(i) for i in range(len(keys))]
        else:
            served = run_windows(range(len(keys)), one, self._depth())
        prefix = next((i for i, t in enumerate(served) if t is None), len(served))
        tiers = [t for t in served[:prefix] if t is not None]
        with self._lock:
            c = self.counters
            c.served += prefix
            c.missed += len(keys) - prefix
            c.served_dram += tiers.count(Tier.DRAM)
            c.served_nvme += tiers.count(Tier.NVME)
            c.served_shared += tiers.count(Tier.SHARED)
        return GetResult(prefix, tiers, len(keys) - prefix)

    def _copy_runs(self, held: dict[int, Copy], flat: np.ndarray) -> None:
        """Copy held DRAM blocks into ``flat`` (blocks back to back), a run of adjacent slots going
        to adjacent places as one copy: large copies let the C library stream them past the CPU
        caches, which per-block copies below its threshold (tens of MiB) do not get."""
        assert self.dram is not None
        b, slot_b, pool = self.block_bytes, self.dram.slot_bytes, self.dram.buffer.array
        runs: list[tuple[int, int, int]] = []  # (first block, blocks, first slot)
        for i in sorted(held):
            s = held[i].slot
            if runs and slot_b == b and runs[-1][0] + runs[-1][1] == i and runs[-1][2] + runs[-1][1] == s:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
            else:
                runs.append((i, 1, s))
        pieces = [(i * b + at, s * slot_b + at, min(COPY_CHUNK, n * b - at)) for i, n, s in runs
                  for at in range(0, n * b, COPY_CHUNK)]

        def piece(p: tuple[int, int, int]) -> None:
            dst, src, n = p
            np.copyto(flat[dst:dst + n], pool[src:src + n])

        if len(pieces) == 1:
            piece(pieces[0])
        else:
            run_windows(pieces, piece, 2)  # memory bandwidth, not threads, is the limit past two

    def _depth(self) -> int:
        """Blocks in flight: ``depth`` pieces' worth (a block reads in pieces of ``piece_bytes``),
        so large blocks keep the same bytes in flight as fio's queue depth and small ones more blocks."""
        return max(2, min(64, self.config.depth * self.config.piece_bytes // max(1, self.block_bytes)))

    def _serve(self, key: bytes, dest: Any) -> Tier | None:
        """Deliver one block into ``dest``; the tier it came from, or None (a miss, counted)."""
        deadline = time.monotonic() + self.config.io_timeout_s
        while True:
            with self._lock:
                e, c, wait = self._ledger.reader(key)
            if c is not None or wait is None:
                break
            if not wait.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    self.counters.timeouts += 1
                return None
        if e is None:
            return self._serve_shared(key, dest) if self.shared is not None else None
        if c is None:
            return None
        try:
            return self._read_copy(e, c, dest)
        finally:
            with self._lock:
                self._ledger.unread(e, c)

    def _read_copy(self, e: Entry, c: Copy, dest: Any) -> Tier | None:
        if c.tier is Tier.DRAM:
            assert self.dram is not None
            copy_out(dest, self.dram.block(c.slot), "get: out")
            return Tier.DRAM
        with self._host_target(dest) as host:
            t0 = time.monotonic()
            if self._read_nvme(e, c, host):
                self._measured(time.monotonic() - t0)
                return Tier.NVME
        return None

    def _read_nvme(self, e: Entry, c: Copy, host: np.ndarray) -> bool:
        """Read ``e``'s NVMe copy into ``host`` and check it; a failure loses the copy (counted)."""
        assert self.nvme is not None
        try:
            self.nvme.read(c.slot, host)
            if block_checksum(host) != e.checksum:
                raise IntegrityError(f"block {e.key.hex()} in NVMe slot {c.slot} under {self.nvme.directory} "
                                     "does not match its checksum")
            return True
        except _IO_ERRORS as exc:
            self._lose(e, c, exc)
            return False

    def _lose(self, e: Entry, c: Copy, exc: BaseException) -> None:
        """A copy failed a read or a check: nobody gets it again (the record goes too)."""
        with self._lock:
            if e.copy(c.tier) is c:
                self._ledger.drop_copy(e, c.tier)
        if c.tier is Tier.NVME and self.nvme is not None and isinstance(exc, IntegrityError):
            try:
                self.nvme.clear(c.slot)  # the slot is ours until our reader count drops
            except _IO_ERRORS:
                pass
        self._failed(exc, "reading a block")

    def _serve_shared(self, key: bytes, dest: Any) -> Tier | None:
        assert self.shared is not None
        with self._host_target(dest) as host:
            try:
                self.shared.read(key, host)
                return Tier.SHARED
            except NotFoundError:
                return None  # not there (any more): a plain miss
            except _IO_ERRORS as exc:
                self._failed(exc, "reading a block from the shared store")
                return None

    @contextmanager
    def _host_target(self, dest: Any) -> Iterator[np.ndarray]:
        """Host bytes to read a block into: ``dest`` itself, or (accelerator memory) a staging
        buffer copied to it afterwards."""
        if not is_device_tensor(dest):
            yield host_bytes(dest, self.block_bytes, "get: out", writable=True)
            return
        staging = bounce_pool().acquire(self.block_bytes)
        try:
            yield staging.array[:self.block_bytes]
            copy_out(dest, staging.array[:self.block_bytes], "get: out")
        finally:
            bounce_pool().release(staging)

    def _measured(self, seconds: float) -> None:
        with self._lock:
            self._fetch_latency = 0.8 * self._fetch_latency + 0.2 * seconds

    # -- prefetch -------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], deadline_s: float | None = None, *, parent: bytes | None = None
                 ) -> Pending[PrefetchResult]:
        """Bring the blocks of ``keys`` up into DRAM in the background, in chain order. Blocks that
        cannot start within ``deadline_s`` seconds are skipped. ``parent`` as for ``put`` (used
        for blocks that come from the shared store)."""
        self._check_open()
        keys = list(keys)
        until = None if deadline_s is None else time.monotonic() + deadline_s
        parents = [parent or self.root, *keys[:-1]]
        return Pending(submit(partial(self._prefetch, keys, parents, until)))  # always in the background

    def _prefetch(self, keys: list[bytes], parents: list[bytes], until: float | None) -> PrefetchResult:
        if self.dram is None:
            return PrefetchResult(0, 0, 0, len(keys))
        protect = frozenset(keys)
        outcomes = run_windows(range(len(keys)), lambda i: self._promote(keys[i], parents[i], protect, until),
                               self._depth())
        result = PrefetchResult(outcomes.count("moved"), outcomes.count("present"), outcomes.count("late"),
                                outcomes.count("failed"))
        with self._lock:
            self.counters.prefetched += result.moved
            self.counters.prefetch_late += result.late
        return result

    def _promote(self, key: bytes, parent: bytes, protect: frozenset[bytes], until: float | None) -> str:
        if until is not None and time.monotonic() > until:
            return "late"
        led = self._ledger
        with self._lock:
            e = led.dir.entries.get(key)
            if e is not None and e.dram is not None:
                return "present"
            src = e.nvme if e is not None and e.nvme is not None and e.nvme.readable else None
            if (e is None and self.shared is None) or (e is not None and src is None):
                return "failed"
            if src is not None:
                src.readers += 1
        try:
            slot = self._dram_slot(protect)
            return "failed" if slot is None else self._bring_up(key, parent, slot, src)
        finally:
            if src is not None:
                assert e is not None
                with self._lock:
                    led.unread(e, src)

    def _bring_up(self, key: bytes, parent: bytes, slot: int, src: Copy | None) -> str:
        """Fill DRAM ``slot`` with ``key``'s block from its NVMe copy ``src`` (or the shared store)."""
        assert self.dram is not None
        with self._lock:
            e, c = self._ledger.attach_filling(key, parent, slot, unless_cached=False)
        if c is None:  # another thread brought it up meanwhile
            return "present"
        ok = False
        try:
            ok = self._fetch_into(e, src, self.dram.block(slot))
        finally:
            with self._lock:
                event = self._ledger.filled(e, c, ok)
            if event is not None:
                event.set()
        return "moved" if ok else "failed"

    def _fetch_into(self, e: Entry, src: Copy | None, host: np.ndarray) -> bool:
        if src is not None:
            t0 = time.monotonic()
            ok = self._read_nvme(e, src, host)
            if ok:
                self._measured(time.monotonic() - t0)
            return ok
        assert self.shared is not None
        try:
            self.shared.read(e.key, host)
        except _IO_ERRORS as exc:
            self._failed(exc, "reading a block from the shared store")
            return False
        with self._lock:
            e.checksum = block_checksum(host)
        return True

    # -- pins, eviction, flush ------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> int:
        """Keep the longest cached prefix of ``keys`` from being evicted; returns its length.
        Every pin needs an ``unpin`` (``lease`` pairs them)."""
        with self._lock:
            return self._ledger.pin(list(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._ledger.unpin(list(keys))

    @contextmanager
    def lease(self, keys: Sequence[bytes]) -> Iterator[int]:
        """``with cache.lease(keys) as n:`` the first ``n`` blocks stay cached inside the block."""
        n = self.pin(keys)
        try:
            yield n
        finally:
            self.unpin(list(keys)[:n])

    def evict(self, keys: Sequence[bytes], tier: Tier | None = None) -> int:
        """Drop the copies of ``keys`` (in ``tier`` only, if given) that nobody pins or reads;
        returns how many copies went."""
        with self._lock:
            return self._ledger.evict(list(keys), (Tier.DRAM, Tier.NVME) if tier is None else (tier,))

    def flush(self) -> int:
        """Write every admitted DRAM block that has no NVMe copy down to NVMe (keeping it in DRAM)
        and wait for every write-down in flight; returns how many blocks it wrote."""
        self._check_open()
        led = self._ledger
        with self._lock:
            jobs = []
            if self.nvme is not None:
                for e in list(led.dir.lru[Tier.DRAM].values()):
                    if e.dram is not None and e.dram.state is State.READY and e.nvme is None and led.admitted(e):
                        job = led.start_write_down(e, evict=False)
                        if job is not None:
                            jobs.append(job)
        run_windows(jobs, self._write_down, self.config.depth)
        self.wait()
        return sum(1 for j in jobs if j.dst is not None and j.dst.state is State.READY)

    def wait(self) -> None:
        """Wait for every background write-down started so far."""
        while True:
            with self._lock:
                if not self._ledger.writes:
                    return
                req = self._ledger.writes.popleft()
            req.result()

    # -- reporting and life cycle ---------------------------------------------------------------
    @property
    def fetch_latency_s(self) -> float:
        return self._fetch_latency

    def stats(self) -> KVStats:
        with self._lock:
            tiers = []
            if self.dram is not None:
                tiers.append(TierStats(Tier.DRAM, self.dram.nslots, self.dram.used, self.dram.slot_bytes))
            if self.nvme is not None:
                tiers.append(TierStats(Tier.NVME, self.nvme.nslots, self.nvme.used, self.nvme.slot_bytes, self.nvme.direct))
            pinned, reading = self._ledger.pinned_and_reading()
            return KVStats(
                blocks=len(self._ledger.dir.entries), block_bytes=self.block_bytes, tiers=tiers,
                counters=replace(self.counters), pinned=pinned, reading=reading,
                fetch_latency_s=self._fetch_latency, shared=self.shared.url if self.shared else None,
                notes=list(self._notes))

    def check(self) -> list[str]:
        """Broken bookkeeping invariants (empty when all hold): every slot free or held by exactly
        one copy, no negative counts, nothing listed that holds nothing. Meaningful at any time;
        call it when no transfer runs to also check that nothing is left pinned or being read."""
        if not self._lock.acquire(timeout=self.config.io_timeout_s):
            return ["the cache's lock is held and was not released (a leak or a hang)"]
        try:
            return self._ledger.problems()
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("this KV cache is closed; open a new one")

    def close(self, persist: bool | None = None) -> None:
        """Finish every write-down (first writing DRAM blocks to NVMe when ``persist``, by default
        ``config.persist_on_close``) and close the tiers. Call it when no other call is running."""
        if self._closed:
            return
        try:
            if self.nvme is not None and (self.config.persist_on_close if persist is None else persist):
                self.flush()
            self.wait()
        finally:
            self._closed = True
            if self.nvme is not None:
                self.nvme.close()
            if self.shared is not None:
                self.shared.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVCache({self.layout}, dram={self.dram.nslots if self.dram else 0} blocks, " \
               f"nvme={self.nvme.nslots if self.nvme else 0} blocks, shared={self.shared.url if self.shared else None})"

    # -- failures -------------------------------------------------------------------------------
    def _failed(self, exc: BaseException, doing: str) -> None:
        """Count a failure as a miss and say so once per kind (with the first occurrence's detail)."""
        kind = ("integrity" if isinstance(exc, IntegrityError) else "disk_full" if isinstance(exc, DiskFullError)
                else "io")
        with self._lock:
            if kind == "integrity":
                self.counters.integrity_errors += 1
            elif kind == "disk_full":
                self.counters.disk_full += 1
            else:
                self.counters.io_errors += 1
        self._warn(f"{kind}:{doing}", f"{doing} failed ({exc}); counted as a miss, serving goes on "
                                      "(further failures of this kind are only counted: see stats())")

    def _warn(self, kind: str, text: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
            self._notes.append(text)
        log.warning("%s", text)


__all__ = ["KVCache"]
