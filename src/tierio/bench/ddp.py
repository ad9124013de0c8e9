"""Data-parallel checkpoints inside the frameworks: how the bytes spread over the ranks, and the stall.

Real ``torchrun`` jobs over gloo on 127.0.0.1, one for each framework and world size:

  ddp_bytes_per_rank_vs_even   4 DDP ranks (the Trainer with ``TierioTrainer``, Lightning with
                               ``TierioDDPStrategy``): the most bytes any rank writes ÷ (state bytes
                               ÷ 4); ``ddp_total_bytes_vs_state`` beside it: all ranks' bytes ÷ the
                               state's (1.0: written once overall)
  trainer_ddp_stall_vs_memcpy  2 DDP ranks: the median ``save`` blocking time (the framework's whole
                               save call, state_dict and spread included) ÷ one copy of a rank's state
                               into memory it already holds (``lightning_ddp_stall_vs_memcpy``: the same
                               for Lightning)

The state is the model, its Adam moments and the loop state (about ``size`` bytes); "bytes a rank
writes" counts the tensor bytes of its shard (the manifest's chunks; the small per-rank RNG state
included). Each save after the first is timed once the previous one is durable, as in a run whose
steps are longer than a persist; the first allocates the staging memory and is left out.

Run as ``python -m tierio.bench.ddp JOB WORK SIZE`` under torchrun, a rank writes what it measured to
``WORK/rank-R.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGETS = {
    "ddp_bytes_per_rank_vs_even": ("<=", 1.1),
    "ddp_total_bytes_vs_state": ("<=", 1.01),
    "trainer_ddp_stall_vs_memcpy": ("<=", 1.5),
    "lightning_ddp_stall_vs_memcpy": ("<=", 1.5),
}
SAVES = 4  # the first warms up (staging memory); the median of the others is the stall


def _memcpy_seconds(tensors: list[Any]) -> float:
    """The best of three copies of ``tensors`` into buffers allocated (and touched) beforehand."""
    import torch

    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.zero_()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        best = min(best, time.perf_counter() - t0)
    return best


def _state_tensors(*states: Any) -> list[Any]:
    """The distinct tensors of ``states`` (tied weights once), as a checkpoint holds them."""
    from tierio.format.statetree import flatten

    return list(flatten(list(states)).tensors.values())


def _report(work: Path, saves: list[float], tensors: list[Any]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    out = {"save_seconds": saves, "memcpy_seconds": _memcpy_seconds(tensors),
           "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    (work / f"rank-{rank}.json").write_text(json.dumps(out))


# -- the jobs (one process of a torchrun) ---------------------------------------------------------
def _trainer_job(work: Path, nbytes: int) -> None:
    import torch
    from transformers import TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from tierio.bench import models
    from tierio.integrations.hf import TierioTrainer

    hf_logging.set_verbosity_error()
    vocab = 4096
    ids = torch.randint(0, vocab, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(len(ids))]
    saves: list[float] = []

    class Timed(TierioTrainer):
        def _save_checkpoint(self, model: Any, trial: Any, *a: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial, *a, **kw)
            saves.append(time.perf_counter() - t0)

    class Settle(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trainer.tierio.wait_published()  # untimed: the previous save durable before the next

    args = TrainingArguments(str(work / "out"), max_steps=SAVES, per_device_train_batch_size=2, save_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000)
    trainer = Timed(model=models.gpt2(nbytes, n_embd=512, vocab=vocab, n_head=8, n_positions=32), args=args, train_dataset=data, callbacks=[Settle()],
                    tierio_tiers=[str(work / "tier")])
    trainer.train()
    _report(work, saves, _state_tensors(trainer.model.state_dict(), trainer.optimizer.state_dict()))


def _lightning_job(work: Path, nbytes: int) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from tierio.bench import models
    from tierio.integrations.lightning import TierioDDPStrategy

    saves: list[float] = []

    class Save(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            t0 = time.perf_counter()
            trainer.save_checkpoint(work / "ck" / f"step-{trainer.global_step}.ckpt")
            saves.append(time.perf_counter() - t0)
            trainer.strategy.checkpoint_io.wait_published()  # untimed, as for the Trainer

    strategy = TierioDDPStrategy([str(work / "tier")], process_group_backend="gloo")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, models.WIDE)), batch_size=2)
    trainer = pl.Trainer(max_steps=SAVES, strategy=strategy, devices=int(os.environ["WORLD_SIZE"]), accelerator="cpu",
                         callbacks=[Save()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = models.wide(nbytes)
    trainer.fit(model, data)
    opt = trainer.optimizers[0]
    _report(work, saves, _state_tensors(model.state_dict(), opt.state_dict()))


# -- the driver -----------------------------------------------------------------------------------
def _torchrun(job: str, work: Path, nbytes: int, nprocs: int) -> list[dict[str, Any]]:
    from tierio.storage.seaweed import free_port

    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "tierio.bench.ddp", job, str(work), str(nbytes)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{job} on {nprocs} processes failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return [json.loads((work / f"rank-{r}.json").read_text()) for r in range(nprocs)]


def _bytes_per_rank(tier: Path) -> list[int]:
    """Tensor bytes each rank wrote in the newest checkpoint on ``tier``."""
    from tierio.ckpt import inspect

    man = inspect(str(tier), records=True)
    return [sum(t.nbytes for t in r.tensors.values()) for r in sorted(man.ranks, key=lambda r: r.rank)]


def measure(size: int, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The spread (4 ranks) and the stall (2 ranks) for both frameworks; NaN, with the reason, where
    a framework is not installed."""
    out: dict[str, Any] = {"state_target_bytes": size, "ratios": {}, "skipped": {}}
    spreads, totals = [], []
    for label, job in (("trainer", "trainer"), ("lightning", "lightning")):
        try:
            __import__("transformers" if job == "trainer" else "lightning")
        except ImportError as exc:
            out["skipped"][label] = f"{exc.name} is not installed: pip install 'tierio[lightning,hf]'"
            continue
        log(f"{label}: 4 DDP ranks, bytes each rank writes")
        ranks = _torchrun(job, work / f"{label}-4", size, 4)
        state = ranks[0]["state_bytes"]
        written = _bytes_per_rank(work / f"{label}-4" / "tier")
        spreads.append(max(written) / (state / 4))
        totals.append(sum(written) / state)
        log(f"{label}: 2 DDP ranks, save stall vs memcpy")
        ranks2 = _torchrun(job, work / f"{label}-2", size, 2)
        stall = max(statistics.median(r["save_seconds"][1:]) for r in ranks2)  # the slowest rank holds the step
        copy = max(r["memcpy_seconds"] for r in ranks2)
        out[label] = {"state_bytes": state, "bytes_per_rank_4": written, "save_seconds_2": [r["save_seconds"] for r in ranks2],
                      "memcpy_seconds_2": [r["memcpy_seconds"] for r in ranks2], "stall_s": stall, "memcpy_s": copy}
        out["ratios"][f"{label}_ddp_stall_vs_memcpy"] = stall / copy
    if spreads:
        out["ratios"]["ddp_bytes_per_rank_vs_even"] = max(spreads)
        out["ratios"]["ddp_total_bytes_vs_state"] = max(totals)
    return out


def main() -> None:
    job, work, nbytes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    warnings.filterwarnings("ignore")
    {"trainer": _trainer_job, "lightning": _lightning_job}[job](work, nbytes)


if __name__ == "__main__":
    main()
