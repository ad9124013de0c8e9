"""Moving blocks down: making room in a memory tier (evicting, running or waiting for a
write-down), filling a slot, and the write-downs themselves (device into DRAM, DRAM to NVMe and
the shared store). Every change of bookkeeping is a ``Ledger`` call under its lock; the bytes
move outside it."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from tierio.io.engine import submit
from tierio.kv.core import COPY_ERRORS, IO_ERRORS, CacheCore
from tierio.kv.entries import Entry, WriteDown
from tierio.kv.stats import KVTier
from tierio.kv.tiers.shared import block_checksum
from tierio.kv.tiers.slabindex import SlotRecord
from tierio.kv.views import copy_out


class Moves(CacheCore):
    """Slots, fills and write-downs of a cache."""

    def _fill_slot(self, tier: KVTier, key: bytes, parent: bytes, slot: int, fill: Callable[[Entry, Any], bool], *,
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

    # -- memory slots and write-downs -----------------------------------------------------------
    def _slot(self, tier: KVTier, protect: frozenset[bytes], *, strict: bool = True) -> int | None:
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
                req = led.next_write((tier,))  # finishing (or running) a write-down already begun frees a slot too
                if req is None:
                    found, job = led.evict_one(tier, protect, strict=strict)
                    if not found:
                        if not led.leaving[tier]:
                            return None
                        if time.monotonic() > deadline:
                            self.counters.timeouts += 1
                            return None
                        # every LEAVING copy's write is running somewhere: wait for one to free its slot
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
            self._ledger.queue_write(job, submit(partial(self._run_write_down, job)))

    def _run_write_down(self, job: WriteDown) -> None:
        if job.src.tier is KVTier.DEVICE:
            self._demote(job)
        else:
            self._write_down(job)

    def _demote(self, job: WriteDown) -> None:
        """Copy a device block down into a DRAM slot (made by evicting there if need be). With no
        DRAM slot to be had, an evicted device copy is dropped (the block may live on below)."""
        assert self.device is not None and self.dram is not None
        src, ok, error = job.src, False, None
        try:
            slot = self._slot(KVTier.DRAM, frozenset())
            if slot is not None:
                with self._lock:
                    attached = self._ledger.attach_demotion(job, slot)
                if attached:
                    with self.device.copying():
                        copy_out(self.dram.block(slot), self.device.block(src.slot), "device write-down")
                ok = True
        except COPY_ERRORS as exc:
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
        except IO_ERRORS as exc:
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
        except IO_ERRORS as exc:  # the shared copy is optional: the local one stands
            self._failed(exc, "uploading a block to the shared store")



__all__ = ["Moves"]
