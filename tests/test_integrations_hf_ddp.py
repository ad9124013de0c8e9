"""The Hugging Face Trainer on two DDP processes (torchrun, gloo) through tierio: every rank saves,
the replicated model and optimizer state written once overall and spread evenly; a run killed with
SIGKILL mid-training resumes bit-exact against an uninterrupted DDP run of the stock Trainer; its
checkpoint restores whole on one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import training_jobs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tierio.ckpt import inspect, list_checkpoints  # noqa: E402
from tierio.integrations.checkpoints import Pointer, restore  # noqa: E402

def torchrun(root: Path, tiers: list[str] | None, *extra: str):
    return training_jobs.torchrun("hf", root, tiers, 12, *extra)


def test_ddp_training_killed_resumes_bit_exact_with_the_state_spread_over_the_ranks(tmp_path: Path) -> None:
    ref = torchrun(tmp_path / "ref", None, "--keep-all")  # the stock Trainer on 2 processes, never interrupted
    assert ref.returncode == 0, ref.stderr[-3000:]

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
    plain = load_file(str(tmp_path / "ref" / "out" / f"checkpoint-{gstep}" / "model.safetensors"))
    for k, v in plain.items():
        assert torch.equal(alone["model"][k], v), k

    resumed = torchrun(root, tiers, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = load_file(str(tmp_path / "ref" / "final.safetensors")), load_file(str(root / "final.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    last = Pointer.read(root / "out" / "checkpoint-12" / "tierio.json").step
    assert all(last in {c.step for c in list_checkpoints(t)} for t in tiers)  # train() returned: promoted

    # An elastic restart on another world size: one process resumes the 2-rank checkpoint and goes on.
    alone = training_jobs.torchrun("hf", root, tiers, 15, "--resume", nprocs=1)
    assert alone.returncode == 0, alone.stderr[-3000:]
    state = json.loads((root / "out" / "checkpoint-15" / "trainer_state.json").read_text())
    assert state["global_step"] == 15
