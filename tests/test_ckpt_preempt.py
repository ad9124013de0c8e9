"""Preemption with real processes and real signals: SIGTERM becomes one emergency save that every
rank takes at the same step and that is durable before the process exits; a second SIGTERM during
it exits at once and the previous durable step restores."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierio.ckpt import CheckpointManager
from tierio.ckpt.preempt import Preemption
from tierio.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from preempt_worker import state_of  # noqa: E402

WORKER = str(Path(__file__).parent / "preempt_worker.py")


def start(root: Path, mib: int, *, rank: int = 0, world: int = 1, port: int = 0, extra: tuple = ()) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    return subprocess.Popen([sys.executable, WORKER, str(root), str(mib), *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(proc: subprocess.Popen, prefix: str, stream: str = "stdout") -> str:
    for line in getattr(proc, stream):
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the worker ended before printing {prefix!r}: {proc.wait()} {proc.stderr.read()}")


def last_step(proc: subprocess.Popen) -> int:
    steps = [int(line.split()[1]) for line in proc.stdout if line.startswith("step ")]
    return steps[-1] if steps else -1


def restore(root: Path):
    with CheckpointManager([root]) as mgr:
        return mgr.restore()


def test_sigterm_becomes_one_durable_emergency_save_and_the_exit_code_of_sigterm(tmp_path):
    proc = start(tmp_path, 4)
    seen = int(wait_for(proc, "step 3").split()[1])
    proc.send_signal(signal.SIGTERM)
    after = last_step(proc)
    assert proc.wait(60) == 143, proc.stderr.read()
    got = restore(tmp_path)
    assert got["step"] == after >= seen  # the step the loop reached when it saw the signal, nothing lost
    assert torch.equal(got["w"], state_of(after, 4)["w"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_signal_to_one_rank_of_two_saves_the_same_step_on_both(tmp_path):
    port = _free_port()
    procs = [start(tmp_path, 2, rank=r, world=2, port=port) for r in range(2)]
    wait_for(procs[1], "step 5")
    procs[1].send_signal(signal.SIGTERM)  # a scale-down: one rank told; the ranks agree through the store
    ends = [last_step(p) for p in procs]
    assert [p.wait(90) for p in procs] == [143, 143], [p.stderr.read() for p in procs]
    assert ends[0] == ends[1] > 5
    got = restore(tmp_path)
    assert got["step"] == ends[0] and torch.equal(got["w"], state_of(ends[0], 2)["w"])
    with CheckpointManager([tmp_path]) as mgr:
        assert mgr.steps() == [ends[0]]  # one emergency step, written by both ranks


def test_a_second_signal_during_the_emergency_save_exits_at_once_and_the_previous_step_restores(tmp_path):
    proc = start(tmp_path, 256, extra=("--save-every", "2"))
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
    assert got["step"] % 2 == 0 and torch.equal(got["w"], state_of(got["step"], 256)["w"])


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
