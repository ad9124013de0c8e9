"""StepTimer and WaitTimer split step time correctly and write what the doctor reads."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from tierio.diag.doctor import load_timer_file
from tierio.diag.rules import ALERT, OK, timer_findings
from tierio.diag.timers import StepTimer, WaitTimer, percentile
from tierio.errors import ConfigError


class ManualClock:
    """A clock the test advances, so every split is exact."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, s: float) -> None:
        self.t += s


class SlowLoader:
    """An iterable whose next() takes the given times on the manual clock."""

    def __init__(self, clock: ManualClock, waits: list[float]) -> None:
        self.clock, self.waits = clock, waits

    def __iter__(self):
        for i, w in enumerate(self.waits):
            self.clock.tick(w)
            yield i


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [0.3, 0.1, 5.0, 0.2, 0.25, 0.9, 0.11]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_wait_timer_wrap_splits_wait_and_compute():
    clock = ManualClock()
    wt = WaitTimer(clock=clock)
    waits = [1.0] + [0.1] * 19 + [2.0]                   # first step: worker start-up
    for _ in wt.wrap(SlowLoader(clock, waits)):
        clock.tick(0.9)                                  # compute
    assert len(wt.steps) == 21
    assert wt.steps[0].data_wait == pytest.approx(1.0) and wt.steps[0].compute == pytest.approx(0.9)
    s = wt.summary()
    assert s["steps"] == 20                              # first step excluded
    assert s["data_wait"]["mean"] == pytest.approx((19 * 0.1 + 2.0) / 20)
    assert s["data_wait"]["p50"] == pytest.approx(0.1)
    assert s["compute"]["mean"] == pytest.approx(0.9)
    assert s["utilization"] == pytest.approx(20 * 0.9 / (20 * 0.9 + 19 * 0.1 + 2.0))
    assert s["wait_flagged"] == (s["wait_p99_over_mean"] > 3)
    assert s["wait_p99_over_mean"] > 3                   # one 2 s wait among 0.1 s waits


def test_wait_timer_explicit_calls_and_break():
    clock = ManualClock()
    wt = WaitTimer(clock=clock)
    for _ in range(5):
        wt.start_wait()
        clock.tick(0.05)
        wt.end_wait()
        clock.tick(0.45)
        wt.step_done()
    assert [round(r.total, 9) for r in wt.steps] == [0.5] * 5
    assert wt.summary()["utilization"] == pytest.approx(0.9)
    # breaking out of a wrapped loop still closes the step
    wt2 = WaitTimer(clock=clock)
    for i in wt2.wrap(SlowLoader(clock, [0.1] * 10)):
        clock.tick(1.0)
        if i == 2:
            break
    assert len(wt2.steps) == 3


def test_wait_timer_misuse_is_a_clear_error():
    wt = WaitTimer()
    with pytest.raises(ConfigError, match="without start_wait"):
        wt.end_wait()
    wt.start_wait()
    with pytest.raises(ConfigError, match="twice"):
        wt.start_wait()


def test_wait_timer_table_and_json(tmp_path):
    clock = ManualClock()
    wt = WaitTimer("loader", clock=clock)
    for _ in wt.wrap(SlowLoader(clock, [0.2] * 12)):
        clock.tick(1.0)
    table = wt.table()
    assert "data wait" in table and "utilization 83.3%" in table
    path = tmp_path / "wait.json"
    wt.to_json(path)
    name, doc = load_timer_file(str(path))
    assert doc["kind"] == "tierio.waittimer" and len(doc["steps"]) == 12
    verdicts = {f.check: f.verdict for f in timer_findings(name, doc)}
    assert verdicts["data-wait variance"] == OK
    assert verdicts["data-wait share"] != OK             # 1/6 of the time waiting
    assert "checkpoint stall" not in verdicts


@dataclass
class Handle:
    """Shaped like a checkpoint manager's save() result."""

    blocking_seconds: float
    staged: Future = field(default_factory=Future)
    persisted: Future = field(default_factory=Future)
    promoted: Future = field(default_factory=Future)


def test_step_timer_checkpoint_block_and_futures(tmp_path):
    clock = ManualClock()
    timer = StepTimer(clock=clock)
    handles = []
    for step in timer.wrap(SlowLoader(clock, [0.01] * 30)):
        clock.tick(1.0)
        if step in (10, 20):
            with timer.checkpoint() as ck:
                clock.tick(0.5)
                ck.handle = Handle(0.5)
            handles.append(ck.handle)
    s = timer.summary()
    assert s["checkpoints"] == 2
    assert s["checkpoint_stall"]["sum"] == pytest.approx(1.0)
    assert timer.steps[10].checkpoint_stall == pytest.approx(0.5)
    assert timer.steps[10].compute == pytest.approx(1.0)
    # stages complete later, on another thread, as a background writer would
    clock.tick(3.0)
    with ThreadPoolExecutor(2) as pool:
        for h in handles:
            pool.submit(h.staged.set_result, None).result()
            pool.submit(h.persisted.set_result, None).result()
            pool.submit(h.promoted.set_exception, OSError("bucket gone")).result()
    events = timer.summary()["checkpoint_events"]
    assert events[0]["persisted_at"] == pytest.approx(clock.t - 100.0)
    assert "promoted failed: bucket gone" in events[0]["error"]
    path = tmp_path / "steps.json"
    timer.to_json(path)
    name, doc = load_timer_file(str(path))
    verdicts = {f.check: f.verdict for f in timer_findings(name, doc)}
    # 1 s of stall in ~30 s of steps = 3.4% > 1%
    assert verdicts["checkpoint stall"] == ALERT
    assert verdicts["step-time variance"] == OK


def test_step_timer_record_checkpoint_handle():
    clock = ManualClock()
    timer = StepTimer(clock=clock)
    for step in timer.wrap(SlowLoader(clock, [0.0] * 12)):
        clock.tick(2.0)
        if step == 5:
            clock.tick(0.25)                             # the save ran (not wrapped)...
            timer.record_checkpoint(Handle(0.25))        # ...and its handle says how long it blocked
    assert timer.steps[5].checkpoint_stall == pytest.approx(0.25)
    assert timer.steps[5].compute == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="blocking_seconds"):
        timer.record_checkpoint(object())
    # inside a checkpoint() block the handle is attached, not charged twice
    with timer.checkpoint():
        clock.tick(0.1)
        assert timer.record_checkpoint(Handle(0.1)) is None
    assert timer.checkpoints[-1].blocking_seconds == pytest.approx(0.1)


def test_step_variance_alert_from_contended_steps(tmp_path):
    clock = ManualClock()
    timer = StepTimer(clock=clock)
    waits = [0.01] * 100
    for i in range(0, 100, 25):
        waits[i] = 8.0                                   # an OST hotspot every 25 steps
    for _ in timer.wrap(SlowLoader(clock, waits)):
        clock.tick(1.0)
    s = timer.summary()
    assert s["step"]["p99"] / s["step"]["p50"] > 3
    doc = json.loads(json.dumps(timer.to_dict()))
    verdicts = {f.check: f.verdict for f in timer_findings("t", doc)}
    assert verdicts["step-time variance"] == ALERT
    assert verdicts["data-wait variance"] == ALERT


def test_real_clock_and_sync_callable():
    calls = []
    timer = StepTimer(sync=lambda: calls.append(1))
    for _ in timer.wrap(range(3)):
        time.sleep(0.001)
        with timer.checkpoint():
            pass
    assert len(timer.steps) == 3 and len(calls) >= 6
    for r in timer.steps:
        assert r.total >= r.data_wait + r.checkpoint_stall
        assert r.compute > 0


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    clock = ManualClock()
    timer = StepTimer(clock=clock)
    for step in timer.wrap(SlowLoader(clock, [0.05] * 20)):
        clock.tick(0.5)
        if step == 10:
            with timer.checkpoint() as ck:
                clock.tick(0.3)
                ck.handle = Handle(0.3)
            ck.handle.persisted.set_result(None)
    out = tmp_path / "timeline.png"
    timer.plot(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="no steps"):
        StepTimer().plot(tmp_path / "empty.png")


def test_callbacks_from_threads_are_safe():
    timer = StepTimer()
    handles = [Handle(0.0) for _ in range(50)]
    for h in handles:
        timer.step_done()
        timer.record_checkpoint(h)
    threads = [threading.Thread(target=h.persisted.set_result, args=(None,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e["persisted_at"] is not None for e in timer.summary()["checkpoint_events"])
