"""Every crash point of a scenario, enumerated (ALICE / CrashMonkey style) instead of sampled.

A scenario runs once in a child process that records each durable operation it makes under its
trial directory and on S3: file creates, writes, truncates, fsyncs, renames, links, unlinks,
mkdirs and rmdirs (by wrapping the ``os`` functions and ``open`` in that child only) and S3 PUTs
(conditional or not), multipart completes, copies and DELETEs (botocore's API call). Then, for
every operation k, the scenario runs again in a fresh child that dies by SIGKILL:

* ``before`` k: the process dies just before the operation (its page cache survives, as it does
  when a job is killed);
* ``after-drop`` k (local operations that leave something unsynced): right after the operation,
  with every change not yet made durable undone first, as a power loss would: each file written
  since its last fsync gets back its content of then, and each name changed in a directory since
  that directory's last fsync gets back its entry of then (a file, a directory, or nothing).

A fresh process then runs the scenario's check (restores, listings, a later save). A point is
named by its operation's signature (kind and paths relative to the trial, random parts of names
masked) and its occurrence, so the threads of a save and of its promotion may interleave
differently in each run and the point still means the same operation. A point a rerun never
reaches is counted as unreached, not as a failure.

``tierio bench crash`` runs every scenario of ``tierio.bench.crash_scenarios``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import stat
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierio.bench import options
from tierio.bench.crash_recorder import (  # noqa: F401  (Ctx, Point, Scenario are this module's names too)
    CRASHED,
    Ctx,
    Point,
    Scenario,
    TRIAL_TIMEOUT,
    _o,
)


def _quiet(ctx: Ctx, name: str) -> None:
    """The child's output (warnings of a recovery, say) goes to its control directory."""
    fd = _o["open"](ctx.control / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _trial_child(scenario: Scenario, ctx: Ctx) -> None:
    os.setpgid(0, 0)  # the trial's own group: a crash kills it and every rank it started, nothing else
    ctx.group = os.getpid()
    (ctx.control / "group").write_text(str(ctx.group))
    os.environ.update(ctx.env)
    _quiet(ctx, "run.log")
    try:
        scenario.run(ctx)
    except BaseException:
        (ctx.control / "error.txt").write_text(traceback.format_exc())
        os._exit(3)
    os._exit(0)


def _wait_group_gone(control: Path, timeout: float = 60.0) -> None:
    """Wait until no process of the trial's group exists, zombies included: the ranks a crash
    killed are orphans until init reaps them, and a lease whose holder's pid still exists is
    (rightly) not taken over as dead, so the check would wait out its expiry."""
    try:
        group = int((control / "group").read_text())
    except (FileNotFoundError, ValueError):
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = False
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[2]) == group:
                    alive = True
                    break
            except (OSError, IndexError, ValueError):
                continue
        if not alive:
            return
        time.sleep(0.05)


def _check_child(scenario: Scenario, ctx: Ctx) -> None:
    os.environ.update(ctx.env)
    _quiet(ctx, "check.log")
    try:
        problems = scenario.check(ctx)
    except BaseException:
        problems = [f"check raised: {traceback.format_exc(limit=6)}"]
    (ctx.control / "check.json").write_text(json.dumps(problems))
    os._exit(0)


def _in_child(target: Callable[..., None], *args: Any, timeout: float = TRIAL_TIMEOUT) -> int | None:
    """Run ``target(*args)`` in a fresh child forked from the warm fork server; its exit code (None: hung)."""
    p = _context().Process(target=target, args=args)
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the trial's group (its ranks too), when it made one
        except ProcessLookupError:
            pass
        p.kill()
        p.join()
        return None
    return p.exitcode


_ctx: Any = None


def _context() -> Any:
    """A fork server with torch and tierio imported: each trial is a fork of it (milliseconds)
    instead of a new interpreter importing torch (seconds)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "botocore.client", "tierio.ckpt", "tierio.weights", "tierio.data",
                                     "tierio.bench.crash", "tierio.bench.crash_scenarios"])
    return _ctx


@dataclass
class Outcome:
    point: Point | None
    result: str  # "ok" | "failed" | "unreached"
    problems: list[str] = field(default_factory=list)


def run_trial(scenario: Scenario, base: Path, point: Point | None, *, s3_endpoint_url: str | None = None,
              env: dict[str, str] | None = None, keep: bool = False) -> tuple[Outcome, Ctx]:
    """One run of ``scenario`` that crashes at ``point`` (records, when None), then its check."""
    trial = f"t{uuid.uuid4().hex[:10]}"
    ctx = Ctx(root=base / trial / "root", control=base / trial / "control", env=dict(env or {}), point=point)
    ctx.root.mkdir(parents=True)
    ctx.control.mkdir()
    if scenario.s3:
        if s3_endpoint_url is None:
            raise ValueError(f"scenario {scenario.name} needs an S3 store")
        bucket_path, _, query = s3_endpoint_url.removeprefix("s3://").partition("?")
        ctx.s3_prefix = f"{bucket_path.split('/', 1)[1]}/{trial}" if "/" in bucket_path else trial
        ctx.s3_url = f"s3://{bucket_path}/{trial}/data" + (f"?{query}" if query else "")
    code = _in_child(_trial_child, scenario, ctx)
    _wait_group_gone(ctx.control)
    if code == 255 and (ctx.control / "crashed").exists():
        code = CRASHED
    problems: list[str] = []
    if (ctx.control / "drop-failed.txt").exists():
        problems.append(f"the power loss could not be simulated: {(ctx.control / 'drop-failed.txt').read_text()}")
    if code is None:
        problems.append("the run hung")
    elif code not in (0, CRASHED):
        err = ctx.control / "error.txt"
        problems.append(f"the run failed (exit {code}): {err.read_text() if err.exists() else ''}")
    if not problems:
        if _in_child(_check_child, scenario, ctx) is None:
            problems.append("the check hung")
        else:
            problems.extend(json.loads((ctx.control / "check.json").read_text()))
    result = "failed" if problems else ("unreached" if point is not None and code == 0 else "ok")
    if not keep and not problems:
        shutil.rmtree(base / trial, ignore_errors=True)
    return Outcome(point, result, problems), ctx


def points_of(ctx: Ctx) -> tuple[int, list[Point]]:
    """The recorded operations' count and their crash points (both variants where they differ)."""
    ops = 0
    out: list[Point] = []
    for log in sorted(ctx.control.glob("ops-*.jsonl")):
        label = log.stem.removeprefix("ops-")
        for line in log.read_text().splitlines():
            op = json.loads(line)
            ops += 1
            out.append(Point(label, op["sig"], op["nth"], "before"))
            if op["pending"]:
                out.append(Point(label, op["sig"], op["nth"], "after-drop"))
    return ops, out


@dataclass
class Report:
    scenario: str
    operations: int
    points: int
    run: int
    failures: int
    unreached: int
    seconds: float
    failed: list[dict[str, Any]] = field(default_factory=list)


def enumerate_scenario(scenario: Scenario, base: Path, *, limit: int | None = None, seed: int = 0, jobs: int = 1,
                       s3_endpoint_url: str | None = None, env: dict[str, str] | None = None,
                       log: Callable[[str], None] = lambda m: None) -> Report:
    """Record ``scenario``, then crash it at each of its points (``limit``: a deterministic sample
    of that many) and check each crash; failures are kept on disk under ``base``."""
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    rec, ctx = run_trial(scenario, base, None, s3_endpoint_url=s3_endpoint_url, env=env, keep=True)
    ops, points = points_of(ctx)
    shutil.rmtree(ctx.root.parent, ignore_errors=True)
    chosen = points if limit is None or limit >= len(points) else sorted(random.Random(seed).sample(points, limit), key=points.index)
    log(f"{scenario.name}: {ops} operations, {len(points)} crash points, running {len(chosen)}")
    outcomes = [rec]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for o in pool.map(lambda p: run_trial(scenario, base, p, s3_endpoint_url=s3_endpoint_url, env=env)[0], chosen):
            outcomes.append(o)
            if o.result == "failed":
                log(f"{scenario.name}: FAILED at {o.point}: {'; '.join(o.problems)[:600]}")
    failed = [o for o in outcomes if o.result == "failed"]
    return Report(scenario.name, ops, len(points), len(chosen), len(failed), sum(o.result == "unreached" for o in outcomes),
                  round(time.monotonic() - t0, 1),
                  [{"point": str(o.point) if o.point else "no crash", "problems": o.problems} for o in failed])


# -- `tierio bench crash` --------------------------------------------------------------------------
TARGETS = {"failures": ("<=", 0)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tierio.bench.common import logger, work_dir
    from tierio.bench.crash_scenarios import SCENARIOS
    from tierio.storage.seaweed import SeaweedServer

    say = logger("crash")
    wanted = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    base = work_dir(args.dir, "crash")
    server = None
    env: dict[str, str] = {}
    s3 = None
    try:
        if any(s.s3 for s in wanted):
            server = SeaweedServer()
            server.start()
            env = dict(server.env())
            os.environ.update(env)
            from tierio.storage import S3Store

            bucket = f"crash-{uuid.uuid4().hex[:8]}"
            store = S3Store(bucket, endpoint=server.endpoint)
            store.create_bucket()
            store.close()
            s3 = server.url(bucket)
        reports = [enumerate_scenario(s, base / s.name, limit=args.limit, jobs=args.jobs, s3_endpoint_url=s3, env=env, log=say)
                   for s in wanted]
    finally:
        if server is not None:
            server.close()
    print_reports(reports, sys.stderr)
    total = sum(r.failures for r in reports)
    if not total:
        shutil.rmtree(base, ignore_errors=True)
    return {"scenarios": [asdict(r) for r in reports], "ratios": {"failures": total},
            "points": sum(r.points for r in reports), "seconds": round(sum(r.seconds for r in reports), 1),
            "kept": None if not total else str(base)}


def print_reports(reports: list[Report], out: Any = sys.stdout) -> None:
    cols = ("scenario", "operations", "points", "run", "failures", "unreached", "seconds")
    rows = [tuple(str(getattr(r, c)) for c in cols) for r in reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    for row in (cols, *rows):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=out)
    for r in reports:
        for f in r.failed[:5]:
            print(f"FAILED {r.scenario} at {f['point']}: {'; '.join(f['problems'])[:400]}", file=out)


def main(argv: list[str] | None = None) -> int:
    """``python -m tierio.bench.crash``: the table on stderr, the JSON on stdout."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.crash(p)
    result = run(p.parse_args(argv))
    print(json.dumps(result, indent=1))
    return 1 if result["ratios"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
