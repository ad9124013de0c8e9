"""Elastic restarts and preemption of the Hugging Face Trainer through tierio, with real torchrun
processes (gloo) and real signals. Four ranks are preempted by SIGTERM while a periodic save is in
flight: that save completes or is not listed, and the emergency step after it is published. It
resumes on one process and on two, with the same global batch (``integrations.hf_position``): the
model, optimizer and scheduler equal the whole tensors the four ranks saved, and the samples the
ranks train on continue the epoch's order (none skipped, none seen twice). The two-rank resume is
preempted in turn and signalled again during its emergency save: it exits at once, and the
previous durable step still restores."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import training_jobs  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tierio.ckpt import list_checkpoints, verify  # noqa: E402
from tierio.errors import ConfigError  # noqa: E402
from tierio.integrations.checkpoints import Pointer, restore  # noqa: E402
from tierio.integrations.hf_position import DataPosition, check_geometry, check_skip  # noqa: E402

STEPS = 8  # one epoch: 64 samples, 8 a step


def run(root: Path, nprocs: int, *extra: str):
    tiers = [str(root / "t0"), str(root / "t1")]
    return training_jobs.torchrun("hf", root, tiers, STEPS, "--preempt", "--log-samples", "--dump", *extra,
                                  nprocs=nprocs), tiers


def exit_codes(out: str) -> set[str]:
    return set(re.findall(r"exitcode\s*:\s*(-?\d+)", out))


def trained(root: Path, world: int) -> list[list[int]]:
    """Per rank, the sample indices of epoch 0 it trained on, in order."""
    out = []
    for rank in range(world):
        lines = (root / f"samples-{world}-{rank}.txt").read_text().split("\n")
        out.append([int(i) for line in lines if line.startswith("0 ") for i in line.split()[1:]])
    return out


def in_order(per_rank: list[list[int]], batch: int) -> list[int]:
    """The global order the ranks consumed: batch k of the epoch went to rank k % world."""
    world, chunks = len(per_rank), [[r[i:i + batch] for i in range(0, len(r), batch)] for r in per_rank]
    return [i for k in range(max(map(len, chunks))) for r in range(world) if k < len(chunks[r]) for i in chunks[r][k]]


def assert_same_state(want: Path, got: Path) -> None:
    a, b = load_file(str(want)), load_file(str(got))
    assert a.keys() == b.keys() and any(k.endswith("/exp_avg") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with safe_open(str(want), "pt") as fa, safe_open(str(got), "pt") as fb:
        assert json.loads(fa.metadata()["scheduler"]) == json.loads(fb.metadata()["scheduler"])


def assert_listed_whole(tiers: list[str], out: Path) -> dict[int, str | None]:
    """Every listed checkpoint verifies; every folder names a listed one."""
    listed = {c.step: c.reason for c in list_checkpoints(tiers[0])}
    assert all(verify(tiers[0], step).ok for step in listed)
    for folder in out.glob("checkpoint-*"):
        assert Pointer.read(folder / "tierio.json").step in listed, folder
    return listed


def test_preempted_on_4_ranks_resumes_on_1_and_2_at_the_same_sample(tmp_path: Path) -> None:
    four = tmp_path / "four"
    saved, tiers = run(four, 4, "--batch", "2", "--sigterm-at-save", "3")
    assert exit_codes(saved.stderr) == {"143"}, saved.stderr[-3000:]
    assert saved.stdout.count("at step 3, in flight: True") == 4  # the signal came while step 3 was being saved
    listed = assert_listed_whole(tiers, four / "out")  # step 3 completed or is not listed
    folders = sorted(int(p.name.split("-")[1]) for p in (four / "out").glob("checkpoint-*"))
    assert folders[-1] == 5, folders  # the step after the signal's, agreed by the four ranks
    assert listed[Pointer.read(four / "out" / "checkpoint-5" / "tierio.json").step] == "emergency: SIGTERM"
    before = trained(four, 4)
    assert sum(map(len, before)) == 5 * 8

    one = tmp_path / "one"
    shutil.copytree(four, one)
    alone, _ = run(one, 1, "--resume", "--accum", "2")  # the same global batch on one process
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert_same_state(four / "saved-4-5.safetensors", one / "restored-1.safetensors")
    epoch = in_order(before, 2) + trained(one, 1)[0]
    assert sorted(epoch) == list(range(64)), epoch  # every sample of the epoch exactly once

    two = tmp_path / "two"
    shutil.copytree(four, two)
    # preempted again: the first signal while step 6 is being saved, the second during the emergency save of 8
    again, _ = run(two, 2, "--resume", "--sigterm-at-save", "6", "--sigterm-twice")
    assert exit_codes(again.stderr) == {"143"}, again.stderr[-3000:]
    assert "SIGTERM again during the emergency save: exiting at once" in again.stderr
    assert_same_state(four / "saved-4-5.safetensors", two / "restored-2.safetensors")
    assert in_order(trained(two, 2), 4) == epoch[40:]  # steps 6 to 8: the same samples as on one process
    assert_listed_whole(tiers := [str(two / "t0"), str(two / "t1")], two / "out")
    newest = max(int(p.name.split("-")[1]) for p in (two / "out").glob("checkpoint-*"))
    assert newest in (5, 6)  # never the emergency step cut short
    pointer = Pointer.read(two / "out" / f"checkpoint-{newest}" / "tierio.json")
    state = restore(tiers, pointer, str(newest), rank=0, world_size=1, per_rank="own")
    assert json.loads(state["trainer_state"])["global_step"] == newest


def test_a_resume_that_would_change_the_samples_of_a_step_is_refused_with_what_to_set() -> None:
    saved = DataPosition(world_size=4, per_device_batch=2, grad_accum=1, steps_per_epoch=8, global_step=13)
    assert saved.global_batch == 8 and saved.epoch_samples == 40
    check_geometry(saved, 1, 4, 2, "checkpoint-13")  # 1 × 4 × 2: the same global batch
    with pytest.raises(ConfigError, match=r"set gradient_accumulation_steps=2 \(keeping per_device_train_batch_size=4\)"):
        check_geometry(saved, 1, 4, 1, "checkpoint-13")
    with pytest.raises(ConfigError, match="per_device_train_batch_size × gradient_accumulation_steps = 4"):
        check_geometry(saved, 2, 3, 1, "checkpoint-13")
    with pytest.raises(ConfigError, match="divides 8"):
        check_geometry(saved, 3, 1, 1, "checkpoint-13")
    check_skip(saved, 10, 1, 4, "checkpoint-13")  # 10 batches of 4 on one process: the 40 samples
    with pytest.raises(ConfigError, match="would skip 36 samples .* had consumed 40"):
        check_skip(saved, 9, 1, 4, "checkpoint-13")
    assert DataPosition.from_json(saved.to_json(), "x") == saved
