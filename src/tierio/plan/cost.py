"""Storage cost over years: parallel-filesystem hardware and an object-store archive that grows daily."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierio.errors import ConfigError

DAYS_PER_MONTH = 365.25 / 12


@dataclass(frozen=True)
class HardwareCost:
    osts: int
    osts_per_node: int
    nodes: int          # ceil(OSTs / OSTs per node)
    node_cost: float
    total: float        # nodes × node cost (bought once)


def ost_hardware_cost(osts: int, node_cost: float, osts_per_node: int = 1) -> HardwareCost:
    """Parallel-FS hardware: ceil(OSTs / OSTs per node) storage nodes × price per node."""
    if osts < 1 or osts_per_node < 1:
        raise ConfigError("OST count and OSTs per node must be at least 1")
    if node_cost < 0:
        raise ConfigError(f"node cost must be zero or more, got {node_cost!r}")
    nodes = math.ceil(osts / osts_per_node)
    return HardwareCost(osts, osts_per_node, nodes, node_cost, nodes * node_cost)


@dataclass(frozen=True)
class ArchiveCost:
    daily_bytes: float
    price_per_gb_month: float
    years: float
    retention_days: float | None   # None: keep everything (an immutable archive)
    final_stored_bytes: float
    final_monthly: float           # bill of the last month
    total: float                   # sum of every month's bill over ``years``


def archive_cost(daily_bytes: float, price_per_gb_month: float, years: float,
                 retention_days: float | None = None) -> ArchiveCost:
    """Object-store bill when ``daily_bytes`` are archived every day for ``years``.

    Stored bytes on day d = daily × min(d, retention); the bill sums stored GB × price /
    (365.25/12 days per month) over every day. Without retention the archive grows linearly, so
    the total grows with the square of the time.
    """
    if daily_bytes <= 0:
        raise ConfigError(f"daily archive volume must be more than zero, got {daily_bytes!r}")
    if price_per_gb_month < 0 or years <= 0:
        raise ConfigError("price must be zero or more and years more than zero")
    if retention_days is not None and retention_days <= 0:
        raise ConfigError("retention must be more than zero days (or none, to keep everything)")
    days = int(round(years * 365.25))
    keep = retention_days if retention_days is not None else float("inf")
    gb_days = sum(min(d, keep) for d in range(1, days + 1)) * daily_bytes / 1e9
    total = gb_days * price_per_gb_month / DAYS_PER_MONTH
    final = daily_bytes * min(days, keep)
    return ArchiveCost(daily_bytes, price_per_gb_month, years, retention_days, final,
                       final / 1e9 * price_per_gb_month, total)
