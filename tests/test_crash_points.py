"""Crash points enumerated, not sampled: every durable operation of a scenario recorded, then the
scenario killed before it (and, for local files, after it with every unsynced change dropped) and
checked in a fresh process (tierio.bench.crash). The suite runs a fixed, deterministic sample of
each scenario's points; `tierio bench crash` runs all of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierio.bench import crash
from tierio.bench.crash_scenarios import BY_NAME

# Points per scenario the suite crashes at (a deterministic sample; seed 0).
LIMITS = {"promote": 6, "ranks": 4, "incremental": 12, "takeover": 4, "weights": 12, "dataset": 12}

_runs: dict[str, crash.Report] = {}


def _enumerate(name: str, base: Path, seaweed) -> crash.Report:
    if name not in _runs:
        scenario = BY_NAME[name]
        s3, env = None, {}
        if scenario.s3:
            s3, env = seaweed.url(f"crash-{os.getpid()}"), dict(seaweed.env())
            from tierio.storage import S3Store

            store = S3Store(f"crash-{os.getpid()}", endpoint=seaweed.endpoint)
            store.create_bucket()
            store.close()
        _runs[name] = crash.enumerate_scenario(scenario, base / name, limit=LIMITS[name], jobs=2, s3_endpoint_url=s3, env=env)
    return _runs[name]




@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("crash")


@pytest.mark.parametrize("name", list(LIMITS))
def test_crash_points(name: str, base: Path, seaweed) -> None:
    report = _enumerate(name, base, seaweed)
    assert report.operations > 0 and report.points >= report.operations, "nothing was recorded"
    assert report.run == min(LIMITS[name], report.points)
    assert report.unreached < report.run, "the crash runs never reached their points"
    assert not report.failed, report.failed


def test_a_step_reported_persisted_survives_a_power_loss(tmp_path: Path) -> None:
    """Step 2 was reported persisted (and promoted) before step 3's save began; a power loss as
    step 3's directory is made must not take step 2 with it (found by the enumeration: new step
    directories were never fsynced into their tier's directory)."""
    point = crash.Point("main", "mkdir nvme/step_000000003", 0, "after-drop")
    out, _ = crash.run_trial(BY_NAME["incremental"], tmp_path, point)
    assert out.result == "ok", out.problems


def test_a_power_loss_drops_what_was_not_synced(tmp_path: Path) -> None:
    """The harness itself: a file renamed into place without a directory fsync, and written
    without a file fsync, is undone by the after-drop variant, and kept by the before variant."""
    scenario = crash.Scenario("probe", _probe_run, _probe_check)
    rec, ctx = crash.run_trial(scenario, tmp_path, None, keep=True)
    assert rec.result == "ok", rec.problems
    _, points = crash.points_of(ctx)
    sigs = [p.sig for p in points if p.variant == "before"]
    assert sigs == ["create d/.f.tmp", "write d/.f.tmp @0", "fsync d/.f.tmp", "rename d/.f.tmp -> d/f",
                    "write d/f @3", "fsync-dir d", "unlink d/old"], sigs
    last = crash.Point("main", "unlink d/old", 0, "after-drop")
    out, ctx = crash.run_trial(scenario, tmp_path, last, keep=True)
    # The write after the fsync and the unlink (its directory not synced since) are both undone.
    assert out.result == "failed" and out.problems == ["f=abc old=there"], out
    out, ctx = crash.run_trial(scenario, tmp_path, crash.Point("main", "fsync-dir d", 0, "after-drop"), keep=True)
    assert out.problems == ["f=abc old=there"], out
    out, ctx = crash.run_trial(scenario, tmp_path, crash.Point("main", "rename d/.f.tmp -> d/f", 0, "after-drop"), keep=True)
    assert out.problems == ["f=none old=there"], out  # the rename was never made durable
    out, ctx = crash.run_trial(scenario, tmp_path, crash.Point("main", "unlink d/old", 0, "before"), keep=True)
    assert out.problems == ["f=abcdef old=there"], out  # a kill keeps the page cache


def _probe_run(ctx: crash.Ctx) -> None:
    d = ctx.root / "d"
    d.mkdir()
    (d / "old").write_bytes(b"x")
    ctx.arm()
    fd = os.open(d / ".f.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.pwrite(fd, b"abc", 0)
    os.fsync(fd)
    os.rename(d / ".f.tmp", d / "f")
    os.pwrite(fd, b"def", 3)
    os.close(fd)
    dfd = os.open(d, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    os.unlink(d / "old")


def _probe_check(ctx: crash.Ctx) -> list[str]:
    d = ctx.root / "d"
    f = (d / "f").read_bytes().decode() if (d / "f").exists() else "none"
    if f == "abcdef" and not (d / "old").exists():
        return []
    return [f"f={f} old={'there' if (d / 'old').exists() else 'gone'}"]
