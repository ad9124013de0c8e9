"""A tiny torchtitan job on the CPU for the torchtitan integration test: an MLP sharded with FSDP2
(``fully_shard``, gloo), torchtitan's optimizer and lr scheduler containers, and its checkpoint
component built from ``TierioCheckpointManager.Config``.

    torchrun --nproc_per_node N tests/titan_job.py save ROOT --steps 4     # train, save every 2 steps
    torchrun --nproc_per_node M tests/titan_job.py resume ROOT              # fresh state, then load()
    torchrun --nproc_per_node N tests/titan_job.py preempt ROOT             # train until SIGTERM (preemption=True)

Each run ends by writing what it holds, every tensor whole (``full_tensor()``), to
ROOT/<mode>-<world>.safetensors, and the scalars to the .json of the same name (rank 0). A
preempted run ends inside ``save``: before each step's save every rank writes its own shards
(``to_local()``) and the step to ROOT/held-<rank>.safetensors; a resume writes the same as
ROOT/resume-<world>-<rank>.safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from rank_exit import end_rank
from torch import nn

INTERVAL = 2


class TrainState:
    """torchtitan's trainer passes itself as ``train_state``; this is the part it saves."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def build(root: Path, seed: int, async_mode: str, preemption: bool = False) -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    from tierio.integrations.torchtitan import TierioCheckpointManager

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 4))  # 12 rows: uneven over 4, 2 and 1 ranks' shards
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01, "weight_decay": 0.1})
    optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    state = TrainState()
    config = TierioCheckpointManager.Config(enable=True, interval=INTERVAL, async_mode=async_mode, keep_latest_k=2,
                                            last_save_model_only=False, preemption=preemption,
                                            tiers=[str(root / "nvme"), str(root / "shared")])
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                                states={"train_state": state}, sd_adapter=None, base_folder=str(root))
    return model, optimizers, schedulers, state, checkpointer


def whole(model: nn.Module, optimizers: Any) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of this job, whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    out.update({f"optimizer/{k}": v for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)})
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().contiguous() for k, v in out.items()}


def local(model: nn.Module, optimizers: Any, step: int, path: Path) -> None:
    """This rank's own shards of the model and optimizer, and the step, into ``path`` (no collective)."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    out.update({f"optimizer/{k}": v for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)})
    tensors = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone().contiguous() for k, v in out.items()}
    save_file({**tensors, "step": torch.tensor(step)}, str(path))


def run(mode: str, root: Path, steps: int, async_mode: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizers, schedulers, state, checkpointer = build(root, 0 if mode != "resume" else 1, async_mode,
                                                               preemption=mode == "preempt")
    try:
        if mode != "resume":
            g = torch.Generator().manual_seed(rank)
            for step in range(1, steps + 1 if mode == "save" else 100_000):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
                optimizers.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizers.step()
                schedulers.step()
                state.step = step
                if mode == "preempt":  # what this step's save holds: the emergency save exits inside it
                    local(model, optimizers, step, root / f"held-{rank}.safetensors")
                    os.write(1, f"step {step}\n".encode())  # one write: the ranks share the pipe
                checkpointer.save(step)
        else:
            assert checkpointer.load(), "nothing was loaded"
            local(model, optimizers, state.step, root / f"resume-{world}-{rank}.safetensors")
        tensors = whole(model, optimizers)  # what the last save holds (no update after it) or what load() restored
        scalars = {"step": state.step, "lr_last_epoch": schedulers.state_dict()["last_epoch"],
                   "param_groups": {k: v for k, v in optimizers.state_dict().items() if k.startswith("param_groups.")}}
    finally:
        checkpointer.close()  # waits for the save in flight, its commit and its promotion
    if rank == 0:
        from safetensors.torch import save_file

        save_file(tensors, str(root / f"{mode}-{world}.safetensors"))
        (root / f"{mode}-{world}.json").write_text(json.dumps(scalars, default=list))
    end_rank()


def torchrun_command(mode: str, root: Path, nprocs: int, *extra: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of this job as ``nprocs`` gloo processes under torchrun."""
    from tierio.storage.seaweed import free_port

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), __file__, mode, str(root), *extra]
    return cmd, env


def torchrun(mode: str, root: Path, nprocs: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """This job under torchrun, run to its end (a free port on 127.0.0.1)."""
    cmd, env = torchrun_command(mode, root, nprocs, *extra)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def start_torchrun(mode: str, root: Path, nprocs: int) -> subprocess.Popen[str]:
    """This job under torchrun, started (text pipes; a preempted run prints ``step N`` each step)."""
    cmd, env = torchrun_command(mode, root, nprocs)
    return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "resume", "preempt"])
    p.add_argument("root")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--async-mode", default="async")
    a = p.parse_args()
    run(a.mode, Path(a.root), a.steps, a.async_mode)


if __name__ == "__main__":
    sys.exit(main())
