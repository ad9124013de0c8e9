"""What every part of a KV cache shares: its tiers, its ledger and counters, and the helpers
each transfer uses (reading and checking an NVMe copy, waiting for a copy being filled, staging
for accelerator memory, counting a failure as a miss). ``cache.KVCache`` opens the tiers; the
transfers (``moves``, ``prefetch``, ``transfers``) build on this."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tierio.errors import DiskFullError, IntegrityError, StorageError, TierioError
from tierio.io.files import bounce_pool
from tierio.kv.config import KVConfig
from tierio.kv.entries import Copy, Entry
from tierio.kv.layout import BlockLayout
from tierio.kv.ledger import Ledger
from tierio.kv.stats import Counters, KVTier
from tierio.kv.tiers.device import DeviceTier
from tierio.kv.tiers.dram import DramTier
from tierio.kv.tiers.shared import SharedTier, UnauthenticatedBlockError, block_checksum
from tierio.kv.tiers.slab import SlabTier
from tierio.kv.tiers.slots import SlotPool
from tierio.kv.views import copy_out, host_bytes, is_device_tensor

log = logging.getLogger("tierio.kv")

IO_ERRORS = (TierioError, OSError)
COPY_ERRORS = (*IO_ERRORS, RuntimeError)  # a failed copy to or from accelerator memory raises RuntimeError
INLINE_BYTES = 256 << 10  # puts and gets moving at most this much run on the caller's thread


class CacheCore:
    """The state of one cache and the helpers its transfers share (``KVCache`` sets it up)."""

    layout: BlockLayout
    config: KVConfig
    block_bytes: int
    counters: Counters
    device: DeviceTier | None
    dram: DramTier | None
    nvme: SlabTier | None
    shared: SharedTier | None
    _pools: dict[KVTier, SlotPool]
    _ledger: Ledger
    _lock: threading.Lock
    _fetch_latency: float
    _closed: bool
    _warned: set[str]
    _notes: list[str]

    def _inline(self, blocks: int) -> bool:
        """Transfers this small run on the calling thread: a hand-off to the pool costs more."""
        return blocks * self.block_bytes <= INLINE_BYTES

    def _depth(self) -> int:
        """Blocks in flight: ``depth`` pieces' worth (a block reads in pieces of ``piece_bytes``),
        so large blocks keep the same bytes in flight as fio's queue depth and small ones more blocks."""
        return max(2, min(64, self.config.depth * self.config.piece_bytes // max(1, self.block_bytes)))

    def _acquire(self, key: bytes, order: tuple[KVTier, ...]) -> tuple[Entry | None, Copy | None]:
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

    def _read_nvme(self, e: Entry, c: Copy, host: np.ndarray) -> bool:
        """Read ``e``'s NVMe copy into ``host`` and check it; a failure loses the copy (counted)."""
        assert self.nvme is not None
        try:
            self.nvme.read(c.slot, host)
            if block_checksum(host) != e.checksum:
                raise IntegrityError(f"block {e.key.hex()} in NVMe slot {c.slot} under {self.nvme.directory} "
                                     "does not match its checksum")
            return True
        except IO_ERRORS as exc:
            self._lose(e, c, exc)
            return False

    def _lose(self, e: Entry, c: Copy, exc: BaseException) -> None:
        """A copy failed a read or a check: nobody gets it again (the record goes too)."""
        with self._lock:
            self._ledger.mark_failed(e, c)
        if c.tier is KVTier.NVME and self.nvme is not None and isinstance(exc, IntegrityError):
            try:
                self.nvme.clear(c.slot)  # the slot is ours until our reader count drops
            except IO_ERRORS:
                pass
        self._failed(exc, "reading a block")

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

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("this KV cache is closed; open a new one")

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



__all__ = ["COPY_ERRORS", "IO_ERRORS", "CacheCore"]
