"""Tiny, deterministic training jobs on the CPU for the Lightning and Trainer integration tests.

Each runs in this process or, as ``python tests/training_jobs.py JOB ROOT ...`` (or under
``torchrun --nproc_per_node N``: DDP over gloo), in a child that a test kills with SIGKILL once a
checkpoint is durable (``--kill-at``), as a lost node would be.
The final weights are written to ROOT/final.safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from rank_exit import end_rank
from torch import nn


def say(line: str) -> None:
    """One line on stdout in one write: the ranks share the pipe, and with PYTHONUNBUFFERED a
    print is two writes (text, then newline) that another rank's line can come between."""
    os.write(1, f"{line}\n".encode())


def _kill_when(ready) -> None:
    """Wait (up to 60 s) until ``ready()``, then die the way a lost node does: no cleanup at all."""
    deadline = time.monotonic() + 60
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


# -- PyTorch Lightning -------------------------------------------------------------------------------
class RankBatches:
    """A train loader with a position that Lightning saves and restores (``state_dict``): this rank's
    share of a shuffled order per epoch, ``batch`` samples a batch, each batch with its sample ids."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rank: int, world: int, batch: int = 4) -> None:
        self.x, self.y, self.rank, self.world, self.batch = x, y, rank, world, batch
        self.epoch, self.served, self._resumed = -1, 0, False

    def order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.x), generator=torch.Generator().manual_seed(epoch))[self.rank::self.world]

    def ids(self, epoch: int, i: int) -> list[int]:
        return self.order(epoch)[i * self.batch:(i + 1) * self.batch].tolist()

    def __len__(self) -> int:
        return len(self.x) // self.world // self.batch

    def __iter__(self):
        if not self._resumed:
            self.epoch, self.served = self.epoch + 1, 0
        self._resumed = False
        while self.served < len(self):
            ids = torch.tensor(self.ids(self.epoch, self.served))
            self.served += 1
            yield self.x[ids], self.y[ids], ids

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.served, self._resumed = state["epoch"], state["served"], True


def _flat(obj, out: dict, prefix: str = "") -> dict:
    """A checkpoint dict as {path: tensor or plain value}, to compare what was saved with what came back."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(v, out, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flat(v, out, f"{prefix}/{i}")
    else:
        out[prefix] = obj.detach().clone() if isinstance(obj, torch.Tensor) else obj
    return out


def lightning_job(root: Path, tiers: list[str] | None, epochs: int, resume: str | None = None, kill_at: int | None = None,
                  preempt_at: int | None = None, term_twice: bool = False, stateful: bool = False,
                  per_rank: str = "strict", dump: bool = False, **plugin_options) -> dict[str, torch.Tensor]:
    """``preempt_at``: every rank sends itself SIGTERM after that global step, with TierioPreemption on
    (0: during the first periodic save); ``term_twice``: again during the emergency save. The
    emergency checkpoint's dict is dumped (``saved-RANK.pt``), a resume's loaded dict too
    (``restored-RANK.pt``), and every batch's sample ids (``seen-RANK.jsonl``). ``dump``: the whole
    model and optimizer state once restored and at the end (``restored-N``, ``final-N.safetensors``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from tierio.integrations.lightning import TierioCheckpointIO, TierioPreemption

    warnings.filterwarnings("ignore")

    class Regression(pl.LightningModule):
        def __init__(self, width: int = 32, lr: float = 0.01, tags: tuple = ("tiny", 1)) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))

        def training_step(self, batch, i):
            x, y = batch[:2]
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)]

    rank = int(os.environ.get("RANK", "0"))

    class Preempted(Callback):
        at: int | None = None  # the global step of the first SIGTERM

        def term(self, trainer) -> None:
            self.at = trainer.global_step if self.at is None else self.at
            os.kill(os.getpid(), signal.SIGTERM)

        def on_train_batch_start(self, trainer, module, batch, i) -> None:
            with open(root / f"seen-{rank}.jsonl", "a") as f:
                f.write(json.dumps([trainer.current_epoch, i, batch[2].tolist() if len(batch) > 2 else None]) + "\n")

        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            if preempt_at and trainer.global_step == preempt_at and self.at is None:
                self.term(trainer)

        def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
            if preempt_at == 0 and self.at is None:
                self.term(trainer)  # a periodic save is under way
            elif self.at is not None and trainer.global_step > self.at:  # the emergency save, at the agreed step
                torch.save(_flat(checkpoint, {}), root / f"saved-{rank}.pt")
                if term_twice:
                    self.term(trainer)

        def on_load_checkpoint(self, trainer, module, checkpoint) -> None:
            torch.save(_flat(checkpoint, {}), root / f"restored-{rank}.pt")

    class KillAt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            if trainer.current_epoch == kill_at and i == 2:
                _kill_when(lambda: (root / "ck" / "last.ckpt").exists())

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = RankBatches(x, y, rank, world) if stateful else \
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    pl.seed_everything(0, verbose=False)
    model = Regression()
    preempting = preempt_at is not None or stateful  # a run with TierioPreemption and its resumes
    every = {"every_n_train_steps": 3} if preempting else {}
    callbacks = [ModelCheckpoint(dirpath=root / "ck", save_last=True, save_top_k=2, monitor="step", mode="max", **every)]
    if kill_at is not None:
        callbacks.append(KillAt())
    if preempting:
        callbacks += [Preempted(), TierioPreemption(grace_seconds=120)]
    if dump:
        callbacks.append(_dump_callback(root, resume))
    if world > 1:  # under torchrun: DDP over gloo, every rank saving through tierio (or the stock strategy)
        from lightning.pytorch.strategies import DDPStrategy

        from tierio.integrations.lightning import TierioDDPStrategy

        strategy = TierioDDPStrategy(tiers, plugin_options, per_rank, process_group_backend="gloo") \
            if tiers is not None else DDPStrategy(process_group_backend="gloo")
        run = {"strategy": strategy, "devices": world}
    else:
        run = {"plugins": [TierioCheckpointIO(tiers, per_rank, **plugin_options)]} if tiers is not None else {}
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         logger=False, accelerator="cpu", **run)
    trainer.fit(model, data, ckpt_path=resume)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- Hugging Face Trainer --------------------------------------------------------------------------
class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 16) -> None:
        self.x = torch.randint(0, 100, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(n_embd: int = 32, n_layer: int = 2):
    """A GPT-2 built from its config (no download): tied embeddings and dropout, so RNG matters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=n_embd, n_layer=n_layer, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def hf_job(root: Path, tiers: list[str] | None, max_steps: int, resume: bool | str | None = None,
           kill_at: int | None = None, save_total_limit: int | None = 2, batch: int = 4, accum: int = 1,
           preempt: bool = False, **job) -> dict[str, torch.Tensor]:
    """``job``: ``print_steps`` (each rank's pid, rank 0's steps on stdout), ``hold_at`` (every rank
    waits at the end of that step until ROOT/released exists), ``sigterm_at_save`` (every
    rank signals itself right after staging that step's save), ``sigterm_twice`` (and again during
    the emergency save), ``log_samples`` (the dataset indices each rank trains on, to
    ROOT/samples-WORLD-RANK.txt), ``dump`` (whole model, optimizer and scheduler state at every save
    and once restored, as ``dump_full``)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from tierio.integrations.hf import TierioTrainer

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    class Job(TrainerCallback):
        signalled = False

        def on_train_begin(self, args, state, control, **kw):
            if job.get("print_steps"):
                say(f"pid {rank} {os.getpid()}")
            if job.get("dump") and resume:
                dump_full(root / f"restored-{world}.safetensors", kw["model"], kw["optimizer"], kw["lr_scheduler"])

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == kill_at:
                _kill_when(lambda: any((root / "out").glob("checkpoint-*/trainer_state.json")))
            if job.get("print_steps") and rank == 0:
                say(f"step {state.global_step}")
            if state.global_step == job.get("hold_at"):  # until the test has signalled: steps take ~50 ms
                for _ in range(2400):
                    if (root / "released").exists():
                        break
                    time.sleep(0.05)

        def on_save(self, args, state, control, **kw):
            if state.global_step == job.get("sigterm_at_save") or (self.signalled and job.get("sigterm_twice")):
                in_flight = not (root / "out" / f"checkpoint-{state.global_step}").exists()
                say(f"rank {rank} signals itself at step {state.global_step}, in flight: {in_flight}")
                self.signalled = True
                os.kill(os.getpid(), signal.SIGTERM)
            if job.get("dump"):
                dump_full(root / f"saved-{world}-{state.global_step}.safetensors", kw["model"], kw["optimizer"],
                          kw["lr_scheduler"])

    base = TierioTrainer if tiers is not None else Trainer
    data = TokenData()
    index = {tuple(row.tolist()): i for i, row in enumerate(data.x)}

    class JobTrainer(base):
        def training_step(self, model, inputs, *a, **kw):
            if job.get("log_samples"):  # before the step: a run killed later still trained on these
                with open(root / f"samples-{world}-{rank}.txt", "a") as f:
                    f.write(f"{int(self.state.epoch or 0)} "
                            f"{' '.join(str(index[tuple(r.tolist())]) for r in inputs['input_ids'])}\n")
            return super().training_step(model, inputs, *a, **kw)

    args = TrainingArguments(str(root / "out"), max_steps=max_steps, per_device_train_batch_size=batch, save_steps=3,
                             gradient_accumulation_steps=accum, logging_steps=1000, report_to=[], use_cpu=True, seed=7,
                             save_total_limit=save_total_limit, disable_tqdm=True)
    kw = {"tierio_tiers": tiers, "tierio_preemption": preempt} if tiers is not None else {}
    trainer = JobTrainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[Job()], **kw)
    trainer.train(resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# -- FSDP2 state (fully_shard on a CPU mesh, over gloo) ---------------------------------------------
def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def dump_full(path: Path, model, optimizer, scheduler=None) -> None:
    """Every rank: the whole tensors of a sharded model and optimizer (``full_tensor`` is a
    collective); rank 0 writes them to ``path``, named model/FQN and optim/FQN/KEY (and the
    scheduler's state as JSON in the file's metadata)."""
    from safetensors.torch import save_file

    from tierio.integrations.sharded import state_dicts

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone().contiguous()

    msd, (osd,) = state_dicts(model, [optimizer])
    flat = {f"model/{k}": full(v) for k, v in msd.items()}
    flat.update({f"optim/{fqn}/{k}": full(v) for fqn, st in osd["state"].items() for k, v in st.items()
                 if isinstance(v, torch.Tensor)})
    if os.environ.get("RANK", "0") == "0":
        save_file(flat, str(path), {"scheduler": json.dumps(scheduler.state_dict(), default=str)} if scheduler else None)


def hf_fsdp_job(root: Path, tiers: list[str], resume: bool) -> None:
    """The state Accelerate's FSDP2 plugin gives the Trainer (GPT-2, each block and the root
    ``fully_shard``-ed, AdamW, a LambdaLR), saved or restored by TierioTrainer's own methods
    (Accelerate runs FSDP on accelerators only; scripts/gpu-check.sh runs the Trainer itself).
    A resume starts from other weights, so only the restore can make them equal."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard

    from tierio.integrations.hf import TierioCheckpointsMixin, TrainerCheckpoints

    mesh = _mesh()
    model = tiny_gpt2()
    if resume:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    trainer = SimpleNamespace(model=model, optimizer=opt, lr_scheduler=sched, accelerator=SimpleNamespace(scaler=None),
                              args=SimpleNamespace(save_only_model=False),
                              tierio=TrainerCheckpoints(tiers, {}, every_rank=mesh.size() > 1, sharded=True),
                              _tierio_check_position=lambda folder: None)  # no Trainer loop: no data position
    folder = root / "out" / "checkpoint-2"
    if resume:
        TierioCheckpointsMixin._load_from_checkpoint(trainer, str(folder), model)
        TierioCheckpointsMixin._load_optimizer_and_scheduler(trainer, str(folder))
        assert sched.state_dict()["last_epoch"] == 2, sched.state_dict()
        with torch.no_grad():  # load_best_model_at_end: the model alone comes back
            for p in model.parameters():
                p.zero_()
        trainer.state = SimpleNamespace(best_model_checkpoint=str(folder))
        TierioCheckpointsMixin._load_best_model(trainer)
    else:
        ids = TokenData().x[:4]
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        state = TierioCheckpointsMixin._tierio_state(trainer, "{}")
        trainer.tierio.save_folder(state, folder, "{}", lambda: None, 2, 0)
    trainer.tierio.close()
    dump_full(root / f"{'restored' if resume else 'saved'}-{mesh.size()}.safetensors", model, opt)


def _dump_callback(root: Path, resume):
    """A Lightning callback: the whole model and optimizer state once restored (``restored-N``, a
    resume only) and at the end (``final-N``), N the world size."""
    from lightning.pytorch.callbacks import Callback

    class Dump(Callback):
        def on_train_start(self, trainer, module) -> None:
            if resume:
                dump_full(root / f"restored-{trainer.world_size}.safetensors", module, trainer.optimizers[0])

        def on_train_end(self, trainer, module) -> None:
            dump_full(root / f"final-{trainer.world_size}.safetensors", module, trainer.optimizers[0])

    return Dump()


def lightning_fsdp_job(root: Path, tiers: list[str], epochs: int, resume: bool) -> None:
    """Lightning's ModelParallelStrategy (FSDP2 in ``configure_model``) through
    TierioModelParallelStrategy; the whole model and optimizer state is dumped once restored
    (``restored-N``) and at the end (``final-N``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.fsdp import fully_shard

    from tierio.integrations.lightning import TierioModelParallelStrategy, TierioPreemption

    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = os.environ.get("TIERIO_JOB_ACCELERATOR", "cpu")  # scripts/gpu-check.sh: "gpu"

    class Sharded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)]

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    pl.seed_everything(world if resume else 0, verbose=False)  # a resume starts from other weights
    strategy = TierioModelParallelStrategy(tiers, data_parallel_size=world, tensor_parallel_size=1,
                                           process_group_backend="gloo" if accelerator == "cpu" else "nccl")
    callbacks = [ModelCheckpoint(dirpath=root / "ck", save_last=True, save_top_k=2, monitor="step", mode="max"),
                 _dump_callback(root, resume), TierioPreemption()]  # on watch under FSDP2, never signalled
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         logger=False, accelerator=accelerator, devices=world, strategy=strategy)
    trainer.fit(Sharded(), data, ckpt_path="last" if resume else None)


def torchrun(job: str, root: Path, tiers: list[str] | None, length: int, *extra: str, nprocs: int = 2,
             popen: bool = False) -> subprocess.CompletedProcess[str]:
    """``job`` as ``nprocs`` DDP processes under torchrun (gloo, a free port on 127.0.0.1); ``popen``:
    started, not waited for (a ``Popen``, stderr merged into the stdout pipe)."""
    from tierio.storage.seaweed import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), "--master_addr", "127.0.0.1",
           "--master_port", str(port), __file__, job, str(root), "--tiers", json.dumps(tiers), "--length", str(length),
           *extra]
    if popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def main() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR2)  # a hung job's stacks, on demand: kill -USR2 PID
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=["lightning", "hf", "lightning-fsdp", "hf-fsdp"])
    p.add_argument("root")
    p.add_argument("--tiers", required=True, help="JSON list of tier URLs")
    p.add_argument("--length", type=int, required=True, help="epochs (lightning) or steps (hf)")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint (hf)")
    p.add_argument("--keep-all", action="store_true", help="no save_total_limit (hf)")
    p.add_argument("--preempt-at", type=int, help="SIGTERM every rank after this global step (lightning; 0: mid-save)")
    p.add_argument("--term-twice", action="store_true", help="SIGTERM again during the emergency save (lightning)")
    p.add_argument("--stateful", action="store_true", help="a train loader with a position (lightning)")
    p.add_argument("--per-rank", default="strict", help="per_rank of the Tierio strategy (lightning)")
    p.add_argument("--dump", action="store_true", help="dump the whole state once restored and at the end")
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size (hf)")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps (hf)")
    p.add_argument("--preempt", action="store_true", help="tierio_preemption=True (hf)")
    p.add_argument("--sigterm-at-save", type=int, help="every rank signals itself after staging this step (hf)")
    p.add_argument("--hold-at", type=int, help="every rank waits after this step until ROOT/released exists (hf)")
    for flag in ("print-steps", "sigterm-twice", "log-samples"):  # see hf_job
        p.add_argument(f"--{flag}", action="store_true")
    a = p.parse_args()
    root, tiers = Path(a.root), json.loads(a.tiers)
    if a.job.startswith("hf"):  # a hung job prints its stacks and ends before the test's timeout
        faulthandler.dump_traceback_later(240, exit=True)
    if a.job.endswith("-fsdp"):  # these write their own dumps
        if a.job == "hf-fsdp":
            hf_fsdp_job(root, tiers, a.resume)
        else:
            lightning_fsdp_job(root, tiers, a.length, a.resume)
        end_rank()
    if a.job == "lightning":
        weights = lightning_job(root, tiers, a.length, kill_at=a.kill_at, resume="last" if a.resume else None,
                                preempt_at=a.preempt_at, term_twice=a.term_twice, stateful=a.stateful, per_rank=a.per_rank,
                                dump=a.dump)
    else:
        weights = hf_job(root, tiers, a.length, kill_at=a.kill_at, resume=True if a.resume else None,
                         save_total_limit=None if a.keep_all else 2, batch=a.batch, accum=a.accum, preempt=a.preempt,
                         print_steps=a.print_steps, hold_at=a.hold_at, sigterm_at_save=a.sigterm_at_save,
                         sigterm_twice=a.sigterm_twice,
                         log_samples=a.log_samples, dump=a.dump)
    from safetensors.torch import save_file

    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank holds the same weights
        save_file({k: v.contiguous() for k, v in weights.items() if k != "lm_head.weight"}, str(root / "final.safetensors"))
    end_rank()


if __name__ == "__main__":
    sys.exit(main())
