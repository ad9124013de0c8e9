"""Preemption with real processes and real signals: SIGTERM becomes one emergency save that every
rank takes at the same step and that is durable before the process exits; a second SIGTERM during
it exits at once and the previous durable step restores. On node-local tiers the ranks exit once
every part is on its node, before the shared copy; the requeued job restores the step from the
nodes and commits it on the shared tier, or, when a node lost its part, the committed step."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierio.bench.preempt import DURABLE, free_port, start, state_of, tiers_of, wait_for
from tierio.ckpt import CheckpointManager, list_checkpoints
from tierio.ckpt.preempt import Preemption
from tierio.cli.main import main
from tierio.errors import ConfigError

from test_ckpt_buddy import Log  # the log lines of a spawned rank

MiB = 1 << 20


def last_step(proc) -> int:
    steps = [int(line.split()[1]) for line in proc.stdout if line.startswith("step ")]
    return steps[-1] if steps else -1


def restore(root: Path):
    with CheckpointManager([root]) as mgr:
        return mgr.restore()


def test_sigterm_becomes_one_durable_emergency_save_and_the_exit_code_of_sigterm(tmp_path):
    proc = start(tmp_path, 4 * MiB)
    seen = int(wait_for(proc, "step 3").split()[1])
    proc.send_signal(signal.SIGTERM)
    after = max(seen, last_step(proc))  # the signal may come before the loop's check of step 3
    assert proc.wait(60) == 143
    durable = DURABLE.search(proc.stderr.read())  # the job log says when the step was durable
    assert durable and int(durable.group(1)) == after and durable.group(3) == "SIGTERM"
    got = restore(tmp_path)
    assert got["step"] == after >= seen  # the step the loop reached when it saw the signal, nothing lost
    assert torch.equal(got["w"], state_of(after, 4 * MiB)["w"])


def test_a_signal_to_one_rank_of_two_saves_the_same_step_on_both(tmp_path, capsys):
    port = free_port()
    procs = [start(tmp_path, 2 * MiB, rank=r, world=2, port=port) for r in range(2)]
    wait_for(procs[1], "step 5")
    procs[1].send_signal(signal.SIGTERM)  # a scale-down: one rank told; the ranks agree through the store
    ends = [last_step(p) for p in procs]
    assert [p.wait(90) for p in procs] == [143, 143], [p.stderr.read() for p in procs]
    assert ends[0] == ends[1] > 5
    got = restore(tmp_path)
    assert got["step"] == ends[0] and torch.equal(got["w"], state_of(ends[0], 2 * MiB)["w"])
    with CheckpointManager([tmp_path]) as mgr:
        assert mgr.steps() == [ends[0]]  # one emergency step, written by both ranks
    assert [c.reason for c in list_checkpoints(tmp_path)] == ["emergency: SIGTERM"]  # recorded in the manifest
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    assert "emergency: SIGTERM" in capsys.readouterr().out  # and marked by `tierio ckpt ls`


def test_a_second_signal_during_the_emergency_save_exits_at_once_and_the_previous_step_restores(tmp_path):
    proc = start(tmp_path, 256 * MiB, save_every=2)
    wait_for(proc, "step 4")
    with CheckpointManager([tmp_path]) as mgr:  # the periodic save of step 2 is durable
        for _ in range(600):
            if mgr.steps():
                break
            time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    wait_for(proc, "tierio: emergency save", "stderr")
    proc.send_signal(signal.SIGTERM)
    line = wait_for(proc, "tierio: SIGTERM again", "stderr")
    assert "exiting at once" in line and proc.wait(60) == 143
    got = restore(tmp_path)  # a committed step, whole: never the half-written emergency one
    assert got["step"] % 2 == 0 and torch.equal(got["w"], state_of(got["step"], 256 * MiB)["w"])


def test_bad_signal_names_are_config_errors(tmp_path):
    with CheckpointManager([tmp_path]) as mgr:
        with pytest.raises(ConfigError, match="signal names such as 'SIGTERM'"):
            Preemption(mgr, signals=("SIGNOPE",))
        with Preemption(mgr, signals=("SIGUSR2",), exit_code=None) as p:
            assert not p.requested(1)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert p.signalled and p.requested(2)  # alone, the step is the current one
            handle = p.save(2, {"x": torch.ones(2)})
            assert handle.persisted.done() and p.stats.step == 2 and p.stats.signal == "SIGUSR2"
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # the previous handler is back


def test_a_save_not_durable_within_the_grace_period_says_so(tmp_path, capfd):
    with CheckpointManager([tmp_path]) as mgr:
        with Preemption(mgr, signals=("SIGUSR2",), grace_seconds=0, exit_code=None) as p:
            with pytest.raises(TimeoutError):
                p.save(1, {"w": torch.zeros(64 << 20)})  # 256 MiB: not on disk the instant it is staged
        assert "not durable within grace_seconds=0" in capfd.readouterr().err
        mgr.wait()  # the save itself goes on and lands
        assert mgr.steps() == [1]


NODE_BYTES = 640 << 10  # a rank's state: its first save fits promotion's 1 MiB burst, the next does not


def committed_on(root: Path, procs: list) -> list[int]:
    """The steps committed on ``root``, once there is one (the loop's first periodic save)."""
    for _ in range(1200):
        steps = [c.step for c in list_checkpoints(root)] if root.exists() else []
        if steps or any(p.poll() is not None for p in procs):
            return steps
        time.sleep(0.05)
    return []


def requeued(rank: int, root: str, init: str, emergency: int, committed: int) -> None:
    """The requeued job on the same two nodes: tree a restores the emergency step from the node tiers
    (and commits it on the shared tier as it closes); in tree b node 1 lost its parts after the
    committed step, which restores instead, and the log says why."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    lines = Log()
    logging.getLogger("tierio.ckpt").addHandler(lines)
    try:
        for tree, want in ((f"{root}/a", emergency), (f"{root}/b", committed)):
            with CheckpointManager(tiers_of(tree, rank, True), node=f"node{rank}", commit_timeout=60) as mgr:
                got = mgr.restore()
                assert got["step"] == want and torch.equal(got["w"], state_of(want, NODE_BYTES)["w"]), (tree, got["step"])
        why = f"step {emergency} is on node-local tiers but cannot be restored (no part of rank 1"
        assert rank != 0 or any(line.startswith(why) for line in lines.lines), lines.lines
    finally:
        dist.destroy_process_group()


def test_node_local_emergency_save_exits_before_the_shared_copy_and_the_requeued_job_restores_it(tmp_path, capsys):
    a, port = tmp_path / "a", free_port()
    # The shared tier takes 1 KB/s once the first periodic save (step 5) used promotion's burst.
    procs = [start(a, NODE_BYTES, rank=r, world=2, port=port, save_every=5, node_local=True, promote_bandwidth=1000)
             for r in range(2)]
    try:
        assert committed_on(a / "shared", procs) == [5], [p.stderr.read() for p in procs if p.poll() is not None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes, ends, logs = [p.wait() for p in procs], [last_step(p) for p in procs], [p.stderr.read() for p in procs]
    assert codes == [143, 143], logs
    durable = [DURABLE.search(text) for text in logs]
    emergency = ends[0]
    assert all(d and int(d.group(1)) == emergency for d in durable) and ends[1] == emergency > 5, logs
    assert all("durable in" in t and "(every rank's part on its node's tier 0)" in t for t in logs)
    # The ranks exited without the shared copy: the emergency step is only on the nodes.
    assert [c.step for c in list_checkpoints(a / "shared")] == [5]
    assert main(["ckpt", "ls", str(a / "node0"), "--shared", str(a / "shared")]) == 0
    out = capsys.readouterr().out
    assert any(str(emergency) in row and "node-local only" in row and "emergency: SIGTERM" in row
               for row in out.splitlines()), out
    shutil.copytree(a, tmp_path / "b")
    for d in (tmp_path / "b" / "node1").glob("step_*"):  # node 1 lost its parts after the committed step
        if int(d.name.split("_")[1]) > 5:
            shutil.rmtree(d)
    tmp.start_processes(requeued, args=(str(tmp_path), f"file://{tmp_path}/pg", emergency, 5), nprocs=2,
                        start_method="spawn")
    done = list_checkpoints(a / "shared")  # the requeued job committed the emergency step there
    assert [(c.step, c.reason) for c in done] == [(5, None), (emergency, "emergency: SIGTERM")]
    assert [c.step for c in list_checkpoints(tmp_path / "b" / "shared")] == [5]
