"""The checkpoint interval that loses the least work: Young/Daly's first-order optimum.

A job that saves every ``T`` seconds of training, blocking ``C`` seconds per save, and fails on
average every ``M`` seconds (MTBF) spends ``C / T`` of its time saving and loses, per failure, the
work since the last save: on average half a period, ``(T + C) / 2``, plus the restart ``R``. The
expected waste per second of training, ``C / T + ((T + C) / 2 + R) / M``, is least at
``T* = sqrt(2 · C · M)`` (Young 1974; Daly 2006 gives the same first-order term).

With asynchronous saves ``C`` is only what the save blocks for, while the background write of
``W`` seconds must end before the next save starts: ``T`` is never below ``W``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tierio.errors import ConfigError

RECENT_SAVES = 5  # the measured cost is the mean of this many latest saves


@dataclass(frozen=True)
class IntervalPlan:
    """The chosen interval and what it costs. Seconds throughout; ``overhead`` and ``waste`` are
    fractions of training time."""

    cost_s: float  # blocking seconds per save (C)
    mtbf_s: float  # mean time between failures of the job (M)
    write_s: float  # background write of one save (W): a lower bound on the interval
    restart_s: float  # restart and restore after a failure (R)
    young_daly_s: float  # sqrt(2 · C · M)
    interval_s: float  # max(young_daly_s, write_s): training seconds between saves
    bound: str  # the optimum's binding bound: "young-daly" or "background write"
    overhead: float  # C / T
    lost_per_failure_s: float  # (T + C) / 2 + R
    waste: float  # overhead + lost_per_failure_s / M


def _check(value: float, what: str, allow_zero: bool) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        need = "zero or more" if allow_zero else "more than zero"
        raise ConfigError(f"{what} must be a finite number of seconds, {need}; got {value!r}")
    return float(value)


def check_mtbf(mtbf_s: float) -> float:
    """The ``mtbf`` option, checked (ConfigError for zero, negative, infinite or non-numbers)."""
    return _check(mtbf_s, "the mean time between failures (mtbf)", False)


def optimal_interval(cost_s: float, mtbf_s: float, write_s: float = 0.0, restart_s: float = 0.0) -> IntervalPlan:
    """Young/Daly's interval for a save blocking ``cost_s`` in a job failing every ``mtbf_s`` on
    average, never shorter than the background write ``write_s``."""
    cost = _check(cost_s, "the blocking cost of a save", True)
    mtbf = check_mtbf(mtbf_s)
    write = _check(write_s, "the background write time of a save", True)
    yd = math.sqrt(2.0 * cost * mtbf)
    return interval_at(max(yd, write), cost, mtbf, write, restart_s)


def interval_at(interval_s: float, cost_s: float, mtbf_s: float, write_s: float = 0.0,
                restart_s: float = 0.0) -> IntervalPlan:
    """The overhead and the work lost per failure of saving every ``interval_s`` seconds (a given
    interval, e.g. a planned one, or the optimum)."""
    interval = _check(interval_s, "the checkpoint interval", True)
    cost = _check(cost_s, "the blocking cost of a save", True)
    mtbf = check_mtbf(mtbf_s)
    write = _check(write_s, "the background write time of a save", True)
    restart = _check(restart_s, "the restart time", True)
    yd = math.sqrt(2.0 * cost * mtbf)
    bound = "background write" if write > yd else "young-daly"  # which bound the optimum sits on
    overhead = cost / interval if interval > 0 else 0.0  # a free save: save whenever asked
    lost = (interval + cost) / 2.0 + restart
    return IntervalPlan(cost, mtbf, write, restart, yd, interval, bound, overhead, lost, overhead + lost / mtbf)


@dataclass(frozen=True)
class SaveCost:
    """What recent saves measured: the mean blocking seconds and the longest background write."""

    blocking_s: float
    write_s: float
    saves: int


def measured_cost(saves: list[dict[str, Any]], recent: int = RECENT_SAVES) -> SaveCost | None:
    """The cost of a save from a manager's save records (``stats()["saves"]``): the mean time the
    latest ``recent`` saves held training (``save`` itself, and the next update's wait for an
    overlapped save's copy) and the longest of their persist times. None before any."""
    latest = saves[-recent:]
    if not latest:
        return None
    blocking = sum(float(s["blocking_seconds"]) + float(s.get("update_wait_seconds") or 0.0) for s in latest) / len(latest)
    writes = [float(s["persist_seconds"]) for s in latest if s.get("persist_seconds") is not None]
    return SaveCost(blocking, max(writes, default=0.0), len(latest))


def save_due(plan: IntervalPlan, since_last_s: float, persisting: bool) -> bool:
    """Whether a save should start ``since_last_s`` seconds after the previous one returned: never
    while the previous one still persists, else once the interval has gone by."""
    return not persisting and since_last_s >= plan.interval_s
