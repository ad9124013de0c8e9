"""Preemption with real processes and real signals: SIGTERM becomes one emergency save that every
rank takes at the same step and that is durable before the process exits; a second SIGTERM during
it exits at once and the previous durable step restores."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tierio.bench.preempt import DURABLE, free_port, start, state_of, wait_for
from tierio.ckpt import CheckpointManager, list_checkpoints
from tierio.ckpt.preempt import Preemption
from tierio.cli.main import main
from tierio.errors import ConfigError

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
