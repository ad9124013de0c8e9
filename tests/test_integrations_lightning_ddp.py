"""Lightning DDP on two processes (torchrun, gloo) through ``TierioDDPStrategy``: every rank saves its
share of the replicated checkpoint, ModelCheckpoint's top-k and last files work unchanged, a run
killed with SIGKILL resumes from ``last`` bit-exact against an uninterrupted stock DDP run, and a
run saved on 4 processes resumes on 2, then on 1, bit-exact against the whole tensors saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import training_jobs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tierio.ckpt import inspect  # noqa: E402
from tierio.integrations.checkpoints import Pointer  # noqa: E402


def test_lightning_ddp_killed_resumes_bit_exact_with_every_rank_writing_its_share(tmp_path: Path) -> None:
    ref = training_jobs.torchrun("lightning", tmp_path / "ref", None, 5)  # stock DDPStrategy, never interrupted
    assert ref.returncode == 0, ref.stderr[-3000:]

    root = tmp_path / "job"
    tiers = [str(root / "t0")]  # one tier, as in test_integrations_hf_ddp
    killed = training_jobs.torchrun("lightning", root, tiers, 5, "--kill-at", "3")
    assert killed.returncode != 0
    pointer = Pointer.read(root / "ck" / "last.ckpt")
    man = inspect(tiers[0], pointer.step)
    written = [sum(t.nbytes for t in r.tensors.values() if t.is_global) for r in man.ranks]
    assert man.world_size == 2 and min(written) > 0  # both ranks wrote a share of the one copy

    resumed = training_jobs.torchrun("lightning", root, tiers, 5, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = load_file(str(tmp_path / "ref" / "final.safetensors")), load_file(str(root / "final.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ckpts = {p.name for p in (root / "ck").glob("*.ckpt")}
    # save_top_k=2 plus last, as Lightning keeps them; a pointer the killed run published after its
    # last.ckpt (pointers appear once durable) is one Lightning's restored state does not track
    assert {"last.ckpt", "epoch=3-step=16.ckpt", "epoch=4-step=20.ckpt"} <= ckpts and len(ckpts) <= 4, ckpts


def test_lightning_ddp_saved_on_4_resumes_bit_exact_on_2_then_1(tmp_path: Path) -> None:
    tiers = [str(tmp_path / "t0")]
    for n, epochs, extra in ((4, 1, ()), (2, 2, ("--resume",))):
        run = training_jobs.torchrun("lightning", tmp_path, tiers, epochs, "--dump", *extra, nprocs=n)
        assert run.returncode == 0, run.stderr[-3000:]
    training_jobs.lightning_job(tmp_path, tiers, 3, resume="last", dump=True)  # one process: the plain plugin, here
    assert inspect(tiers[0], Pointer.read(tmp_path / "ck" / "last.ckpt").step).world_size == 1
    for saved, resumed in ((4, 2), (2, 1)):  # each resume against the whole tensors the saving run ended with
        want = load_file(str(tmp_path / f"final-{saved}.safetensors"))
        got = load_file(str(tmp_path / f"restored-{resumed}.safetensors"))
        assert got.keys() == want.keys() and any(k.endswith("/exp_avg") for k in want)
        for k in want:
            assert torch.equal(got[k], want[k]), (saved, resumed, k)
