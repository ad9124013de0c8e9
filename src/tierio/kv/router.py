"""The KV cache: one engine-agnostic block store over an optional pool in accelerator memory,
host DRAM, local NVMe and a shared store.

An engine hashes a prompt into block keys, asks ``lookup`` for the longest cached prefix, ``get``s
those blocks into its own memory, computes the rest, and ``put``s the new blocks. Everything that
moves bytes runs on tierio's shared I/O pool and returns a ``Pending`` handle.

Routing (see docs/kv.md):

* **put** lands in the top memory tier: the device tier when one is configured (``device_bytes``),
  else DRAM. When a memory tier's use rises above its high watermark, its least recently used
  blocks are written down in the background (device to DRAM, DRAM to NVMe) until it is back to the
  low watermark; a put that finds the tier full writes a victim down itself rather than waiting on
  a queue.
* **admission**: a block leaving DRAM is written to NVMe (and the shared store) only once it has
  been used ``admit_uses`` times, counting earlier lives in the cache, so one-off blocks do not
  wear the NVMe; others are dropped.
* **eviction** is LRU per tier and prefix-aware (``entries``): tails leave before heads.
* **get** reads each block from the fastest tier holding it (for a host destination, DRAM before
  the device tier); blocks read from NVMe or the shared store are checked against their xxh3.
  **prefetch** brings blocks up into DRAM (or on into the device tier) in chain order, so a
  resumed request uses its first blocks while later ones are still arriving (a get waits for a
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Self

import numpy as np

from tierio import events
from tierio.errors import ConfigError, DiskFullError, IntegrityError, NotFoundError, StorageError, TierioError
from tierio.io.engine import run_windows, submit
from tierio.io.files import bounce_pool
from tierio.kv.config import KVConfig
from tierio.kv.device import DeviceTier, open_device_tier
from tierio.kv.dram import DramTier
from tierio.kv.entries import LOCAL_TIERS, MEMORY_TIERS, Copy, Entry, State
from tierio.kv.ledger import Ledger, WriteDown
from tierio.kv.keys import BlockKey, Namespace, chain_keys, root_key
from tierio.kv.layout import BlockLayout
from tierio.kv.results import GetResult, Lookup, Pending, PrefetchResult, PutResult
from tierio.kv.rule import DecodeSLA, fetch_rule
from tierio.kv.shared import SharedTier, UnauthenticatedBlockError, block_checksum
from tierio.kv.slab import SlabTier
from tierio.kv.slabindex import SlotRecord
from tierio.kv.slots import SlotPool
from tierio.kv.stats import Counters, KVStats, Tier, TierStats
from tierio.kv.views import copy_in, copy_out, device_bytes, host_bytes, is_device_tensor, split

log = logging.getLogger("tierio.kv")

_IO_ERRORS = (TierioError, OSError)
_COPY_ERRORS = (*_IO_ERRORS, RuntimeError)  # a failed copy to or from accelerator memory raises RuntimeError
HOST_ORDER = (Tier.DRAM, Tier.DEVICE, Tier.NVME)  # a host destination reads DRAM before device memory
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
        for tier, wanted in (("NVMe", config.nvme_bytes), ("device", DeviceTier.slots_for(config.device_bytes,
                                                                                          self.block_bytes))):
            if wanted and dram_slots < 2:
                raise ConfigError(f"KV cache: the {tier} tier moves blocks through DRAM slots; give dram_bytes room "
                                  f"for at least 2 blocks of {self.block_bytes} bytes")
        self.device, off = open_device_tier(config, self.block_bytes)
        self.dram = DramTier(dram_slots, self.block_bytes) if dram_slots else None
        self.nvme: SlabTier | None = None
        self.shared: SharedTier | None = None
        self._pools: dict[Tier, SlotPool] = {t: p for t, p in ((Tier.DEVICE, self.device), (Tier.DRAM, self.dram))
                                             if p is not None}
        self._ledger = Ledger(config, self._pools, self.counters)
        self._lock = self._ledger.lock
        if off is not None:
            self._warn("device-off", off)
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
            self.shared = SharedTier(c.shared_url, self.block_bytes, c.secret())
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
        slow = [i for i, t in enumerate(tiers) if t not in MEMORY_TIERS]
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
        sources = [device_bytes(s, self.block_bytes, f"put: block {i}") if is_device_tensor(s)
                   else host_bytes(s, self.block_bytes, f"put: block {i}", writable=False)
                   for i, s in enumerate(split(blocks, len(keys), self.block_bytes, "put: blocks"))]
        parents = [parent or self.root, *keys[:-1]]
        after = self.device.caller_mark(sources) if self.device is not None else None
        return Pending.run(partial(self._put, keys, parents, sources, after), self._inline(len(keys)))

    def _inline(self, blocks: int) -> bool:
        """Transfers this small run on the calling thread: a hand-off to the pool costs more."""
        return blocks * self.block_bytes <= INLINE_BYTES

    def _put(self, keys: list[bytes], parents: list[bytes], sources: list[Any], after: Any) -> PutResult:
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
            # A put longer than a tier may send its own first blocks down a tier, never drop them.
            place = self._put_slot(protect)
            if place is None:  # the rest of the chain would be unreachable without this block
                dropped = len(keys) - i
                with self._lock:
                    self.counters.put_dropped += dropped
                return self._put_done(chain, stored, cached, dropped)
            tier, slot = place
            e, filled = self._fill_slot(tier, key, parents[i], slot, partial(self._copy_source, sources[i], after),
                                        unless_cached=True, use=True)
            if filled is False:  # the copy failed (counted): the block and the rest of its chain are not stored
                dropped = len(keys) - i
                with self._lock:
                    self.counters.put_dropped += dropped
                return self._put_done(chain, stored, cached, dropped)
            stored += filled is True
            cached += filled is None
            chain.append(e)
            with self._lock:  # keep write-downs flowing while a long put fills memory
                self._write_down_excess()
        return self._put_done(chain, stored, cached, 0)

    def _put_slot(self, protect: frozenset[bytes]) -> tuple[Tier, int] | None:
        """Where a put's next block goes: a slot of the device tier when there is one and a slot can
        be had there, else of DRAM."""
        for tier in self._pools:
            slot = self._slot(tier, protect, strict=False)
            if slot is not None:
                return tier, slot
        return None

    def _copy_source(self, source: Any, after: Any, e: Entry, block: Any) -> bool:
        """A put's fill: the caller's block into a slot (device-to-device where both are on the device).
        A copy into the device tier that fails (an accelerator error) is counted and returns False."""
        if isinstance(block, np.ndarray):
            copy_in(block, source, "put: block")
            return True
        assert self.device is not None
        try:
            with self.device.copying(after):
                copy_in(block, source, "put: block")
            return True
        except RuntimeError as exc:  # the buffers were checked when the put was made: this is the device
            self._failed(exc, "copying a block into the device tier")
            return False

    def _fill_slot(self, tier: Tier, key: bytes, parent: bytes, slot: int, fill: Callable[[Entry, Any], bool], *,
                   unless_cached: bool, use: bool = False) -> tuple[Entry, bool | None]:
        """Attach ``slot`` of memory tier ``tier`` to ``key``'s block as a FILLING copy and run
        ``fill(entry, block bytes)`` into it; the copy becomes readable if it returns True and is
        dropped otherwise (or if it raises). Returns the entry and whether the fill succeeded, or
        None when another thread got there first (the slot went back; see ``attach_filling``)."""
        with self._lock:
            e, c = self._ledger.attach_filling(tier, key, parent, slot, unless_cached=unless_cached, use=use)
        if c is None:
            return e, None
        ok = False
        try:
            ok = fill(e, self._pools[tier].block(slot))
        finally:
            with self._lock:
                event = self._ledger.filled(e, c, ok)
            if event is not None:
                event.set()
        return e, ok

    def _put_done(self, chain: list[Entry], stored: int, cached: int, dropped: int) -> PutResult:
        with self._lock:
            self._ledger.dir.touch(chain)
            self.counters.stored += stored
            self.counters.already_cached += cached
            self._write_down_excess()
        return PutResult(stored, cached, dropped)

    # -- memory slots and write-downs -----------------------------------------------------------
    def _slot(self, tier: Tier, protect: frozenset[bytes], *, strict: bool = True) -> int | None:
        """A free slot of memory tier ``tier``, made by evicting if need be. Evicting runs the
        victim's write-down on this thread, or a queued one, or waits (bounded) for one running
        elsewhere: never for a request still in a queue. None when every slot is pinned, read or
        filling. (A device write-down needs a DRAM slot, a DRAM one never a device slot: the
        waits cannot go round in a circle.)"""
        led = self._ledger
        deadline = time.monotonic() + self.config.io_timeout_s
        while True:
            job = req = None
            with led.space:
                slot = led.take_slot(tier)
                if slot is not None:
                    return slot
                if led.writes[tier]:  # finishing (or running) a write-down already begun frees a slot too
                    req = led.writes[tier].popleft()
                elif (victim := led.dir.victim(tier, led.loses(tier), protect, strict=strict)) is not None:
                    job = led.start_write_down(victim, tier, evict=True)
                elif not led.leaving[tier]:
                    return None
                elif time.monotonic() > deadline:
                    self.counters.timeouts += 1
                    return None
                else:  # every LEAVING copy's write is running somewhere: wait for one to free its slot
                    led.space.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                    continue
            if job is not None:
                self._run_write_down(job)
            elif req is not None:
                req.result()  # write-downs count their own I/O failures; anything else is a bug and surfaces

    def _write_down_excess(self) -> None:
        """Under the lock: start the write-downs the watermarks ask for, each queued in the same
        lock hold that marks its copy LEAVING (see ``Ledger.excess_write_downs``)."""
        for job in self._ledger.excess_write_downs():
            self._ledger.writes[job.src.tier].append(submit(partial(self._run_write_down, job)))

    def _run_write_down(self, job: WriteDown) -> None:
        if job.src.tier is Tier.DEVICE:
            self._demote(job)
        else:
            self._write_down(job)

    def _demote(self, job: WriteDown) -> None:
        """Copy a device block down into a DRAM slot (made by evicting there if need be). With no
        DRAM slot to be had, an evicted device copy is dropped (the block may live on below)."""
        assert self.device is not None and self.dram is not None
        e, src, ok, error = job.entry, job.src, False, None
        try:
            slot = self._slot(Tier.DRAM, frozenset())
            if slot is not None:
                with self._lock:
                    _, job.dst = self._ledger.attach_filling(Tier.DRAM, e.key, e.parent, slot, unless_cached=False)
                if job.dst is not None:
                    with self.device.copying():
                        copy_out(self.dram.block(slot), self.device.block(src.slot), "device write-down")
                ok = True
        except _COPY_ERRORS as exc:
            error = exc
        finally:
            with self._lock:
                event = self._ledger.finish_write_down(job, ok, None, self.block_bytes)
                self._write_down_excess()  # DRAM may be past its own watermark now
            if event is not None:
                event.set()
        if error is not None:
            self._failed(error, "writing a device block down to DRAM")

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
            dests = [device_bytes(d, self.block_bytes, f"get: out block {i}") if is_device_tensor(d)
                     else host_bytes(d, self.block_bytes, f"get: out block {i}", writable=True)
                     for i, d in enumerate(split(out, len(keys), self.block_bytes, "get: out"))]
        after = self.device.caller_mark(dests) if self.device is not None else None
        return Pending.run(partial(self._get, keys, dests, flat, after), self._inline(len(keys)))

    def _get(self, keys: list[bytes], dests: list[Any], flat: np.ndarray | None, after: Any) -> GetResult:
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
            got = self._serve(keys[i], dests[i], after)
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
            c.served_device += tiers.count(Tier.DEVICE)
            c.served_dram += tiers.count(Tier.DRAM)
            c.served_nvme += tiers.count(Tier.NVME)
            c.served_shared += tiers.count(Tier.SHARED)
        events.emit(events.KvGet(len(keys), tiers.count(Tier.DRAM), tiers.count(Tier.NVME), tiers.count(Tier.SHARED),
                                 tiers.count(Tier.DEVICE)))
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

    def _acquire(self, key: bytes, order: tuple[Tier, ...]) -> tuple[Entry | None, Copy | None]:
        """``key``'s entry and a reader on its first readable copy in ``order``, waiting (bounded)
        while one is being filled; no copy when there is none to read (or the wait timed out)."""
        deadline = time.monotonic() + self.config.io_timeout_s
        while True:
            with self._lock:
                e, c, wait = self._ledger.reader(key, order)
            if c is not None or wait is None:
                return e, c
            if not wait.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    self.counters.timeouts += 1
                return e, None

    def _serve(self, key: bytes, dest: Any, after: Any) -> Tier | None:
        """Deliver one block into ``dest``; the tier it came from, or None (a miss, counted)."""
        e, c = self._acquire(key, LOCAL_TIERS if is_device_tensor(dest) else HOST_ORDER)
        if e is None:
            return self._serve_shared(key, dest) if self.shared is not None else None
        if c is None:
            return None
        try:
            return self._read_copy(e, c, dest, after)
        finally:
            with self._lock:
                self._ledger.unread(e, c)

    def _read_copy(self, e: Entry, c: Copy, dest: Any, after: Any) -> Tier | None:
        if c.tier is Tier.DRAM:
            assert self.dram is not None
            copy_out(dest, self.dram.block(c.slot), "get: out")
            return Tier.DRAM
        if c.tier is Tier.DEVICE:
            assert self.device is not None
            try:
                with self.device.copying(after):
                    copy_out(dest, self.device.block(c.slot), "get: out")
            except RuntimeError as exc:  # an accelerator error: a miss, the copy stays (the fault may be the destination's)
                self._failed(exc, "copying a block out of the device tier")
                return None
            return Tier.DEVICE
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
    def prefetch(self, keys: Sequence[bytes], deadline_s: float | None = None, *, parent: bytes | None = None,
                 into: Tier = Tier.DRAM) -> Pending[PrefetchResult]:
        """Bring the blocks of ``keys`` up into DRAM (``into=Tier.DEVICE``: on up into the device
        tier, through DRAM) in the background, in chain order. Without a device tier, ``into=DEVICE``
        brings them into DRAM: an engine's code need not know whether this machine has one.
        Blocks that cannot start within ``deadline_s`` seconds are skipped. ``parent`` as for
        ``put`` (used for blocks that come from the shared store)."""
        self._check_open()
        if into not in MEMORY_TIERS:
            raise ConfigError(f"prefetch: blocks are brought up into DRAM or the device tier, not {into!r}")
        keys = list(keys)
        until = None if deadline_s is None else time.monotonic() + deadline_s
        parents = [parent or self.root, *keys[:-1]]
        lift = into is Tier.DEVICE and self.device is not None
        return Pending(submit(partial(self._prefetch, keys, parents, until, lift)))  # always in the background

    def _prefetch(self, keys: list[bytes], parents: list[bytes], until: float | None, lift: bool) -> PrefetchResult:
        if self.dram is None:
            return PrefetchResult(0, 0, 0, len(keys))
        protect = frozenset(keys)
        step = self._lift if lift else self._promote
        outcomes = run_windows(range(len(keys)), lambda i: step(keys[i], parents[i], protect, until), self._depth())
        result = PrefetchResult(outcomes.count("moved"), outcomes.count("present"), outcomes.count("late"),
                                outcomes.count("failed"))
        with self._lock:
            self.counters.prefetched += result.moved
            self.counters.prefetch_late += result.late
            self._write_down_excess()
        return result

    def _promote(self, key: bytes, parent: bytes, protect: frozenset[bytes], until: float | None) -> str:
        """Bring ``key``'s block up into DRAM from NVMe or the shared store ("present" when it is
        in a memory tier already)."""
        if until is not None and time.monotonic() > until:
            return "late"
        led = self._ledger
        with self._lock:
            e = led.dir.entries.get(key)
            if e is not None and (e.dram is not None or e.device is not None):
                return "present"
            src = e.nvme if e is not None and e.nvme is not None and e.nvme.readable else None
            if (e is None and self.shared is None) or (e is not None and src is None):
                return "failed"
            if src is not None:
                src.readers += 1
        try:
            slot = self._slot(Tier.DRAM, protect)
            if slot is None:
                return "failed"
            _, ok = self._fill_slot(Tier.DRAM, key, parent, slot, partial(self._fetch_into, src), unless_cached=False)
            return "present" if ok is None else "moved" if ok else "failed"
        finally:
            if src is not None:
                assert e is not None
                with self._lock:
                    led.unread(e, src)

    def _lift(self, key: bytes, parent: bytes, protect: frozenset[bytes], until: float | None) -> str:
        """Bring ``key``'s block up into the device tier from its DRAM copy, first bringing it up
        into DRAM from NVMe or the shared store if it is not there."""
        assert self.device is not None and self.dram is not None
        if until is not None and time.monotonic() > until:
            return "late"
        with self._lock:
            e = self._ledger.dir.entries.get(key)
            if e is not None and e.device is not None:
                return "present"
            in_dram = e is not None and e.dram is not None
        if not in_dram and (step := self._promote(key, parent, protect, until)) not in ("moved", "present"):
            return step
        e, src = self._acquire(key, (Tier.DRAM,))
        if e is None or src is None:
            return "present" if e is not None and e.device is not None else "failed"
        try:
            slot = self._slot(Tier.DEVICE, protect)
            if slot is None:
                return "failed"
            _, ok = self._fill_slot(Tier.DEVICE, key, parent, slot, partial(self._copy_up, src), unless_cached=False)
            return "present" if ok is None else "moved" if ok else "failed"
        finally:
            with self._lock:
                self._ledger.unread(e, src)

    def _copy_up(self, src: Copy, e: Entry, block: Any) -> bool:
        """A lift's fill: a DRAM copy (held for reading) into a device slot."""
        assert self.device is not None and self.dram is not None
        try:
            with self.device.copying():
                copy_in(block, self.dram.block(src.slot), "prefetch: device slot")
            return True
        except _COPY_ERRORS as exc:
            self._failed(exc, "copying a block up into the device tier")
            return False

    def _fetch_into(self, src: Copy | None, e: Entry, host: np.ndarray) -> bool:
        """A promotion's fill: ``e``'s NVMe copy ``src`` (held for reading), checked, or the shared
        store's copy, into a DRAM slot."""
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
            return self._ledger.evict(list(keys), LOCAL_TIERS if tier is None else (tier,))

    def flush(self) -> int:
        """Write every admitted DRAM block that has no NVMe copy down to NVMe (keeping it in DRAM)
        and wait for every write-down in flight; returns how many blocks it wrote. Admitted blocks
        held only in the device tier are first copied down into DRAM (keeping them on the device)."""
        self._check_open()
        if self.device is not None and self.nvme is not None:
            run_windows(self._flush_jobs(Tier.DEVICE, lambda e: e.dram is None), self._demote, self.config.depth)
        jobs = self._flush_jobs(Tier.DRAM, lambda e: True) if self.nvme is not None else []
        run_windows(jobs, self._write_down, self.config.depth)
        self.wait()
        return sum(1 for j in jobs if j.dst is not None and j.dst.state is State.READY)

    def _flush_jobs(self, tier: Tier, also: Callable[[Entry], bool]) -> list[WriteDown]:
        """Write-downs (keeping the copy) of the admitted blocks of ``tier`` that have no NVMe copy."""
        led = self._ledger
        jobs = []
        with self._lock:
            for e in list(led.dir.lru[tier].values()):
                c = e.copy(tier)
                if c is not None and c.state is State.READY and e.nvme is None and led.admitted(e) and also(e):
                    job = led.start_write_down(e, tier, evict=False)
                    if job is not None:
                        jobs.append(job)
        return jobs

    def wait(self) -> None:
        """Wait for every background write-down started so far (the device tier's first: they
        may start DRAM's)."""
        led = self._ledger
        while True:
            with self._lock:
                queue = next((led.writes[t] for t in MEMORY_TIERS if led.writes[t]), None)
                if queue is None:
                    return
                req = queue.popleft()
            req.result()

    # -- reporting and life cycle ---------------------------------------------------------------
    @property
    def fetch_latency_s(self) -> float:
        return self._fetch_latency

    def stats(self) -> KVStats:
        with self._lock:
            tiers = [TierStats(t, p.nslots, p.used, p.slot_bytes) for t, p in self._pools.items()]
            if self.nvme is not None:
                tiers.append(TierStats(Tier.NVME, self.nvme.nslots, self.nvme.used, self.nvme.slot_bytes, self.nvme.direct))
            pinned, reading = self._ledger.pinned_and_reading()
            return KVStats(
                blocks=len(self._ledger.dir.entries), block_bytes=self.block_bytes, tiers=tiers,
                counters=replace(self.counters), pinned=pinned, reading=reading,
                fetch_latency_s=self._fetch_latency, shared=self.shared.url if self.shared else None,
                device=self.device.name if self.device else None, notes=list(self._notes))

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
        """Finish every write-down (first writing DRAM and device blocks to NVMe when ``persist``,
        by default ``config.persist_on_close``) and close the tiers, giving the device tier's memory
        back. Call it when no other call is running."""
        if self._closed:
            return
        try:
            if self.nvme is not None and (self.config.persist_on_close if persist is None else persist):
                self.flush()
            self.wait()
        finally:
            self._closed = True
            if self.device is not None:
                self.device.close()
            if self.nvme is not None:
                self.nvme.close()
            if self.shared is not None:
                self.shared.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVCache({self.layout}, device={self.device.nslots if self.device else 0} blocks, " \
               f"dram={self.dram.nslots if self.dram else 0} blocks, " \
               f"nvme={self.nvme.nslots if self.nvme else 0} blocks, shared={self.shared.url if self.shared else None})"

    # -- failures -------------------------------------------------------------------------------
    def _failed(self, exc: BaseException, doing: str) -> None:
        """Count a failure as a miss and say so once per kind (with the first occurrence's detail)."""
        kind = ("unauthenticated" if isinstance(exc, UnauthenticatedBlockError) else "integrity"
                if isinstance(exc, IntegrityError) else "disk_full" if isinstance(exc, DiskFullError) else "io")
        with self._lock:
            if kind == "unauthenticated":
                self.counters.unauthenticated += 1
            elif kind == "integrity":
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
