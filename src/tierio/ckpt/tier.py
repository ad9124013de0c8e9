"""Tiers: a store plus its retention policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tierio.errors import ConfigError
from tierio.io.limiter import TokenBucket
from tierio.io.lustre import StripeApplied, StripeOptions, apply_stripe, stripe_options
from tierio.storage.base import Store
from tierio.storage.local import LocalStore
from tierio.storage.url import open_store

from tierio.ckpt.steps.retention import Retention


SCOPES = ("shared", "node")
log = logging.getLogger("tierio.ckpt")


@dataclass
class Tier:
    """One checkpoint tier: a URL (or an open Store) and what it keeps (None: everything).

    ``scope="node"``: the location is local to each node (its own NVMe), so each node sees only
    its own ranks' files there; a step is committed globally on the first shared tier after it.

    ``stripe="auto"``: a directory on Lustre is given ``lfs setstripe -c -1 -S 4M`` (every OST, 4 MiB
    stripes) when its layout is narrower, so every step written below it inherits that layout; a
    ``StripeOptions`` gives another count or size, ``"off"`` leaves the layout alone."""

    url: str | Path | Store
    retention: Retention | None = None
    scope: str = "shared"
    stripe: str | StripeOptions | None = "auto"

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ConfigError(f"tier scope {self.scope!r} must be one of {', '.join(SCOPES)}")
        stripe_options(self.stripe)  # refuses an unknown value here, not at the first save

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


def stripe_tier(tier: Tier, store: Store) -> StripeApplied | None:
    """Apply the tier's stripe policy to its directory (a local directory only; None when there is nothing to do)."""
    opts = stripe_options(tier.stripe)
    if opts is None or not isinstance(store, LocalStore):
        return None
    done = apply_stripe(str(store.root), opts)
    if done.lustre:  # elsewhere there is nothing to say
        log.info("%s", done.line())
    return done


@dataclass
class TierState:
    """A tier as a manager uses it: its store, the layout given to its directory, and what was written there."""

    tier: Tier
    store: Store
    bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    warned_capacity: bool = False
    stripe: StripeApplied | None = None

    @classmethod
    def open(cls, tier: Tier, limiter: TokenBucket | None = None) -> TierState:
        """Open the tier's store and stripe its directory as the tier says."""
        store = open_tier_store(tier, limiter)
        return cls(tier, store, stripe=stripe_tier(tier, store))

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
                "stripe": self.stripe.to_dict() if self.stripe is not None else None,
                "read_path": {**way().to_dict(), "bounced": way(bounced=True).to_dict()} if callable(way) else None}


def commit_tier(tiers: list[TierState]) -> TierState:
    """Where a step is committed: tier 0, or the first shared tier after node-local ones."""
    return next(ts for ts in tiers if not ts.node_local)
