"""A tier as a restore reads it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierio.storage.base import Store

from tierio.ckpt.tier import TierState


@dataclass(frozen=True)
class Source:
    """A tier a restore may read files from. A node-local tier holds only its node's ranks' files,
    so a file missing there is expected, not a bad copy."""

    store: Store
    node_local: bool = False


def read_order(tiers: Sequence[TierState], first: str | None = None) -> list[Source]:
    """The tiers a restore reads files from: the node's local tiers, then the shared tier ``first``
    (a url: the one whose manifest is used), then the other shared tiers, fastest first."""
    shared = [t for t in tiers if not t.node_local]
    shared.sort(key=lambda t: t.url != first)  # stable: otherwise fastest first
    return [Source(t.store, True) for t in tiers if t.node_local] + [Source(t.store) for t in shared]
