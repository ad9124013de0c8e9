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

The work is split by what it moves: ``moves`` (slots and write-downs), ``prefetch`` (promotions),
``transfers`` (puts and gets), all on ``core`` (shared state and helpers); this module is the
public face.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Self

from tierio.errors import ConfigError, DiskFullError, StorageError
from tierio.io.engine import run_windows, submit
from tierio.kv.config import KVConfig
from tierio.kv.core import IO_ERRORS
from tierio.kv.entries import LOCAL_TIERS, MEMORY_TIERS, Entry, State, WriteDown
from tierio.kv.keys import BlockKey, Namespace, chain_keys, root_key
from tierio.kv.layout import BlockLayout
from tierio.kv.ledger import Ledger
from tierio.kv.prefetch import Prefetching
from tierio.kv.results import GetResult, Lookup, Pending, PrefetchResult, PutResult
from tierio.kv.rule import DecodeSLA, fetch_rule
from tierio.kv.stats import Counters, KVStats, KVTier, TierStats
from tierio.kv.tiers.device import DeviceTier, open_device_tier
from tierio.kv.tiers.dram import DramTier
from tierio.kv.tiers.shared import SharedTier
from tierio.kv.tiers.slab import SlabTier
from tierio.kv.tiers.slots import SlotPool
from tierio.kv.transfers import Transfers
from tierio.kv.views import device_bytes, host_bytes, is_device_tensor, split


class KVCache(Transfers, Prefetching):
    """A tiered KV block store for one model layout (see the module docstring).

    Not fork-safe: open it in the process that serves. Call ``close`` (or use ``with``) when done:
    it writes DRAM blocks down to NVMe (``persist_on_close``) so the next process finds them."""

    def __init__(self, layout: BlockLayout, namespace: Namespace, config: KVConfig | None = None,
                 **overrides: Any) -> None:
        """``config`` (or the defaults) with keyword ``overrides`` on top (``dram_bytes="4GiB"``)."""
        self.layout = layout
        self.namespace = namespace
        self.config = config = KVConfig.resolve(config, overrides)
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
        self._pools: dict[KVTier, SlotPool] = {t: p for t, p in ((KVTier.DEVICE, self.device), (KVTier.DRAM, self.dram))
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
                self.nvme = tier
            else:
                tier.close()
                self._warn("nvme-off", f"the NVMe tier under {c.nvme_dir} has no room for a block; serving from DRAM only")
        if c.shared_url:
            self.shared = SharedTier(c.shared_url, self.block_bytes, c.secret())
        self._ledger.open_lower(self.nvme, self.shared is not None)

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
        with self._lock:
            self.counters.lookups += 1
            self.counters.lookup_keys += len(keys)
            tiers = self._ledger.prefix_tiers(keys)
        if self.shared is not None and probe_shared:
            tiers.extend(self._probe_shared(keys[len(tiers):]))
        rule = None
        slow = [i for i, t in enumerate(tiers) if t not in MEMORY_TIERS]
        if sla is not None and slow:
            rule = fetch_rule(len(slow) / len(keys), self._fetch_latency, sla.decode_latency_s, sla.budget)
            if not rule.viable:
                tiers = tiers[:slow[0]]
        return Lookup(len(tiers), len(tiers) * self.layout.tokens, tiers, rule)

    def _probe_shared(self, keys: Sequence[bytes]) -> list[KVTier]:
        found: list[KVTier] = []
        assert self.shared is not None
        for k in keys:
            try:
                if not self.shared.exists(k):
                    break
            except IO_ERRORS as exc:
                self._failed(exc, "probing the shared store")
                break
            found.append(KVTier.SHARED)
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

    # -- prefetch -------------------------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes], deadline_s: float | None = None, *, parent: bytes | None = None,
                 into: KVTier = KVTier.DRAM) -> Pending[PrefetchResult]:
        """Bring the blocks of ``keys`` up into DRAM (``into=KVTier.DEVICE``: on up into the device
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
        lift = into is KVTier.DEVICE and self.device is not None
        return Pending(submit(partial(self._prefetch, keys, parents, until, lift)))  # always in the background

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

    def evict(self, keys: Sequence[bytes], tier: KVTier | None = None) -> int:
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
            run_windows(self._flush_jobs(KVTier.DEVICE, lambda e: e.dram is None), self._demote, self.config.depth)
        jobs = self._flush_jobs(KVTier.DRAM, lambda e: True) if self.nvme is not None else []
        run_windows(jobs, self._write_down, self.config.depth)
        self.wait()
        return sum(1 for j in jobs if j.dst is not None and j.dst.state is State.READY)

    def _flush_jobs(self, tier: KVTier, also: Callable[[Entry], bool]) -> list[WriteDown]:
        with self._lock:
            return self._ledger.flush_jobs(tier, also)

    def wait(self) -> None:
        """Wait for every background write-down started so far (the device tier's first: they
        may start DRAM's)."""
        led = self._ledger
        while True:
            with self._lock:
                req = led.next_write()
                if req is None:
                    return
            req.result()

    # -- reporting and life cycle ---------------------------------------------------------------
    @property
    def fetch_latency_s(self) -> float:
        return self._fetch_latency

    def stats(self) -> KVStats:
        with self._lock:
            tiers = [TierStats(t, p.nslots, p.used, p.slot_bytes) for t, p in self._pools.items()]
            if self.nvme is not None:
                tiers.append(TierStats(KVTier.NVME, self.nvme.nslots, self.nvme.used, self.nvme.slot_bytes, self.nvme.direct))
            pinned, reading = self._ledger.pinned_and_reading()
            return KVStats(
                blocks=len(self._ledger), block_bytes=self.block_bytes, tiers=tiers,
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


__all__ = ["KVCache"]
