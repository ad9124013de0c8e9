"""Regression alerts over a running job: a checkpoint persist far slower than its recent median,
data-wait P99/mean and step-time P99/P50 above the thresholds the doctor uses (``rules.WAIT_P99_MEAN``,
``rules.STEP_P99_P50``).

Pure bookkeeping over observed seconds: ``observe()`` returns an :class:`AlertChange` when an
alert turns on or off, and None otherwise, so whoever feeds it (``tierio.metrics``) logs one
warning per episode rather than one per sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tierio.diag.rules import STEP_P99_P50, WAIT_P99_MEAN
from tierio.diag.timers import percentile
from tierio.errors import ConfigError

PERSIST_REGRESSION = "checkpoint_persist_regression"
DATA_WAIT_VARIANCE = "data_wait_variance"
STEP_TIME_VARIANCE = "step_time_variance"


@dataclass(frozen=True)
class AlertOptions:
    """When the regression alerts fire.

    A persist alerts when it takes more than ``persist_factor`` × the median of the previous
    ``persist_window`` persists of the same tier (judged once ``persist_min_saves`` are known).
    Data wait alerts when P99/mean of the last ``wait_window`` waits of a loader exceeds
    ``wait_ratio``, judged every ``wait_every`` waits once ``wait_min_batches`` are known, and only
    while P99 is at least ``wait_min_p99`` seconds (sub-millisecond waits stall nothing). Step time
    alerts when P99/P50 of the last ``wait_window`` steps of a timer exceeds ``step_ratio``, over the
    same window and cadence."""

    persist_factor: float = 2.0
    persist_window: int = 20
    persist_min_saves: int = 5
    wait_ratio: float = WAIT_P99_MEAN
    wait_window: int = 1000
    wait_min_batches: int = 100
    wait_every: int = 20
    wait_min_p99: float = 0.001
    step_ratio: float = STEP_P99_P50

    def __post_init__(self) -> None:
        if not self.persist_factor > 1.0 or not self.wait_ratio > 1.0 or not self.step_ratio > 1.0:
            raise ConfigError(f"alert factors must be above 1 (persist_factor={self.persist_factor}, "
                              f"wait_ratio={self.wait_ratio}, step_ratio={self.step_ratio}): a ratio of 1 or "
                              "less alerts on every sample")
        for name in ("persist_window", "persist_min_saves", "wait_window", "wait_min_batches", "wait_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"AlertOptions.{name} must be at least 1, got {getattr(self, name)}")
        if self.wait_min_batches > self.wait_window:
            raise ConfigError(f"wait_min_batches ({self.wait_min_batches}) cannot exceed wait_window ({self.wait_window})")


@dataclass(frozen=True)
class AlertChange:
    """An alert turned on (``active``) or off for ``key`` (a tier URL or a loader name)."""

    name: str
    key: str
    active: bool
    message: str


@dataclass(frozen=True)
class WaitSummary:
    batches: int
    mean: float
    p50: float
    p99: float

    @property
    def p99_over_mean(self) -> float:
        return self.p99 / self.mean if self.mean > 0 else 0.0

    @property
    def p99_over_p50(self) -> float:
        return self.p99 / self.p50 if self.p50 > 0 else 0.0


class PersistRegression:
    """Per tier: is this persist slower than ``persist_factor`` × the recent median?"""

    def __init__(self, options: AlertOptions) -> None:
        self.options = options
        self._recent: dict[str, deque[float]] = {}
        self._active: set[str] = set()

    def active(self, tier: str) -> bool:
        return tier in self._active

    def observe(self, tier: str, seconds: float) -> AlertChange | None:
        recent = self._recent.setdefault(tier, deque(maxlen=self.options.persist_window))
        change = None
        if len(recent) >= self.options.persist_min_saves:
            median = percentile(list(recent), 50)
            slow = seconds > self.options.persist_factor * median
            if slow and tier not in self._active:
                self._active.add(tier)
                change = AlertChange(PERSIST_REGRESSION, tier, True,
                                     f"checkpoint persist to {tier} took {seconds:.3g}s, {seconds / median:.1f}x the median "
                                     f"{median:.3g}s of the last {len(recent)} saves (alert above "
                                     f"{self.options.persist_factor:g}x): the tier got slower; check its free space, "
                                     "its load (tierio doctor) and competing jobs")
            elif not slow and tier in self._active:
                self._active.discard(tier)
                change = AlertChange(PERSIST_REGRESSION, tier, False,
                                     f"checkpoint persist to {tier} is back to {seconds:.3g}s (median {median:.3g}s)")
        recent.append(seconds)
        return change


class DataWaitVariance:
    """Per loader: P99/mean of the recent data waits against the doctor's threshold.

    The sliding window, the cadence and the on/off bookkeeping are shared with ``StepVariance``,
    which judges another ratio of another series over the same window."""

    name = DATA_WAIT_VARIANCE

    def __init__(self, options: AlertOptions) -> None:
        self.options = options
        self._recent: dict[str, deque[float]] = {}
        self._since: dict[str, int] = {}
        self._active: set[str] = set()

    def active(self, key: str) -> bool:
        return key in self._active

    def summary(self, key: str) -> WaitSummary:
        values = list(self._recent.get(key, ()))
        if not values:
            return WaitSummary(0, 0.0, 0.0, 0.0)
        return WaitSummary(len(values), sum(values) / len(values), percentile(values, 50), percentile(values, 99))

    def ratio(self, s: WaitSummary) -> float:
        return s.p99_over_mean

    def high(self, s: WaitSummary) -> bool:
        return s.p99_over_mean > self.options.wait_ratio and s.p99 >= self.options.wait_min_p99

    def on_message(self, key: str, s: WaitSummary) -> str:
        return (f"data wait of {key}: P99 {s.p99:.3g}s is {s.p99_over_mean:.1f}x the mean {s.mean:.3g}s "
                f"over the last {s.batches} batches (alert above {self.options.wait_ratio:g}x): some "
                "batches arrive far later than the rest; look for storage contention (stripe counts, "
                "OST load) or cache the dataset on local NVMe")

    def off_message(self, key: str, s: WaitSummary) -> str:
        return f"data wait of {key}: P99/mean back to {s.p99_over_mean:.1f}x"

    def observe(self, key: str, seconds: float) -> tuple[WaitSummary | None, AlertChange | None]:
        """Record one sample; every ``wait_every`` samples returns the window's summary and any change."""
        recent = self._recent.setdefault(key, deque(maxlen=self.options.wait_window))
        recent.append(seconds)
        self._since[key] = self._since.get(key, 0) + 1
        if self._since[key] < self.options.wait_every:
            return None, None
        self._since[key] = 0
        s = self.summary(key)
        if s.batches < self.options.wait_min_batches:
            return s, None
        high = self.high(s)
        if high and key not in self._active:
            self._active.add(key)
            return s, AlertChange(self.name, key, True, self.on_message(key, s))
        if not high and key in self._active:
            self._active.discard(key)
            return s, AlertChange(self.name, key, False, self.off_message(key, s))
        return s, None


class StepVariance(DataWaitVariance):
    """Per timer: step-time P99/P50 over the recent steps: above 3× it is almost always storage contention."""

    name = STEP_TIME_VARIANCE

    def ratio(self, s: WaitSummary) -> float:
        return s.p99_over_p50

    def high(self, s: WaitSummary) -> bool:
        return s.p99_over_p50 > self.options.step_ratio

    def on_message(self, key: str, s: WaitSummary) -> str:
        return (f"step time of {key}: P99 {s.p99:.3g}s is {s.p99_over_p50:.1f}x the P50 {s.p50:.3g}s over the "
                f"last {s.batches} steps (alert above {self.options.step_ratio:g}x): slow steps point at storage "
                "contention; check stripe counts and OST load (tierio doctor)")

    def off_message(self, key: str, s: WaitSummary) -> str:
        return f"step time of {key}: P99/P50 back to {s.p99_over_p50:.1f}x"
