"""Tiers: a store plus its retention policy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierio.errors import ConfigError
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store
from tierio.storage.url import open_store

from tierio.ckpt.steps.retention import Retention


SCOPES = ("shared", "node")


@dataclass
class Tier:
    """One checkpoint tier: a URL (or an open Store) and what it keeps (None: everything).

    ``scope="node"``: the location is local to each node (its own NVMe), so each node sees only
    its own ranks' files there; a step is committed globally on the first shared tier after it."""

    url: str | Path | Store
    retention: Retention | None = None
    scope: str = "shared"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ConfigError(f"tier scope {self.scope!r} must be one of {', '.join(SCOPES)}")

    @property
    def node_local(self) -> bool:
        return self.scope == "node"


def as_tier(x: str | Path | Tier | Store) -> Tier:
    if isinstance(x, Tier):
        return x
    if isinstance(x, (str, Path)) or isinstance(x, Store):
        return Tier(x)
    raise ConfigError(f"cannot use {x!r} as a checkpoint tier: pass a path, a file:// or s3:// URL, a Store or a Tier")


def open_tier_store(tier: Tier, limiter: TokenBucket | None = None) -> Store:
    """Open the tier's store; slower tiers get the promotion bandwidth limiter on their writes."""
    if isinstance(tier.url, (str, Path)):
        return open_store(tier.url, limiter=limiter) if limiter is not None else open_store(tier.url)
    return tier.url


@dataclass
class TierState:
    """A tier as a manager uses it: its store and what was written there."""

    tier: Tier
    store: Store
    bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    warned_capacity: bool = False

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def node_local(self) -> bool:
        return self.tier.node_local

    def to_dict(self) -> dict:
        """What was written here (``CheckpointManager.stats()["tiers"]``) and how restores read it."""
        way = getattr(self.store, "read_path", None)  # a local directory: O_DIRECT or buffered, as measured
        return {"url": self.url, "scope": self.tier.scope, "bytes_written": self.bytes, "seconds": self.seconds,
                "files": self.files, "gb_per_s": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
                "read_path": {**way().to_dict(), "bounced": way(bounced=True).to_dict()} if callable(way) else None}


def commit_tier(tiers: list[TierState]) -> TierState:
    """Where a step is committed: tier 0, or the first shared tier after node-local ones."""
    return next(ts for ts in tiers if not ts.node_local)
