"""Filling tier 0 behind a restore that read from an object store.

A process that restores from an S3 tier (a new node, or a node whose local disk was lost) would
read S3 again on every restart. Streaming the restore itself into memory is the faster way for
that restore: landing the files on the local disk first and reading them back costs a disk write
and a read on top of the same download. So the restore streams into memory, and afterwards the
step is copied from S3 into tier 0 when tier 0 is a local directory that lacks it, on the
promotion thread (the caller does not wait): the same verified copy as a promotion, manifest last,
so a restart restores at the local disk's speed, from copy-on-write maps of the files.

Only a single-process job fills: with several ranks every rank would copy every file of the
step, and a node-local tier 0 holds only its node's ranks' files, which promotion writes
already.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tierio.errors import TierioError
from tierio.storage.local import LocalStore

from tierio.ckpt.promotion.copy import CopyStats, copy_step
from tierio.ckpt.tier import TierState

log = logging.getLogger("tierio.ckpt")


@dataclass(frozen=True)
class Fill:
    """Copy ``step`` from ``src`` (the object store it was restored from) into ``dst`` (tier 0)."""

    step: int
    src: TierState
    dst: TierState

    def run(self) -> CopyStats | None:
        """The copy; a failure (a full disk, an outage) is logged, never raised: tier 0 is a cache here."""
        try:
            return copy_step(self.src.store, self.dst.store, self.step)
        except TierioError as exc:
            log.warning("could not copy step %d from %s into %s for the next restore (%s); restores keep reading %s",
                        self.step, self.src.url, self.dst.url, exc, self.src.url)
            return None


def fill_after_restore(tiers: Sequence[TierState], step: int, read_from: str, world_size: int) -> Fill | None:
    """The copy to make after restoring ``step`` with its files from the tier at ``read_from``, or
    None: the files came from a local directory, tier 0 is not one, or is node-local, or the job
    has several ranks."""
    dst = tiers[0]
    src = next((ts for ts in tiers if ts.url == read_from), None)
    if (world_size != 1 or src is None or src is dst or dst.node_local or isinstance(src.store, LocalStore)
            or not isinstance(dst.store, LocalStore)):
        return None
    return Fill(step, src, dst)
