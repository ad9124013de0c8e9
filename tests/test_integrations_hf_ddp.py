"""The Hugging Face Trainer on two DDP processes (torchrun, gloo) through tierio: every rank saves,
the replicated model and optimizer state written once overall and spread evenly; a run killed with
SIGKILL mid-training and then preempted with SIGTERM at a random moment resumes bit-exact against
an uninterrupted DDP run of the stock Trainer; its checkpoint restores whole on one process."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import training_jobs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tierio.ckpt import inspect, list_checkpoints, verify  # noqa: E402
from tierio.integrations.checkpoints import Pointer, restore  # noqa: E402


def torchrun(root: Path, tiers: list[str] | None, *extra: str):
    return training_jobs.torchrun("hf", root, tiers, 12, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock Trainer on 2 processes, never interrupted: its checkpoints and final weights."""
    root = tmp_path_factory.mktemp("ref")
    ref = torchrun(root, None, "--keep-all")
    assert ref.returncode == 0, ref.stderr[-3000:]
    return root


def assert_same_final(want: Path, got: Path) -> None:
    a, b = load_file(str(want / "final.safetensors")), load_file(str(got / "final.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(b[k], a[k]), k


def test_ddp_training_killed_resumes_bit_exact_with_the_state_spread_over_the_ranks(tmp_path: Path,
                                                                                    reference: Path) -> None:
    root = tmp_path / "job"
    # Two tiers: the resumed ranks also promote what the killed run left (a stale marker of the dead
    # run once let rank 0 commit before rank 1's own marker, and rank 1 waited for it forever).
    tiers = [str(root / "t0"), str(root / "t1")]
    killed = torchrun(root, tiers, "--kill-at", "7")
    assert killed.returncode != 0
    folders = sorted(p.name for p in (root / "out").glob("checkpoint-*"))
    assert folders and set(folders) <= {"checkpoint-3", "checkpoint-6"}, folders  # only durable ones

    pointer = Pointer.read(root / "out" / folders[-1] / "tierio.json")
    man = inspect(tiers[0], pointer.step)
    assert man.world_size == 2
    written = [sum(t.nbytes for t in r.tensors.values() if t.is_global) for r in man.ranks]
    # once overall, about half a rank (tied embeddings are one tensor, stored under both names)
    assert max(written) <= 1.1 * sum(written) / 2, written
    gstep = int(folders[-1].split("-")[1])
    alone = restore(tiers, pointer, folders[-1], rank=0, world_size=1, per_rank="own")  # one process, whole tensors
    plain = load_file(str(reference / "out" / f"checkpoint-{gstep}" / "model.safetensors"))
    for k, v in plain.items():
        assert torch.equal(alone["model"][k], v), k

    preempt(root, tiers)  # the resumed run, preempted in turn
    resumed = torchrun(root, tiers, "--preempt", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_final(reference, root)  # parameters, optimizer, scheduler and RNG carried over, twice
    last = Pointer.read(root / "out" / "checkpoint-12" / "tierio.json").step
    assert all(last in {c.step for c in list_checkpoints(t)} for t in tiers)  # train() returned: promoted

    # An elastic restart on another world size: one process resumes the 2-rank checkpoint and goes on,
    # with the same global batch (hf_position: the step count means the same samples).
    alone = training_jobs.torchrun("hf", root, tiers, 15, "--resume", "--accum", "2", nprocs=1)
    assert alone.returncode == 0, alone.stderr[-3000:]
    state = json.loads((root / "out" / "checkpoint-15" / "trainer_state.json").read_text())
    assert state["global_step"] == 15



def preempt(root: Path, tiers: list[str]) -> None:
    """Resume the run, SIGTERM every rank at a random moment: one emergency step, published."""
    moment = random.Random(27)  # a moment the test does not choose, the same on every run
    at_step, delay = moment.randint(7, 9), moment.uniform(0, 0.05)
    # the ranks wait after that step until the signal is sent: a step takes ~50 ms, and on a busy
    # machine the test read the step's line only after the job had finished
    job = training_jobs.torchrun("hf", root, tiers, 12, "--preempt", "--resume", "--print-steps",
                                 "--hold-at", str(at_step), popen=True)
    pids: dict[int, int] = {}
    for line in job.stdout:
        if line.startswith("pid "):
            pids[int(line.split()[1])] = int(line.split()[2])
        if line.strip() == f"step {at_step}":
            break
    time.sleep(delay)
    for pid in pids.values():  # as a scheduler does: every rank of the job
        os.kill(pid, signal.SIGTERM)
    (root / "released").touch()
    out = job.communicate(timeout=180)[0]
    # each rank exits with 143 once the step is published (rank 0) / committed, as torchrun reports
    assert len(pids) == 2 and len(re.findall(r"tierio: step \d+ durable in .* after SIGTERM", out)) == 2, out[-3000:]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and set(codes) == {"143"}, out[-3000:]

    emergency = max(int(p.name.split("-")[1]) for p in (root / "out").glob("checkpoint-*"))
    # the signal lands while the ranks wait after at_step: saved at its end or the next step's
    assert at_step <= emergency <= at_step + 1, (at_step, emergency)
    listed = {c.step: c.reason for c in list_checkpoints(tiers[0])}
    assert listed[Pointer.read(root / "out" / f"checkpoint-{emergency}" / "tierio.json").step] == "emergency: SIGTERM"
    assert all(verify(tiers[0], step).ok for step in listed)  # a save in flight at the signal: whole or absent
