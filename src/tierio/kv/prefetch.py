"""Moving blocks up: a prefetch brings blocks into DRAM from NVMe or the shared store
(promotion), or on into the device tier from DRAM (a lift), in chain order, each with a ``Move``
outcome."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np

from tierio.io.engine import run_windows
from tierio.kv.core import COPY_ERRORS, IO_ERRORS
from tierio.kv.entries import Copy, Entry
from tierio.kv.moves import Moves
from tierio.kv.results import Move, PrefetchResult
from tierio.kv.stats import KVTier
from tierio.kv.tiers.shared import block_checksum
from tierio.kv.views import copy_in


class Prefetching(Moves):
    """Promotions and lifts of a cache (``KVCache.prefetch`` runs ``_prefetch`` in the background)."""

    def _prefetch(self, keys: list[bytes], parents: list[bytes], until: float | None, lift: bool) -> PrefetchResult:
        if self.dram is None:
            return PrefetchResult(0, 0, 0, len(keys))
        protect = frozenset(keys)
        step = self._lift if lift else self._promote
        outcomes = run_windows(range(len(keys)), lambda i: step(keys[i], parents[i], protect, until), self._depth())
        result = PrefetchResult.of(outcomes)
        with self._lock:
            self.counters.prefetched += result.moved
            self.counters.prefetch_late += result.late
            self._write_down_excess()
        return result

    def _promote(self, key: bytes, parent: bytes, protect: frozenset[bytes], until: float | None) -> Move:
        """Bring ``key``'s block up into DRAM from NVMe or the shared store (PRESENT when it is
        in a memory tier already)."""
        if until is not None and time.monotonic() > until:
            return Move.LATE
        led = self._ledger
        with self._lock:
            outcome, e, src = led.promotion_source(key)
        if outcome is not None:
            return outcome
        try:
            slot = self._slot(KVTier.DRAM, protect)
            if slot is None:
                return Move.FAILED
            _, ok = self._fill_slot(KVTier.DRAM, key, parent, slot, partial(self._fetch_into, src), unless_cached=False)
            return Move.PRESENT if ok is None else Move.MOVED if ok else Move.FAILED
        finally:
            if src is not None:
                assert e is not None
                with self._lock:
                    led.unread(e, src)

    def _lift(self, key: bytes, parent: bytes, protect: frozenset[bytes], until: float | None) -> Move:
        """Bring ``key``'s block up into the device tier from its DRAM copy, first bringing it up
        into DRAM from NVMe or the shared store if it is not there."""
        assert self.device is not None and self.dram is not None
        if until is not None and time.monotonic() > until:
            return Move.LATE
        with self._lock:
            on_device, in_dram = self._ledger.in_memory(key)
        if on_device:
            return Move.PRESENT
        if not in_dram and (step := self._promote(key, parent, protect, until)) not in (Move.MOVED, Move.PRESENT):
            return step
        e, src = self._acquire(key, (KVTier.DRAM,))
        if e is None or src is None:
            return Move.PRESENT if e is not None and e.device is not None else Move.FAILED
        try:
            slot = self._slot(KVTier.DEVICE, protect)
            if slot is None:
                return Move.FAILED
            _, ok = self._fill_slot(KVTier.DEVICE, key, parent, slot, partial(self._copy_up, src), unless_cached=False)
            return Move.PRESENT if ok is None else Move.MOVED if ok else Move.FAILED
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
        except COPY_ERRORS as exc:
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
        except IO_ERRORS as exc:
            self._failed(exc, "reading a block from the shared store")
            return False
        with self._lock:
            self._ledger.set_checksum(e, block_checksum(host))
        return True



__all__ = ["Prefetching"]
