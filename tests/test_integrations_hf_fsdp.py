"""The Hugging Face Trainer's FSDP2 checkpoints through tierio. Accelerate runs its FSDP2 plugin on
accelerators only (on the CPU it falls back to DDP), so the state that plugin gives the Trainer
(GPT-2 with every block and the root ``fully_shard``-ed, AdamW, a scheduler) is saved and restored
here by TierioTrainer's own methods in real torchrun processes over gloo: saved on 4, restored on 2
and on 1 from other weights, bit-exact against the whole tensors. scripts/gpu-check.sh runs the
Trainer itself under FSDP2."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import training_jobs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tierio.ckpt import inspect  # noqa: E402
from tierio.errors import ConfigError  # noqa: E402
from tierio.integrations.checkpoints import Pointer  # noqa: E402
from tierio.integrations.hf import TierioCheckpointsMixin  # noqa: E402


def test_fsdp2_state_saved_on_4_ranks_restores_bit_exact_on_2_and_1(tmp_path: Path) -> None:
    tiers = [str(tmp_path / "t0"), str(tmp_path / "t1")]
    saved = training_jobs.torchrun("hf-fsdp", tmp_path, tiers, 0, nprocs=4)
    assert saved.returncode == 0, saved.stderr[-3000:]
    pointer = Pointer.read(tmp_path / "out" / "checkpoint-2" / "tierio.json")
    man = inspect(tiers[0], pointer.step)
    written = [sum(t.nbytes for t in r.tensors.values() if t.is_global) for r in man.ranks]
    assert man.world_size == 4 and max(written) <= 1.1 * sum(written) / 4, written  # each rank its own shards

    want = load_file(str(tmp_path / "saved-4.safetensors"))
    assert any(k.endswith("/exp_avg") for k in want)
    for n in (2, 1):
        resumed = training_jobs.torchrun("hf-fsdp", tmp_path, tiers, 0, "--resume", nprocs=n)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        got = load_file(str(tmp_path / f"restored-{n}.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (n, k)


def _trainer(deepspeed: bool, fsdp_version: int | None) -> SimpleNamespace:
    plugin = SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version else None
    return SimpleNamespace(is_deepspeed_enabled=deepspeed, is_fsdp_enabled=plugin is not None,
                           accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))


@pytest.mark.parametrize("deepspeed, version, named", [(True, None, "deepspeed="), (False, 1, "fsdp_config['version'] = 1")])
def test_deepspeed_and_fsdp1_are_refused_naming_the_option(deepspeed: bool, version: int | None, named: str) -> None:
    with pytest.raises(ConfigError, match="fsdp_config={'version': 2}") as err:
        TierioCheckpointsMixin._check_supported(_trainer(deepspeed, version))
    assert named in str(err.value)
    TierioCheckpointsMixin._check_supported(_trainer(False, 2))  # FSDP2 is taken
