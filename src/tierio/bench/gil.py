"""What a checkpoint in the background costs a Python-heavy training step (the GIL tax).

A step of many small tensor ops and Python bookkeeping (no large matmul: the kind of step a GIL
stalls most) is timed over and over:

  idle          nothing else runs (the steps just before and after each scenario below)
  tierio        while a CheckpointManager save persists to tier 0 and promotes to tier 1 behind it
                (the default: its byte loops run in the persist process, ``io.offload``)
  tierio_one    the same with one tier: the same work as DCP's (write once), no promotion copy
  tierio_threads
                the two-tier save with ``persist_process=False``: every byte loop on threads of
                this process, each return from one a GIL handover
  tierio_level  the two-tier save on threads with ``background_nice=0``: ordinary threads, at the
                step's priority and moving bytes in the foreground's shorter requests (what
                io.background buys: a contended core and fewer GIL handovers)
  dcp_thread    while ``dcp.async_save`` writes with its thread-based checkpointer
  dcp_process   while ``dcp.async_save`` writes with ``AsyncCheckpointerType.PROCESS`` (a process
                of its own: the reference for "off the training interpreter")

Each background scenario times the steps from the save's return until it is done (durable and,
for tierio, promoted), and ``IDLE_STEPS`` idle steps just before and just after it: this VM's
step time jumps between two levels (about 8 and 14 ms) from one second to the next, so each run
is judged against the idle steps around it, not against idle steps of another moment. Runs are
interleaved across the scenarios (``common.alternate``); each ratio is the median over the rounds:

  step_during_persist_vs_idle     idle median ÷ median while tierio persists and promotes (1.0: no tax)
  step_slowdown_vs_dcp_process    that figure ÷ the same for DCP's process-based async save
  step_during_dcp_thread_vs_idle  idle median ÷ median while DCP's thread-based async save writes
  step_one_tier_vs_dcp_process    tierio with one tier ÷ DCP's process: the same bytes written once
  step_threads_vs_dcp_process     tierio on threads ÷ DCP's process
  step_level_priority_vs_dcp_process
                                  tierio with its threads at the step's priority ÷ DCP's process

tierio's manager lives for the whole run, as in a training job (one warm-up save first: its
staging and promotion buffers are allocated once and reused); DCP's saves are its steady state too.

The step's own count of waits, which the VM's drift does not move: ``gil_waits_per_step`` is, per
scenario, the median over the rounds of the step thread's voluntary context switches per busy step
(Linux, ``/proc/thread-self/status``). The step makes no system call that blocks, so each one is a
wait for the GIL (idle: 0): each time a background thread got the GIL back from a call that
released it, the step waited once. With the persist process (``io.offload``) the byte loops send
one request each and most of those returns are gone; on threads (``tierio_threads``) a two-tier
512 MiB save makes a few hundred. ``preempted_per_step`` counts the step's involuntary switches: a
core taken by someone else (it varies from run to run for every scenario on this VM).

``background_python`` profiles every background thread of one steady-state save: its time in
Python frames (bytecode: the GIL held; ``python_seconds``, inflated by the profiler itself)
against the seconds the save ran behind training (``python_share``).
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import shutil
import threading
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tierio.bench import common
from tierio.storage.seaweed import free_port

TARGETS = {"step_during_persist_vs_idle": (">=", 0.9), "step_slowdown_vs_dcp_process": (">=", 1.0)}
MIN_STEPS = 5  # a save shorter than this many steps is timed over this many
IDLE_STEPS = 20  # idle steps timed before and after each background run


def python_heavy_step(xs: list[torch.Tensor]) -> float:
    """About 20 ms of small ops: each a few microseconds of kernel and many of interpreter."""
    total = 0.0
    for _ in range(8):
        for i, x in enumerate(xs):
            xs[i] = x.mul(0.999).add_(0.001)
            total += i * 0.5
    return total


def _timed_step(xs: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    python_heavy_step(xs)
    return time.perf_counter() - t0


def _steps_while(busy: Callable[[], bool], xs: list[torch.Tensor], waits: list[tuple[float, float]]) -> list[float]:
    """Steps timed until ``busy()`` is false (at least MIN_STEPS); ``waits`` gets the step thread's
    (voluntary, involuntary) context switches per step (its GIL waits, its core taken), where the
    system tells them."""
    times: list[float] = []
    before = _switches()
    while busy() or len(times) < MIN_STEPS:
        times.append(_timed_step(xs))
    after = _switches()
    if before is not None and after is not None:
        waits.append(((after[0] - before[0]) / len(times), (after[1] - before[1]) / len(times)))
    return times


def _switches() -> tuple[int, int] | None:
    """This thread's voluntary and involuntary context switches so far (Linux), else None."""
    got: dict[str, int] = {}
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    got[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        return None
    return (got["voluntary_ctxt_switches"], got["nonvoluntary_ctxt_switches"]) if len(got) == 2 else None


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    per = 16 << 20
    return {f"t{i}": torch.rand(per // 4) for i in range(max(1, nbytes // per))}


def _group() -> None:
    """A one-rank gloo group: DCP's process-based async save needs one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def measure(nbytes: int, work: Path, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    _group()
    state = _state(nbytes)
    xs = [torch.rand(16) for _ in range(120)]
    python_heavy_step(xs)  # warm
    step = [0]

    waits: dict[str, list[tuple[float, float]]] = {}  # scenario -> the step's switches per step, one pair a round

    def judged(name: str, busy_run: Callable[[list[tuple[float, float]]], list[float]]) -> Callable[[], float]:
        """Idle steps, the steps of one background run, idle steps again: idle median ÷ busy median
        (the run's GIL waits per step go to ``waits[name]``)."""
        def run() -> float:
            before = [_timed_step(xs) for _ in range(IDLE_STEPS)]
            busy = busy_run(waits.setdefault(name, []))
            after = [_timed_step(xs) for _ in range(IDLE_STEPS)]
            return statistics.median(before + after) / statistics.median(busy)
        return run

    def tierio_on(manager: Any) -> Callable[[list[tuple[float, float]]], list[float]]:
        def run(waits: list[tuple[float, float]]) -> list[float]:
            step[0] += 1
            handle = manager.save(step[0], state)
            times = _steps_while(lambda: not handle.done(), xs, waits)
            handle.wait()
            return times
        return run

    def dcp_run(kind: Any) -> Callable[[list[tuple[float, float]]], list[float]]:
        def run(waits: list[tuple[float, float]]) -> list[float]:
            step[0] += 1
            target = work / f"dcp-{kind.value}"
            shutil.rmtree(target, ignore_errors=True)
            fut = dcp.async_save(state, checkpoint_id=str(target), async_checkpointer_type=kind)
            done = getattr(fut, "upload_completion", fut)
            times = _steps_while(lambda: not done.done(), xs, waits)
            done.result()
            return times
        return run

    # Each tier keeps its newest step only: the disk holds two copies whatever the rounds.
    tiers = [Tier(work / "t0", KeepLast(1)), Tier(work / "t1", KeepLast(1))]
    with _profiled_threads() as profiles, CheckpointManager(tiers, min_keep=1) as traced:
        background = _background_python(traced, state, step, profiles)
    # the timed ones run unprofiled
    one_tier = [Tier(work / "one", KeepLast(1))]
    level_tiers = [Tier(work / "level0", KeepLast(1)), Tier(work / "level1", KeepLast(1))]
    thread_tiers = [Tier(work / "threads0", KeepLast(1)), Tier(work / "threads1", KeepLast(1))]
    with CheckpointManager(tiers, min_keep=1) as mgr, CheckpointManager(one_tier, min_keep=1) as one, \
            CheckpointManager(thread_tiers, min_keep=1, persist_process=False) as threads, \
            CheckpointManager(level_tiers, min_keep=1, background_nice=0, persist_process=False) as level:
        for manager in (mgr, one, threads, level):
            step[0] += 1
            manager.save(step[0], state).wait()  # allocates its buffers, as a job's first save does
        log(f"Python-heavy steps: idle, and while tierio (two tiers, one tier; on threads, and at the step's priority) / "
            f"DCP (thread, process) save {nbytes >> 20} MiB; {rounds} rounds")
        scenarios = {"tierio": tierio_on(mgr), "tierio_one": tierio_on(one), "tierio_threads": tierio_on(threads),
                     "tierio_level": tierio_on(level),
                     "dcp_thread": dcp_run(AsyncCheckpointerType.THREAD),
                     "dcp_process": dcp_run(AsyncCheckpointerType.PROCESS)}
        got = common.alternate({name: judged(name, busy) for name, busy in scenarios.items()}, rounds)
    med = {k: statistics.median(v) for k, v in got.items()}  # idle ÷ busy, per scenario
    ratios = {"step_during_persist_vs_idle": med["tierio"],
              "step_slowdown_vs_dcp_process": med["tierio"] / med["dcp_process"],
              "step_one_tier_vs_dcp_process": med["tierio_one"] / med["dcp_process"],
              "step_threads_vs_dcp_process": med["tierio_threads"] / med["dcp_process"],
              "step_level_priority_vs_dcp_process": med["tierio_level"] / med["dcp_process"],
              "step_during_dcp_thread_vs_idle": med["dcp_thread"]}
    return {"state_bytes": nbytes, "idle_vs_busy": med, "rounds": got, "cpus": os.cpu_count(),
            "gil_waits_per_step": {k: round(statistics.median(w for w, _ in v), 3) for k, v in waits.items() if v},
            "preempted_per_step": {k: round(statistics.median(p for _, p in v), 3) for k, v in waits.items() if v},
            "background_python": background,
            "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "met": common.check_targets(ratios, TARGETS)}


@contextlib.contextmanager
def _profiled_threads() -> Iterator[list[cProfile.Profile]]:
    """Every thread started inside the block runs under a profiler of its own (the list)."""
    profiles: list[cProfile.Profile] = []

    def start(*_: Any) -> None:
        profile = cProfile.Profile()  # replaces this hook for the thread that calls it
        profiles.append(profile)
        profile.enable()

    threading.setprofile(start)
    try:
        yield profiles
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]


def _python_seconds(profiles: list[cProfile.Profile]) -> tuple[float, int]:
    """Seconds spent in Python frames (own time, not in the C calls they make) and calls, summed."""
    seconds, calls = 0.0, 0
    for profile in profiles:
        for entry in profile.getstats():
            calls += entry.callcount
            if not isinstance(entry.code, str):  # a code object: bytecode, run with the GIL held
                seconds += entry.inlinetime
    return seconds, calls


def _background_python(mgr: Any, state: dict[str, torch.Tensor], step: list[int],
                       profiles: list[cProfile.Profile]) -> dict[str, Any]:
    """One warm-up save, then one steady-state save timed and split by the threads' profilers."""
    for warm in (True, False):
        before = _python_seconds(profiles)
        step[0] += 1
        t0 = time.perf_counter()
        mgr.save(step[0], state).wait()
        seconds = time.perf_counter() - t0
    after = _python_seconds(profiles)
    python = after[0] - before[0]
    return {"save_seconds": round(seconds, 3), "python_seconds": round(python, 4),
            "python_calls": after[1] - before[1], "python_share": round(python / seconds, 4),
            "threads": len(profiles)}
