"""Training-loop timers that show where step time goes: waiting for data, computing, or checkpointing.

``WaitTimer`` measures how long each step waits for its batch::

    wt = WaitTimer()
    for batch in wt.wrap(loader):        # the wait inside next(loader) is timed
        train_step(batch)                # the step ends when the loop asks for the next batch
    print(wt.table()); wt.to_json("wait.json")

``StepTimer`` also splits out checkpoint stalls and draws a timeline::

    timer = StepTimer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
    for step, batch in enumerate(timer.wrap(loader)):
        train_step(batch)
        if step % 500 == 0:
            with timer.checkpoint() as ck:
                ck.handle = manager.save(step, state)   # stall = time inside the block
    timer.to_json("steps.json"); timer.plot("steps.png")

Or drive them by hand: ``start_wait()``, ``end_wait()``, ``step_done()``; with a checkpoint
handle whose save was not wrapped, ``record_checkpoint(handle)`` charges its
``blocking_seconds`` to the current step. Statistics leave out the first step (worker start-up,
compilation), as MLPerf Storage does for accelerator utilization = compute time / total time.
``tierio doctor --timers FILE`` judges the JSON these timers write.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from tierio import events
from tierio.errors import ConfigError

FLAG_RATIO = 3.0  # P99/mean data wait above this points at storage variance


@dataclass
class StepRecord:
    """One training step, in seconds; ``start`` is measured from the timer's first event."""

    index: int
    start: float
    total: float
    data_wait: float
    compute: float
    checkpoint_stall: float = 0.0


@dataclass
class CheckpointEvent:
    """One checkpoint seen by a StepTimer; ``*_at`` are seconds since the timer's first event."""

    step: int
    start: float
    stall: float
    blocking_seconds: float | None = None
    staged_at: float | None = None
    persisted_at: float | None = None
    promoted_at: float | None = None
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without needing numpy."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float]:
    """mean, P50, P99, max and sum of a list of seconds."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0, "sum": 0.0}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values), "sum": sum(values)}


class WaitTimer:
    """Per-step data-wait time: mean, P50, P99, P99/mean (flagged above 3×) and utilization."""

    kind = "tierio.waittimer"

    def __init__(self, name: str = "", clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], Any] | None = None) -> None:
        self.name = name
        self._clock = clock
        self._sync = sync
        self._origin: float | None = None
        self._created = clock()
        self._step_start: float | None = None
        self._wait_start: float | None = None
        self._wait_acc = 0.0
        self._stall_acc = 0.0
        self._intervals: list[tuple[str, float, float]] = []  # (kind, start, end) relative to origin
        self.steps: list[StepRecord] = []

    # -- explicit calls ------------------------------------------------------------------------
    def _now(self) -> float:
        t = self._clock()
        if self._origin is None:
            self._origin = t
        if self._step_start is None:
            self._step_start = t
        return t

    def start_wait(self) -> None:
        """The loop starts waiting for its next batch."""
        if self._wait_start is not None:
            raise ConfigError("start_wait() called twice without end_wait(): end the first wait before starting another")
        self._wait_start = self._now()

    def end_wait(self) -> None:
        """The batch arrived."""
        if self._wait_start is None:
            raise ConfigError("end_wait() called without start_wait(): call start_wait() before fetching the batch")
        t = self._now()
        self._wait_acc += t - self._wait_start
        self._intervals.append(("data_wait", self._rel(self._wait_start), self._rel(t)))
        self._wait_start = None

    def step_done(self) -> StepRecord:
        """Close the current step: its time since the previous step_done() is split into parts."""
        if self._sync is not None:
            self._sync()
        if self._wait_start is not None:
            self.end_wait()
        if self._step_start is None:  # step_done() as the very first call: the step began at construction
            self._origin = self._step_start = self._created
        t = self._now()
        total = t - self._step_start
        compute = max(0.0, total - self._wait_acc - self._stall_acc)
        rec = StepRecord(len(self.steps), self._rel(self._step_start), total, self._wait_acc, compute, self._stall_acc)
        self.steps.append(rec)
        if rec.index > 0:  # live step-time metrics (tierio.metrics), warm-up step left out as in summary()
            events.emit(events.StepTimed(self.name or self.kind.rsplit(".", 1)[-1], total, rec.data_wait,
                                         rec.checkpoint_stall))
        self._step_start, self._wait_acc, self._stall_acc = t, 0.0, 0.0
        return rec

    def _rel(self, t: float) -> float:
        return t - (self._origin if self._origin is not None else t)

    # -- iterator wrapper --------------------------------------------------------------------------
    def wrap(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, timing each wait for the next item and closing a step per item."""
        it = iter(iterable)
        while True:
            self.start_wait()
            try:
                item = next(it)
            except StopIteration:
                self._wait_start = None  # the loader ran out: that wait belongs to no step
                return
            self.end_wait()
            try:
                yield item
            finally:
                self.step_done()

    # -- results -----------------------------------------------------------------------------------
    def _measured(self) -> list[StepRecord]:
        """The steps statistics use: all but the first, when there are at least two."""
        return self.steps[1:] if len(self.steps) >= 2 else list(self.steps)

    def summary(self) -> dict[str, Any]:
        """Statistics in seconds, first step excluded (it is reported on its own)."""
        rows = self._measured()
        wait = describe([r.data_wait for r in rows])
        step = describe([r.total for r in rows])
        compute = describe([r.compute for r in rows])
        ratio = wait["p99"] / wait["mean"] if wait["mean"] > 0 else 0.0
        return {
            "name": self.name,
            "steps": len(rows),
            "steps_recorded": len(self.steps),
            "first_step": asdict(self.steps[0]) if self.steps else None,
            "data_wait": wait,
            "compute": compute,
            "step": step,
            "wait_p99_over_mean": ratio,
            "wait_flagged": ratio > FLAG_RATIO,
            "utilization": compute["sum"] / step["sum"] if step["sum"] > 0 else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": 1,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "summary": self.summary(),
            "steps": [asdict(r) for r in self.steps],
            "intervals": [list(x) for x in self._intervals],
        }

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the summary and every step to ``path`` (read by ``tierio doctor --timers``)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    _PARTS: tuple[tuple[str, str], ...] = (("data wait", "data_wait"), ("compute", "compute"), ("step", "step"))

    def table(self) -> str:
        """A plain-text table of the summary, for logs."""
        s = self.summary()
        total = s["step"]["sum"] or 1.0
        lines = [f"{'part':<17}{'mean':>11}{'P50':>11}{'P99':>11}{'max':>11}{'share':>8}"]
        for label, key in self._PARTS:
            d = s[key]
            share = "" if key == "step" else f"{d['sum'] / total:.1%}"
            lines.append(f"{label:<17}" + "".join(f"{_ms(d[k]):>11}" for k in ("mean", "p50", "p99", "max"))
                         + f"{share:>8}")
        flag = "FLAGGED: storage variance" if s["wait_flagged"] else "ok"
        lines.append(f"steps {s['steps']} (first step excluded) · utilization {s['utilization']:.1%} · "
                     f"data-wait P99/mean {s['wait_p99_over_mean']:.1f}× ({flag})")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


class StepClock:
    """Step time for the live metrics only, in constant memory: what the framework integrations run
    on every step of a whole training run (a StepTimer keeps every step for its table and JSON).

    ``step_done()`` closes a step and reports it as an ``events.StepTimed`` (the first, warm-up step
    is left out, as in StepTimer); time inside ``with clock.stall():`` is that step's checkpoint stall."""

    def __init__(self, name: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.name, self._clock = name, clock
        self._start = clock()
        self._stall = 0.0
        self.steps = 0

    def step_done(self) -> None:
        now = self._clock()
        if self.steps > 0:
            events.emit(events.StepTimed(self.name, now - self._start, 0.0, self._stall))
        self.steps += 1
        self._start, self._stall = now, 0.0

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        t0 = self._clock()
        try:
            yield
        finally:
            self._stall += self._clock() - t0


class _CheckpointScope:
    """What ``with timer.checkpoint() as ck`` gives: set ``ck.handle`` to the save's handle."""

    def __init__(self) -> None:
        self.handle: Any = None


class StepTimer(WaitTimer):
    """Splits each step into data wait, compute and checkpoint stall; JSON for doctor, PNG timeline."""

    kind = "tierio.steptimer"
    _PARTS = (("data wait", "data_wait"), ("compute", "compute"), ("checkpoint stall", "checkpoint_stall"),
              ("step", "step"))

    def __init__(self, name: str = "", clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], Any] | None = None) -> None:
        super().__init__(name, clock, sync)
        self.checkpoints: list[CheckpointEvent] = []
        self._lock = threading.Lock()
        self._in_checkpoint = False
        self._scope: _CheckpointScope | None = None

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[_CheckpointScope]:
        """Time a blocking save: the time inside the block is this step's checkpoint stall."""
        if self._in_checkpoint:
            raise ConfigError("timer.checkpoint() blocks cannot nest")
        if self._sync is not None:
            self._sync()  # GPU work queued before the save is compute, not stall
        scope = _CheckpointScope()
        start = self._now()
        self._in_checkpoint, self._scope = True, scope
        try:
            yield scope
        finally:
            self._in_checkpoint, self._scope = False, None
            end = self._clock()
            self._stall_acc += end - start
            self._intervals.append(("checkpoint_stall", self._rel(start), self._rel(end)))
            event = CheckpointEvent(len(self.steps), self._rel(start), end - start)
            self.checkpoints.append(event)
            if scope.handle is not None:
                self._attach(event, scope.handle)

    def record_checkpoint(self, handle: Any) -> CheckpointEvent | None:
        """Record a save that was not wrapped in ``checkpoint()``: its ``blocking_seconds`` is the stall.

        Any object with ``blocking_seconds`` (float) works; futures named ``staged``,
        ``persisted`` and ``promoted`` are followed to mark when each stage finished. Called
        inside a ``checkpoint()`` block, it only attaches the handle (the block already timed
        the stall) and returns None.
        """
        if self._in_checkpoint and self._scope is not None:
            self._scope.handle = handle
            return None
        blocking = getattr(handle, "blocking_seconds", None)
        if not isinstance(blocking, (int, float)) or blocking < 0:
            raise ConfigError("record_checkpoint() needs a handle with blocking_seconds >= 0 "
                              "(what a checkpoint manager's save() returns)")
        end = self._now()
        self._stall_acc += float(blocking)
        start = self._rel(end) - float(blocking)
        self._intervals.append(("checkpoint_stall", max(0.0, start), self._rel(end)))
        event = CheckpointEvent(len(self.steps), max(0.0, start), float(blocking))
        self.checkpoints.append(event)
        self._attach(event, handle)
        return event

    def _attach(self, event: CheckpointEvent, handle: Any) -> None:
        blocking = getattr(handle, "blocking_seconds", None)
        if isinstance(blocking, (int, float)):
            event.blocking_seconds = float(blocking)
        for stage in ("staged", "persisted", "promoted"):
            fut = getattr(handle, stage, None)
            if fut is not None and hasattr(fut, "add_done_callback"):
                fut.add_done_callback(lambda f, stage=stage: self._stage_done(event, stage, f))

    def _stage_done(self, event: CheckpointEvent, stage: str, fut: Any) -> None:
        at = self._rel(self._clock())
        with self._lock:
            setattr(event, f"{stage}_at", at)
            try:
                exc = fut.exception(timeout=0) if not fut.cancelled() else None
            except Exception:  # noqa: BLE001 - a future-like object without exception(): nothing to learn
                exc = None
            if fut.cancelled():
                event.error = f"{stage} cancelled"
            elif exc is not None and event.error is None:
                event.error = f"{stage} failed: {exc}"

    def summary(self) -> dict[str, Any]:
        s = super().summary()
        rows = self._measured()
        s["checkpoint_stall"] = describe([r.checkpoint_stall for r in rows])
        s["checkpoints"] = len(self.checkpoints)
        with self._lock:
            s["checkpoint_events"] = [asdict(e) for e in self.checkpoints]
        return s

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw a PNG timeline (data wait, compute, checkpoint stall) with checkpoints marked.

        Needs matplotlib: ``pip install 'tierio[plot]'``.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ConfigError("drawing a timeline needs matplotlib: pip install 'tierio[plot]'") from None
        if not self.steps:
            raise ConfigError("no steps recorded yet: time some steps before plotting")
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.5), gridspec_kw={"height_ratios": [1, 2]})
        colors = {"compute": "#4c78a8", "data_wait": "#f58518", "checkpoint_stall": "#e45756"}
        top.broken_barh([(r.start, r.total) for r in self.steps], (0, 1), color=colors["compute"], label="compute")
        for kind in ("data_wait", "checkpoint_stall"):
            spans = [(a, b - a) for k, a, b in self._intervals if k == kind]
            if spans:
                top.broken_barh(spans, (0, 1), color=colors[kind], label=kind.replace("_", " "))
        for e in self.checkpoints:
            top.axvline(e.start, color="black", lw=0.8)
            for stage, marker in (("persisted_at", "v"), ("promoted_at", "^")):
                at = getattr(e, stage)
                if at is not None:
                    top.plot([at], [1.15], marker=marker, color="black", ms=5)
        top.set_yticks([])
        top.set_ylim(0, 1.3)
        top.set_xlabel("seconds (lines: checkpoint saves; ▼ persisted, ▲ promoted)")
        top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=3, frameon=False)
        idx = [r.index for r in self.steps]
        waits = [r.data_wait for r in self.steps]
        comp = [r.compute for r in self.steps]
        stall = [r.checkpoint_stall for r in self.steps]
        bottom.bar(idx, comp, color=colors["compute"], label="compute")
        bottom.bar(idx, waits, bottom=comp, color=colors["data_wait"], label="data wait")
        bottom.bar(idx, stall, bottom=[c + w for c, w in zip(comp, waits)], color=colors["checkpoint_stall"],
                   label="checkpoint stall")
        bottom.set_xlabel("step")
        bottom.set_ylabel("seconds")
        s = self.summary()
        bottom.set_title(f"utilization {s['utilization']:.1%} · data-wait P99/mean {s['wait_p99_over_mean']:.1f}×",
                         fontsize=9)
        bottom.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
