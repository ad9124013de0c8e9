"""The framework runs scripts/gpu-check.sh makes on a GPU (Accelerate's FSDP2 plugin and Lightning's
FSDPStrategy run on accelerators only). One check per call, under torchrun with one process
(pl-compare only compares two files):

  gpu_frameworks.py hf-fsdp2 ROOT save|resume   the Trainer under FSDP2 saves at steps 2 and 4; the
                                                 resume restores step 4: the weights equal the saved ones
  gpu_frameworks.py hf-deepspeed ROOT           DeepSpeed through the Trainer is refused with a ConfigError
  gpu_frameworks.py pl-compare ROOT             Lightning's ModelParallelStrategy job resumed equals its save
  gpu_frameworks.py pl-fsdp1 ROOT               FSDPStrategy (full state) saves through the plugin; loads back

gpu-check.sh skips a check whose framework is not installed before starting it."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file


def same_files(want: Path, got: Path) -> None:
    a, b = load_file(str(want)), load_file(str(got))
    bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not bad, bad[:5]


def hf_fsdp2(root: Path, phase: str) -> None:
    from transformers import TrainingArguments

    import training_jobs
    from tierio.integrations.hf import TierioTrainer

    resume = phase == "resume"
    args = TrainingArguments(str(root / "out"), max_steps=4, save_steps=2, per_device_train_batch_size=4, report_to=[],
                             seed=7, disable_tqdm=True, fsdp=True,
                             fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    t = TierioTrainer(model=training_jobs.tiny_gpt2(), args=args, train_dataset=training_jobs.TokenData(),
                      tierio_tiers=[str(root / "t0")])
    assert t.is_fsdp_enabled and t.tierio.sharded, "Accelerate did not enable FSDP2"
    t.train(resume_from_checkpoint=True if resume else None)
    training_jobs.dump_full(root / ("restored.safetensors" if resume else "saved.safetensors"), t.model, t.optimizer)
    if resume:
        same_files(root / "saved.safetensors", root / "restored.safetensors")


def hf_deepspeed(root: Path) -> None:
    from transformers import TrainingArguments

    import training_jobs
    from tierio.errors import ConfigError
    from tierio.integrations.hf import TierioTrainer

    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    args = TrainingArguments(str(root), max_steps=2, report_to=[], deepspeed=ds)
    try:
        TierioTrainer(model=training_jobs.tiny_gpt2(), args=args, train_dataset=training_jobs.TokenData(),
                      tierio_tiers=[str(root / "t0")])
    except ConfigError as exc:
        assert "deepspeed=" in str(exc) and "fsdp_config" in str(exc), exc
        return
    sys.exit("DeepSpeed was not refused")


def pl_fsdp1(root: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import FSDPStrategy

    from tierio.integrations.checkpoints import Pointer
    from tierio.integrations.lightning import TierioCheckpointIO

    io = TierioCheckpointIO([str(root / "t0")])
    trainer = pl.Trainer(max_steps=4, accelerator="gpu", devices=1, strategy=FSDPStrategy(state_dict_type="full"),
                         plugins=[io], logger=False, enable_progress_bar=False, default_root_dir=str(root))
    model = BoringModel()
    trainer.fit(model)
    trainer.save_checkpoint(root / "m.ckpt")
    io.wait_published()
    Pointer.read(root / "m.ckpt")  # a tierio pointer, not a torch file
    state = TierioCheckpointIO([str(root / "t0")]).load_checkpoint(root / "m.ckpt")["state_dict"]
    for k, v in model.state_dict().items():
        assert torch.equal(state[k].cpu(), v.cpu()), k


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    what, root = argv[0], Path(argv[1])
    if what == "hf-fsdp2":
        hf_fsdp2(root, argv[2])
    elif what == "hf-deepspeed":
        hf_deepspeed(root)
    elif what == "pl-compare":
        same_files(root / "final-1.safetensors", root / "restored-1.safetensors")
    elif what == "pl-fsdp1":
        pl_fsdp1(root)
    else:
        sys.exit(f"unknown check {what!r}; see this file's docstring")


if __name__ == "__main__":
    main(sys.argv[1:])
