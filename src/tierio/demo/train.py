"""The demo's training loop: model, AdamW, a warm-up + cosine LR schedule, data loader and RNG,
with the whole training state as one checkpointable tree (no pickle: tensors and JSON leaves)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierio.demo.data import TokenLoader
from tierio.demo.model import GPT, GPTConfig
from tierio.io.checksum import xxh3


@dataclass(frozen=True)
class TrainConfig:
    model: GPTConfig
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 10
    total_steps: int = 1000  # horizon of the cosine schedule; the run may stop earlier
    data_seed: int = 1234
    data_tokens: int = 400_000


def _lr_factor(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """One training run. ``state()`` is what a checkpoint holds; ``load_state()`` resumes from it."""

    def __init__(self, cfg: TrainConfig, tokens: np.ndarray, init_seed: int) -> None:
        self.cfg = cfg
        torch.manual_seed(init_seed)
        self.model = GPT(cfg.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_factor(cfg.warmup, cfg.total_steps))
        self.loader = TokenLoader(tokens, cfg.model.seq_len, cfg.batch, cfg.data_seed)
        self.step = 0

    def train_step(self) -> float:
        self.model.train()
        x, y = self.loader.next_batch()
        loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(loss.item())

    # -- checkpoint state ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The full training state. Tensors are the live ones (no copies): the checkpoint manager
        snapshots them before ``save`` returns."""
        osd = self.opt.state_dict()
        return {
            "step": self.step,
            "model": dict(self.model.state_dict()),
            # JSON object keys are strings: the optimizer's integer parameter ids are converted.
            "optim": {
                "state": {str(k): v for k, v in osd["state"].items()},
                "param_groups": osd["param_groups"],
            },
            "sched": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "data": self.loader.state_dict(),
            "config": {"model": self.cfg.model.to_dict(), "batch": self.cfg.batch, "lr": self.cfg.lr},
        }

    def load_state(self, state: dict[str, Any], *, restore_rng: bool = True, restore_data: bool = True) -> None:
        self.model.load_state_dict(state["model"])
        groups = []
        for g in state["optim"]["param_groups"]:
            g = dict(g)
            g["betas"] = tuple(g["betas"])
            g["params"] = [int(p) for p in g["params"]]
            groups.append(g)
        self.opt.load_state_dict(
            {"state": {int(k): v for k, v in state["optim"]["state"].items()}, "param_groups": groups}
        )
        self.sched.load_state_dict(dict(state["sched"]))
        if restore_rng:
            torch.set_rng_state(state["rng"]["torch"])
        if restore_data:
            self.loader.load_state_dict(state["data"])
        self.step = int(state["step"])

    def fingerprint(self) -> dict[str, str]:
        """xxh3 of every tensor of the training state (parameters, optimizer moments, RNG)."""
        out: dict[str, str] = {}

        def add(name: str, t: torch.Tensor) -> None:
            t = t.detach().contiguous().reshape(-1)
            out[name] = xxh3(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")

        for name, t in self.model.state_dict().items():
            add(f"model.{name}", t)
        for pid, st in self.opt.state_dict()["state"].items():
            for key, t in st.items():
                if isinstance(t, torch.Tensor):
                    add(f"optim.{pid}.{key}", t)
        add("rng.torch", torch.get_rng_state())
        out["data"] = f"{self.loader.epoch}:{self.loader.pos}"
        out["lr"] = repr(self.sched.get_last_lr())
        return out
