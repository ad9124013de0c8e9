"""The decode-latency rule: may a slower tier serve KV reads under a decode-time SLA?

Fetching a share of a request's KV from a slower tier adds, per decoded token,
``fetch fraction × fetch latency``; the tier is eligible while that penalty stays within
``budget`` of the decode time per token. ``tierio plan`` applies it to sizing (and re-exports it);
the KV router applies it to each lookup, with the fetch latency it has measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierio.errors import ConfigError
from tierio.stats import Stats


@dataclass(frozen=True)
class FetchRule(Stats):
    """Decode-latency cost of fetching KV blocks from a slower tier.

    overhead = fetch fraction × fetch latency / decode latency per token; viable when the
    overhead stays within ``budget``. ``max_fraction`` is the largest fetch fraction that does.
    """

    fetch_fraction: float
    fetch_latency_s: float
    decode_latency_s: float
    penalty_s: float          # fetch fraction × fetch latency
    overhead: float           # penalty / decode latency
    budget: float
    viable: bool
    max_fraction: float       # min(1, budget × decode latency / fetch latency)


def fetch_rule(fetch_fraction: float, fetch_latency_s: float, decode_latency_s: float, budget: float = 0.05) -> FetchRule:
    """Apply the fetch-latency rule for a decode SLA (see FetchRule)."""
    if not 0 <= fetch_fraction <= 1:
        raise ConfigError(f"fetch fraction must lie between 0 and 1, got {fetch_fraction!r}")
    if fetch_latency_s <= 0 or decode_latency_s <= 0:
        raise ConfigError("fetch latency and decode latency must both be more than zero")
    penalty = fetch_fraction * fetch_latency_s
    overhead = penalty / decode_latency_s
    return FetchRule(fetch_fraction, fetch_latency_s, decode_latency_s, penalty, overhead, budget,
                     overhead <= budget, min(1.0, budget * decode_latency_s / fetch_latency_s))


@dataclass(frozen=True)
class DecodeSLA:
    """A request's decode-time target: ``decode_latency_s`` per token, of which at most ``budget``
    (a fraction) may go to fetching KV from a slower tier."""

    decode_latency_s: float
    budget: float = 0.05

    def __post_init__(self) -> None:
        if not self.decode_latency_s > 0 or not 0 < self.budget <= 1:
            raise ConfigError("decode SLA: decode latency must be more than zero and the budget in (0, 1]")


__all__ = ["DecodeSLA", "FetchRule", "fetch_rule"]
