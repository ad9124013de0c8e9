"""Prometheus metrics of checkpoints, data loading, caches, weight loads and the KV cache, with regression alerts.

Nothing is exported until asked: ``serve(port)`` starts an HTTP endpoint with its own registry,
``register(registry)`` adds tierio's metrics to a registry the application already exposes. Both
subscribe to :mod:`tierio.events` and return an :class:`Exporter`; ``close()`` stops it.

The regression alerts (``tierio.diag.alerts``) log one warning when they turn on and set
``tierio_alert{alert=...,key=...}`` to 1 until the condition clears.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any
from urllib.parse import unquote, urlparse

from tierio import events
from tierio.diag.alerts import (
    DATA_WAIT_VARIANCE, PERSIST_REGRESSION, STEP_TIME_VARIANCE, AlertChange, AlertOptions, DataWaitVariance,
    PersistRegression, StepVariance,
)
from tierio.errors import ConfigError
from tierio.io.space import disk_space
from tierio.storage.url import redact

log = logging.getLogger("tierio.metrics")

# Bucket bounds in seconds: a save's stall is milliseconds to seconds, a persist up to minutes.
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PERSIST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
PROBE_WAIT = 1.0  # seconds a scrape waits for a tier's statvfs before it reports the last value read


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("tierio.metrics needs prometheus_client, which is not installed: "
                          "pip install 'tierio[metrics]' (or pip install prometheus_client)") from None
    return prometheus_client


def local_path(url: str) -> str | None:
    """The directory of a file:// tier (None for object stores: they have no size to fill)."""
    if url.startswith("file://"):
        return unquote(urlparse(url).path)
    return url if "://" not in url else None


class _Series:
    """tierio's metric families, created in one registry."""

    def __init__(self, prom: Any, registry: Any) -> None:
        self.created: list[Any] = []  # unregistered again by Exporter.close()

        def made(metric: Any) -> Any:
            self.created.append(metric)
            return metric

        def c(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return made(prom.Counter(name, doc, labels, registry=registry))

        def g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return made(prom.Gauge(name, doc, labels, registry=registry))

        def h(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Any:
            return made(prom.Histogram(name, doc, labels, buckets=buckets, registry=registry))

        try:
            self._define(c, g, h)
        except ValueError:  # a name is taken in this registry: leave it as it was
            _unregister(registry, self.created)
            raise

    def _define(self, c: Any, g: Any, h: Any) -> None:

        self.save_blocking = h("tierio_checkpoint_save_blocking_seconds", "Time save() held the training loop", ("tier",), STALL_BUCKETS)
        self.persist = h("tierio_checkpoint_persist_seconds", "Time from the start of a save's write to its commit on the first tier", ("tier",), PERSIST_BUCKETS)
        self.last_persist = g("tierio_checkpoint_last_persist_seconds", "Persist time of the latest save", ("tier",))
        self.written = c("tierio_tier_written_bytes", "Checkpoint bytes written to each tier (persist and promotion)", ("tier",))
        self.write_seconds = c("tierio_tier_write_seconds", "Seconds spent writing checkpoint shards to each tier", ("tier",))
        self.write_gbps = g("tierio_tier_write_gb_per_second", "GB/s of the latest shard written to each tier", ("tier",))
        self.lag = h("tierio_checkpoint_promotion_lag_seconds", "Time from a step's commit on the first tier to its commit on every slower tier", ("tier",), PERSIST_BUCKETS)
        self.pending = g("tierio_checkpoint_promotions_pending", "Steps committed on the first tier and not yet on every slower tier", ("tier",))
        self.promo_failures = c("tierio_checkpoint_promotion_failures", "Promotion attempts that failed (retried with the next save)", ("tier",))
        self.restore = h("tierio_checkpoint_restore_seconds", "Restore time, labelled with the tier the state came from", ("tier",), PERSIST_BUCKETS)
        self.verify_failures = c("tierio_checkpoint_verify_failures", "Copies found damaged or incomplete (checksum, missing file) on restore or promotion", ("tier",))
        self.step = h("tierio_step_seconds", "Training step time reported by StepTimer/WaitTimer (warm-up step left out)", ("timer",), STEP_BUCKETS)
        self.step_p50 = g("tierio_step_p50_seconds", "P50 of the recent step times", ("timer",))
        self.step_p99 = g("tierio_step_p99_seconds", "P99 of the recent step times", ("timer",))
        self.step_ratio = g("tierio_step_p99_over_p50", "P99/P50 of the recent step times (alert above 3)", ("timer",))
        self.step_wait = c("tierio_step_data_wait_seconds", "Seconds of step time spent waiting for data", ("timer",))
        self.step_stall = c("tierio_step_checkpoint_stall_seconds", "Seconds of step time checkpoint saves held the loop", ("timer",))
        self.wait = h("tierio_data_wait_seconds", "Time the training loop waited for a batch", ("loader",), WAIT_BUCKETS)
        self.wait_p50 = g("tierio_data_wait_p50_seconds", "P50 of the recent data waits", ("loader",))
        self.wait_p99 = g("tierio_data_wait_p99_seconds", "P99 of the recent data waits", ("loader",))
        self.wait_ratio = g("tierio_data_wait_p99_over_mean", "P99/mean of the recent data waits (alert above 3)", ("loader",))
        self.lookups = c("tierio_cache_lookups", "Cache lookups by result (hit or miss)", ("cache", "result"))
        self.hit_ratio = g("tierio_cache_hit_ratio", "Hits / lookups since the exporter started", ("cache",))
        self.evictions = c("tierio_cache_evictions", "Entries evicted to make room", ("cache",))
        self.evicted_bytes = c("tierio_cache_evicted_bytes", "Bytes evicted to make room", ("cache",))
        self.weights_bytes = c("tierio_weights_load_bytes", "Bytes of weights loaded")
        self.weights_seconds = h("tierio_weights_load_seconds", "Duration of weight loads", (), PERSIST_BUCKETS)
        self.weights_gbps = g("tierio_weights_load_gb_per_second", "GB/s of the latest weight load")
        self.kv_served = c("tierio_kv_blocks_served", "KV-cache blocks a get delivered, by the tier that held them", ("tier",))
        self.kv_missed = c("tierio_kv_blocks_missed", "KV-cache blocks a get asked for and did not deliver")
        self.kv_ratio = g("tierio_kv_hit_ratio", "KV-cache blocks served by each tier / blocks asked for, since the exporter started", ("tier",))
        self.alert = g("tierio_alert", "1 while a regression alert is on", ("alert", "key"))
        self.alerts = c("tierio_alerts", "Times a regression alert turned on", ("alert",))
        for name in (PERSIST_REGRESSION, DATA_WAIT_VARIANCE, STEP_TIME_VARIANCE):
            self.alerts.labels(name)  # present at 0, so a rule on increase() has a series from the start


class _SpaceProbes:
    """statvfs of each local tier, on a thread of its own with at most one in flight per tier.

    statvfs of a hung mount (NFS, a FUSE daemon that stopped) never returns: run in the scrape's
    thread, every scrape would leave one more thread stuck there. Here a scrape waits at most
    ``wait`` seconds and otherwise gets the last value read, with its age."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self._lock = threading.Lock()
        self._last: dict[str, tuple[int, int] | None] = {}
        self._since: dict[str, float] = {}  # monotonic time of the last answer (or of the first ask)
        self._running: dict[str, threading.Event] = {}

    def read(self, path: str) -> tuple[tuple[int, int] | None, float]:
        """((total, free) as last read or None, seconds since it was read: 0 when read now)."""
        with self._lock:
            done = self._running.get(path)
            if done is None:
                done = self._running[path] = threading.Event()
                self._since.setdefault(path, time.monotonic())
                threading.Thread(target=self._probe, args=(path, done), name="tierio-metrics-statvfs", daemon=True).start()
        fresh = done.wait(self.wait)
        with self._lock:
            return self._last.get(path), 0.0 if fresh else time.monotonic() - self._since[path]

    def _probe(self, path: str, done: threading.Event) -> None:
        space = None
        try:
            space = disk_space(path)
        finally:
            with self._lock:
                self._last[path], self._since[path] = space, time.monotonic()
                del self._running[path]
            done.set()


class _SpaceCollector:
    """Free and total bytes of every local tier seen, read when Prometheus scrapes."""

    def __init__(self, exporter: Exporter) -> None:
        from prometheus_client.core import GaugeMetricFamily

        self._family = GaugeMetricFamily
        self._exporter = exporter
        self._probes = _SpaceProbes(PROBE_WAIT)

    def collect(self) -> Any:
        free = self._family("tierio_tier_free_bytes", "Free bytes of the filesystem under each local tier", labels=["tier"])
        size = self._family("tierio_tier_size_bytes", "Size of the filesystem under each local tier", labels=["tier"])
        age = self._family("tierio_tier_space_age_seconds", "Seconds since the free and size bytes of each local "
                           "tier were read (0: at this scrape; growing: its filesystem does not answer)", labels=["tier"])
        oldest = self._family("tierio_checkpoint_oldest_pending_promotion_seconds",
                              "Age of the oldest step still waiting for promotion", labels=["tier"])
        tiers, pending = self._exporter.scrape_view()
        for tier in tiers:
            path = local_path(tier)
            if not path:
                continue
            space, seconds = self._probes.read(path)
            age.add_metric([tier], seconds)
            if space is not None:
                size.add_metric([tier], space[0])
                free.add_metric([tier], space[1])
        now = time.monotonic()
        for tier, started in pending.items():
            oldest.add_metric([tier], now - started if started is not None else 0.0)
        yield from (free, size, age, oldest)

    def describe(self) -> list:
        return []  # collected fresh at every scrape; no fixed description


class Exporter:
    """tierio's metrics in one prometheus_client registry, fed by tierio.events until ``close()``."""

    def __init__(self, registry: Any, alerts: AlertOptions | None = None) -> None:
        prom = _prometheus()
        self.registry = registry
        self.options = alerts or AlertOptions()
        try:
            self._series = _Series(prom, registry)
        except ValueError as exc:  # prometheus_client: a name is taken in this registry
            raise ConfigError(f"cannot register tierio's metrics: {exc}; this registry already has them "
                              "(close() the Exporter that registered them first)") from None
        self._space = _SpaceCollector(self)
        registry.register(self._space)
        self._lock = threading.Lock()
        self._tiers: set[str] = set()
        self._awaiting: dict[str, dict[int, float]] = {}  # first tier -> step -> commit time (monotonic)
        self._cache: dict[str, list[int]] = {}  # cache -> [hits, lookups]
        self._kv: dict[str, int] = {}  # tier -> KV blocks it served
        self._kv_asked = 0
        self._persist = PersistRegression(self.options)
        self._waits = DataWaitVariance(self.options)
        self._steps = StepVariance(self.options)
        self._active: dict[tuple[str, str], str] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._subscription: events.Subscription | None = events.subscribe(self._on_event)

    # -- public ----------------------------------------------------------------------------------
    @property
    def port(self) -> int | None:
        """The HTTP port of ``serve()`` (the one picked when asked for port 0)."""
        return self._server.server_port if self._server is not None else None

    def alerts(self) -> dict[tuple[str, str], str]:
        """Alerts on now: (alert name, tier or loader) -> the message logged when it turned on."""
        with self._lock:
            return dict(self._active)

    def close(self) -> None:
        """Stop listening to events, stop the HTTP endpoint, and unregister the scrape-time collector."""
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        _unregister(self.registry, [*self._series.created, self._space])

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scrape_view(self) -> tuple[list[str], dict[str, float | None]]:
        """(tiers seen, first tier -> commit time of its oldest step awaiting promotion)."""
        with self._lock:
            pending = {t: min(steps.values()) if steps else None for t, steps in self._awaiting.items()}
            return sorted(self._tiers), pending

    # -- events ----------------------------------------------------------------------------------
    def _on_event(self, ev: events.Event) -> None:
        s = self._series
        if isinstance(ev, events.DataWait):
            self._on_wait(ev)
        elif isinstance(ev, events.StepTimed):
            self._on_step(ev)
        elif isinstance(ev, events.CacheLookup):
            s.lookups.labels(ev.cache, "hit" if ev.hit else "miss").inc()
            s.hit_ratio.labels(ev.cache).set(self._ratio(self._cache, ev.cache, ev.hit))
        elif isinstance(ev, events.CacheEviction):
            s.evictions.labels(ev.cache).inc()
            s.evicted_bytes.labels(ev.cache).inc(ev.bytes)
        elif isinstance(ev, events.WeightsLoaded):
            s.weights_bytes.inc(ev.bytes)
            s.weights_seconds.observe(ev.seconds)
            if ev.seconds > 0:
                s.weights_gbps.set(ev.bytes / ev.seconds / 1e9)
        elif isinstance(ev, events.KvGet):
            self._on_kv(ev)
        else:
            self._on_checkpoint(ev)

    def _on_checkpoint(self, ev: events.Event) -> None:
        s = self._series
        ev = _redacted(ev)
        if isinstance(ev, events.CheckpointStaged):
            self._see(ev.tier)
            s.save_blocking.labels(ev.tier).observe(ev.blocking_seconds)
        elif isinstance(ev, events.TierWritten):
            self._see(ev.tier)
            s.written.labels(ev.tier).inc(ev.bytes)
            s.write_seconds.labels(ev.tier).inc(ev.seconds)
            if ev.seconds > 0:
                s.write_gbps.labels(ev.tier).set(ev.bytes / ev.seconds / 1e9)
        elif isinstance(ev, events.CheckpointPersisted):
            s.persist.labels(ev.tier).observe(ev.seconds)
            s.last_persist.labels(ev.tier).set(ev.seconds)
            if ev.promoting:
                self._await_promotion(ev.tier, ev.step)
            self._report(self._persist.observe(ev.tier, ev.seconds))
        elif isinstance(ev, events.CheckpointPromoted):
            with self._lock:
                started = self._awaiting.get(ev.source, {}).pop(ev.step, None)
                count = len(self._awaiting.get(ev.source, ()))
            s.pending.labels(ev.source).set(count)
            if started is not None:
                s.lag.labels(ev.source).observe(time.monotonic() - started)
        elif isinstance(ev, events.PromotionFailed):
            s.promo_failures.labels(ev.source).inc()
            if ev.integrity:
                s.verify_failures.labels(ev.source).inc()
        elif isinstance(ev, events.CheckpointRestored):
            self._see(ev.tier)
            s.restore.labels(ev.tier).observe(ev.seconds)
        elif isinstance(ev, events.CopyUnusable):
            s.verify_failures.labels(ev.tier).inc()

    def _on_wait(self, ev: events.DataWait) -> None:
        s = self._series
        s.wait.labels(ev.loader).observe(ev.seconds)
        self._window(self._waits, ev.loader, ev.seconds, (s.wait_p50, s.wait_p99, s.wait_ratio))

    def _on_step(self, ev: events.StepTimed) -> None:
        s = self._series
        s.step.labels(ev.timer).observe(ev.seconds)
        s.step_wait.labels(ev.timer).inc(ev.data_wait)
        s.step_stall.labels(ev.timer).inc(ev.checkpoint_stall)
        self._window(self._steps, ev.timer, ev.seconds, (s.step_p50, s.step_p99, s.step_ratio))

    def _window(self, watch: DataWaitVariance, key: str, seconds: float, gauges: tuple[Any, Any, Any]) -> None:
        """Feed a sliding-window alert; when it summarizes, set its P50, P99 and ratio gauges."""
        with self._lock:
            summary, change = watch.observe(key, seconds)
        if summary is not None:
            for gauge, value in zip(gauges, (summary.p50, summary.p99, watch.ratio(summary))):
                gauge.labels(key).set(value)
        self._report(change)

    def _on_kv(self, ev: events.KvGet) -> None:
        s = self._series
        served = {"device": ev.device, "dram": ev.dram, "nvme": ev.nvme, "shared": ev.shared}
        with self._lock:
            for tier, n in served.items():
                self._kv[tier] = self._kv.get(tier, 0) + n
            self._kv_asked += ev.blocks
            ratios = {tier: n / self._kv_asked for tier, n in self._kv.items()} if self._kv_asked else {}
        for tier, n in served.items():
            s.kv_served.labels(tier).inc(n)
        s.kv_missed.inc(ev.missed)
        for tier, ratio in ratios.items():
            s.kv_ratio.labels(tier).set(ratio)

    def _see(self, tier: str) -> None:
        with self._lock:
            self._tiers.add(tier)

    def _await_promotion(self, tier: str, step: int) -> None:
        with self._lock:
            steps = self._awaiting.setdefault(tier, {})
            steps[step] = time.monotonic()
            count = len(steps)
        self._series.pending.labels(tier).set(count)

    def _ratio(self, table: dict[str, list[int]], key: str, hit: bool) -> float:
        with self._lock:
            counts = table.setdefault(key, [0, 0])
            counts[0] += int(hit)
            counts[1] += 1
            return counts[0] / counts[1]

    def _report(self, change: AlertChange | None) -> None:
        if change is None:
            return
        self._series.alert.labels(change.name, change.key).set(1 if change.active else 0)
        with self._lock:
            if change.active:
                self._active[(change.name, change.key)] = change.message
            else:
                self._active.pop((change.name, change.key), None)
        if change.active:
            self._series.alerts.labels(change.name).inc()
            log.warning("%s", change.message)
        else:
            log.info("%s", change.message)


def _redacted(ev: events.Event) -> events.Event:
    """``ev`` with its tier URLs stripped of credentials: labels are shown to whoever can scrape."""
    changes = {f: redact(v) for f in ("tier", "source") if isinstance(v := getattr(ev, f, None), str)}
    return replace(ev, **changes) if changes else ev  # type: ignore[type-var]


def _unregister(registry: Any, collectors: list[Any]) -> None:
    for collector in collectors:
        try:
            registry.unregister(collector)
        except KeyError:
            pass


def register(registry: Any, *, alerts: AlertOptions | None = None) -> Exporter:
    """Add tierio's metrics to ``registry`` (e.g. ``prometheus_client.REGISTRY``) and start feeding them."""
    return Exporter(registry, alerts)


def serve(port: int = 9400, addr: str = "127.0.0.1", *, alerts: AlertOptions | None = None) -> Exporter:
    """Start an HTTP endpoint at ``addr:port/metrics`` with tierio's metrics in a registry of their own.

    ``addr`` defaults to loopback: pass ``"0.0.0.0"`` (or the node's address) for a Prometheus on
    another host. ``port=0`` picks a free port (``Exporter.port``)."""
    prom = _prometheus()
    exporter = Exporter(prom.CollectorRegistry(), alerts)
    try:
        exporter._server, exporter._thread = prom.start_http_server(port, addr=addr, registry=exporter.registry)
    except OSError as exc:
        exporter.close()
        raise ConfigError(f"cannot serve metrics on {addr}:{port} ({exc.strerror or exc}); pick another port") from None
    return exporter


__all__ = ["AlertOptions", "Exporter", "register", "serve"]
