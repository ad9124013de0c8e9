#!/usr/bin/env bash
# Checks of the framework runs the CPU tests cannot make (Accelerate's FSDP2 plugin and Lightning's
# FSDPStrategy run on accelerators only): on a machine with one CUDA GPU and torch built with CUDA.
# Each check is short and prints one PASS, FAIL or SKIP line; the exit status is the number of FAILs.
#   scripts/gpu-check.sh            (from the repository root, the package importable)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
WORK="$(mktemp -d /tmp/tierio-gpu-check-XXXX)"
trap 'rm -rf "$WORK"' EXIT
fails=0

check() {  # check NAME COMMAND...: PASS on status 0, SKIP on 77, FAIL otherwise (the output's tail shown)
  local name="$1"; shift
  local log="$WORK/$name.log" rc
  timeout 300 "$@" >"$log" 2>&1; rc=$?
  if [ "$rc" -eq 0 ]; then echo "PASS $name"
  elif [ "$rc" -eq 77 ]; then echo "SKIP $name: $(tail -n 1 "$log")"
  else echo "FAIL $name (status $rc)"; tail -n 20 "$log" | sed 's/^/    /'; fails=$((fails + 1)); fi
}

port() { "$PY" -c 'from tierio.storage.seaweed import free_port; print(free_port())'; }
run1() { "$PY" -m torch.distributed.run --nproc_per_node 1 --master_addr 127.0.0.1 --master_port "$(port)" "$@"; }

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "FAIL cuda: torch.cuda.is_available() is False"; exit 1; }

# The Trainer under Accelerate's FSDP2 plugin: saves at steps 2 and 4 through tierio, then a resume
# (resume_from_checkpoint=True) restores step 4 and trains no further: the weights equal the saved ones.
cat >"$WORK/hf_fsdp2.py" <<'PY'
import sys, warnings
from pathlib import Path
import torch
from safetensors.torch import load_file
from transformers import TrainingArguments
import training_jobs
from tierio.integrations.hf import TierioTrainer
warnings.filterwarnings("ignore")
root, resume = Path(sys.argv[1]), sys.argv[2] == "resume"
args = TrainingArguments(str(root / "out"), max_steps=4, save_steps=2, per_device_train_batch_size=4, report_to=[],
                         seed=7, disable_tqdm=True, fsdp=True,
                         fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
t = TierioTrainer(model=training_jobs.tiny_gpt2(), args=args, train_dataset=training_jobs.TokenData(),
                  tierio_tiers=[str(root / "t0")])
assert t.is_fsdp_enabled and t.tierio.sharded, "Accelerate did not enable FSDP2"
t.train(resume_from_checkpoint=True if resume else None)
training_jobs.dump_full(root / ("restored.safetensors" if resume else "saved.safetensors"), t.model, t.optimizer)
if resume:
    want, got = load_file(str(root / "saved.safetensors")), load_file(str(root / "restored.safetensors"))
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    assert want.keys() == got.keys() and not bad, bad[:5]
PY
hf_fsdp2() { run1 "$WORK/hf_fsdp2.py" "$WORK/hf" save && run1 "$WORK/hf_fsdp2.py" "$WORK/hf" resume; }
check hf-trainer-fsdp2-save-resume hf_fsdp2

# DeepSpeed through the Trainer: refused with a ConfigError naming the option (SKIP without deepspeed).
cat >"$WORK/hf_deepspeed.py" <<'PY'
import sys
try:
    import deepspeed  # noqa: F401
except ImportError:
    print("deepspeed is not installed"); sys.exit(77)
from transformers import TrainingArguments
import training_jobs
from tierio.errors import ConfigError
from tierio.integrations.hf import TierioTrainer
ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
args = TrainingArguments(sys.argv[1], max_steps=2, report_to=[], deepspeed=ds)
try:
    TierioTrainer(model=training_jobs.tiny_gpt2(), args=args, train_dataset=training_jobs.TokenData(),
                  tierio_tiers=[sys.argv[1] + "/t0"])
except ConfigError as exc:
    assert "deepspeed=" in str(exc) and "fsdp_config" in str(exc), exc
    sys.exit(0)
sys.exit("DeepSpeed was not refused")
PY
check hf-trainer-deepspeed-refused run1 "$WORK/hf_deepspeed.py" "$WORK/ds"

# Lightning's ModelParallelStrategy (FSDP2) on the GPU over NCCL: the CPU test's job, saved, then resumed.
lightning_mp() {
  export TIERIO_JOB_ACCELERATOR=gpu
  local tiers="[\"$WORK/pl/t0\"]"
  run1 tests/training_jobs.py lightning-fsdp "$WORK/pl" --tiers "$tiers" --length 2 \
    && run1 tests/training_jobs.py lightning-fsdp "$WORK/pl" --tiers "$tiers" --length 3 --resume \
    && "$PY" - "$WORK/pl" <<'PY'
import sys, torch
from safetensors.torch import load_file
want, got = load_file(f"{sys.argv[1]}/final-1.safetensors"), load_file(f"{sys.argv[1]}/restored-1.safetensors")
assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
PY
}
check lightning-model-parallel-save-resume lightning_mp

# Lightning's FSDPStrategy (FSDP1, GPU only) with the plugin: state_dict_type="full" gathers the state
# on rank 0 and saves through TierioCheckpointIO; the .ckpt is a tierio pointer that loads back.
cat >"$WORK/pl_fsdp1.py" <<'PY'
import sys, warnings
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import FSDPStrategy
from tierio.integrations.checkpoints import Pointer
from tierio.integrations.lightning import TierioCheckpointIO
warnings.filterwarnings("ignore")
root = Path(sys.argv[1])
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
PY
check lightning-fsdp1-full-through-plugin run1 "$WORK/pl_fsdp1.py" "$WORK/pl1"

echo "gpu-check: $fails failed"
exit "$fails"
