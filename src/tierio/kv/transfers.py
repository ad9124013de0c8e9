"""The bytes of puts and gets: a put copies the caller's blocks into memory-tier slots, a get
serves each block from the fastest tier holding it (DRAM runs copied in large pieces), checking
what comes from NVMe or the shared store; the first miss ends the usable prefix."""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import numpy as np

from tierio import events
from tierio.errors import NotFoundError
from tierio.io.engine import run_windows
from tierio.kv.core import IO_ERRORS
from tierio.kv.entries import LOCAL_TIERS, Copy, Entry
from tierio.kv.moves import Moves
from tierio.kv.results import GetResult, PutResult
from tierio.kv.stats import KVTier
from tierio.kv.views import copy_in, copy_out, is_device_tensor

HOST_ORDER = (KVTier.DRAM, KVTier.DEVICE, KVTier.NVME)  # a host destination reads DRAM before device memory
COPY_CHUNK = 256 << 20    # DRAM gets copy runs of adjacent slots in pieces of this size


class Transfers(Moves):
    """The work of ``KVCache.put`` and ``KVCache.get`` (run on the pool or inline)."""

    def _put(self, keys: list[bytes], parents: list[bytes], sources: list[Any], after: Any) -> PutResult:
        stored = cached = 0
        chain: list[Entry] = []
        led = self._ledger
        protect = frozenset(keys)
        for i, key in enumerate(keys):
            with self._lock:
                e = led.use_cached(key)
            if e is not None:
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

    def _put_slot(self, protect: frozenset[bytes]) -> tuple[KVTier, int] | None:
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

    def _put_done(self, chain: list[Entry], stored: int, cached: int, dropped: int) -> PutResult:
        with self._lock:
            self._ledger.touch(chain)
            self.counters.stored += stored
            self.counters.already_cached += cached
            self._write_down_excess()
        return PutResult(stored, cached, dropped)

    def _get(self, keys: list[bytes], dests: list[Any], flat: np.ndarray | None, after: Any) -> GetResult:
        led = self._ledger
        with self._lock:
            chain = led.use_chain(keys)
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

        def one(i: int) -> KVTier | None:
            if i in held:
                return KVTier.DRAM
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
            c.served_device += tiers.count(KVTier.DEVICE)
            c.served_dram += tiers.count(KVTier.DRAM)
            c.served_nvme += tiers.count(KVTier.NVME)
            c.served_shared += tiers.count(KVTier.SHARED)
        events.emit(events.KvGet(len(keys), tiers.count(KVTier.DRAM), tiers.count(KVTier.NVME), tiers.count(KVTier.SHARED),
                                 tiers.count(KVTier.DEVICE)))
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

    def _serve(self, key: bytes, dest: Any, after: Any) -> KVTier | None:
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

    def _read_copy(self, e: Entry, c: Copy, dest: Any, after: Any) -> KVTier | None:
        if c.tier is KVTier.DRAM:
            assert self.dram is not None
            copy_out(dest, self.dram.block(c.slot), "get: out")
            return KVTier.DRAM
        if c.tier is KVTier.DEVICE:
            assert self.device is not None
            try:
                with self.device.copying(after):
                    copy_out(dest, self.device.block(c.slot), "get: out")
            except RuntimeError as exc:  # an accelerator error: a miss, the copy stays (the fault may be the destination's)
                self._failed(exc, "copying a block out of the device tier")
                return None
            return KVTier.DEVICE
        with self._host_target(dest) as host:
            t0 = time.monotonic()
            if self._read_nvme(e, c, host):
                self._measured(time.monotonic() - t0)
                return KVTier.NVME
        return None

    def _serve_shared(self, key: bytes, dest: Any) -> KVTier | None:
        assert self.shared is not None
        with self._host_target(dest) as host:
            try:
                self.shared.read(key, host)
                return KVTier.SHARED
            except NotFoundError:
                return None  # not there (any more): a plain miss
            except IO_ERRORS as exc:
                self._failed(exc, "reading a block from the shared store")
                return None



__all__ = ["Transfers"]
