"""Lightning's ModelParallelStrategy (FSDP2, on the CPU over gloo) through TierioModelParallelStrategy:
every rank writes its own shards; a run saved on 4 processes resumes from ``last`` on 2, which
saves again and resumes on 1, each restore bit-exact against the whole tensors the saving run
ended with; ModelCheckpoint's top-k and last files work unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import training_jobs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tierio.ckpt import inspect  # noqa: E402
from tierio.errors import ConfigError  # noqa: E402
from tierio.integrations.checkpoints import Pointer  # noqa: E402
from tierio.integrations.lightning import TierioModelParallelStrategy  # noqa: E402


def test_model_parallel_saved_on_4_resumes_bit_exact_on_2_then_1(tmp_path: Path) -> None:
    tiers = [str(tmp_path / "t0")]
    for n, epochs, extra in ((4, 2, ()), (2, 3, ("--resume",)), (1, 4, ("--resume",))):
        run = training_jobs.torchrun("lightning-fsdp", tmp_path, tiers, epochs, *extra, nprocs=n)
        assert run.returncode == 0, run.stderr[-3000:]
        if n == 4:
            man = inspect(tiers[0], Pointer.read(tmp_path / "ck" / "last.ckpt").step)
            written = [sum(t.nbytes for t in r.tensors.values() if t.is_global) for r in man.ranks]
            assert man.world_size == 4 and min(written) > 0, written
    for saved, resumed in ((4, 2), (2, 1)):
        want = load_file(str(tmp_path / f"final-{saved}.safetensors"))
        got = load_file(str(tmp_path / f"restored-{resumed}.safetensors"))
        assert got.keys() == want.keys() and any(k.endswith("/exp_avg") for k in want)
        for k in want:
            assert torch.equal(got[k], want[k]), (saved, resumed, k)
    # 2 steps an epoch on 4 ranks, 4 on 2, 8 on 1: top-2 by step plus last, as Lightning keeps them
    assert {p.name for p in (tmp_path / "ck").glob("*.ckpt")} == {"last.ckpt", "epoch=2-step=8.ckpt",
                                                                  "epoch=3-step=16.ckpt"}
    assert Pointer.read(tmp_path / "ck" / "last.ckpt").global_step == 16


def test_a_full_state_on_rank_zero_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=False"):
        TierioModelParallelStrategy([str(tmp_path)], save_distributed_checkpoint=False)
