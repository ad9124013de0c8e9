"""`tierio bench integrations`: checkpoints inside training, where the framework and the interpreter are.

Save stalls of the framework integrations (also measured inside `tierio bench ckpt`). For one model
(linear layers for Lightning, a GPT-2 shape for the Trainer) trained one step with Adam, so that the
checkpoint holds weights, optimizer state and loop state:

  lightning_save_stall_vs_torch_checkpointio   trainer.save_checkpoint() with Lightning's default
                                               TorchCheckpointIO ÷ the same call with TierioCheckpointIO
  hf_trainer_save_stall_vs_default             the stock Trainer's checkpoint save ÷ TierioTrainer's

Stall = how long the call holds the training loop (medians of the repetitions after a warm-up
save, each started once the previous one is durable). The checkpoint is about ``size`` bytes,
at most ``MAX_BYTES``: torch.save keeps up to three in-memory copies of it.

The GIL tax (bench/gil.py): a Python-heavy step idle and while tierio, DCP's thread-based and
DCP's process-based async saves write (``step_during_persist_vs_idle``,
``step_slowdown_vs_dcp_process``). Preemption (bench/preempt.py): SIGTERM to both ranks of a
2-rank job until the emergency step is durable, on a shared tier 0 and on node-local ones
(``preempt_signal_to_durable_s``, ``preempt_signal_to_durable_nodelocal_s``, beside fio).
DDP inside the frameworks (bench/ddp.py): the bytes each of 4 ranks writes and the save stall of 2
ranks against a memcpy (``ddp_bytes_per_rank_vs_even``, ``trainer_ddp_stall_vs_memcpy``, ...).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TARGETS = {
    "lightning_save_stall_vs_torch_checkpointio": (">=", 5.0),
    "hf_trainer_save_stall_vs_default": (">=", 5.0),
    "fsdp_save_vs_framework_default": (">=", 5.0),  # bench/fsdp.py
    "step_during_persist_vs_idle": (">=", 0.9),
    "step_slowdown_vs_dcp_process": (">=", 1.0),
}
MAX_BYTES = 1 << 30


def _median_call(call: Callable[[], None], settle: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(first call, median of ``repeat`` later calls) in seconds; ``settle()`` runs untimed after each."""
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        settle()
    return times[0], statistics.median(times[1:])


# -- Lightning ------------------------------------------------------------------------------------
def _lightning(nbytes: int, work: Path, repeat: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import TorchCheckpointIO

    from tierio.bench import models
    from tierio.integrations.lightning import TierioCheckpointIO

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, models.WIDE)), batch_size=4)
    model = models.wide(nbytes)
    out: dict[str, Any] = {"layers": len(model.net)}
    for name, plugin in (("torch_checkpointio", TorchCheckpointIO()), ("tierio", TierioCheckpointIO([str(work / "tiers")]))):
        trainer = pl.Trainer(max_steps=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(model, data)
        target = work / name / "model.ckpt"
        settle = plugin.wait_published if isinstance(plugin, TierioCheckpointIO) else (lambda: None)
        first, median = _median_call(lambda: trainer.save_checkpoint(target), settle, repeat)
        out[f"{name}_first_s"], out[f"{name}_s"] = first, median
        if isinstance(plugin, TierioCheckpointIO):
            out["checkpoint_bytes"] = plugin.manager.stats()["saves"][-1]["bytes"] if plugin.manager else None
            plugin.teardown()
        shutil.rmtree(work / name, ignore_errors=True)
    out["ratio"] = out["torch_checkpointio_s"] / out["tierio_s"]
    return out


# -- Hugging Face Trainer -------------------------------------------------------------------------
def _hf(nbytes: int, work: Path, repeat: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from tierio.bench import models
    from tierio.integrations.hf import TierioTrainer

    hf_logging.set_verbosity_error()
    vocab = 8192
    ids = torch.randint(0, vocab, (4, 32))
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(4)]
    out: dict[str, Any] = {}
    for name in ("default", "tierio"):
        args = TrainingArguments(str(work / name), max_steps=1, per_device_train_batch_size=4, save_strategy="no",
                                 report_to=[], use_cpu=True, disable_tqdm=True)
        model = models.gpt2(nbytes, n_embd=1024, vocab=vocab, n_head=16, n_positions=64)
        out["layers"] = model.config.n_layer
        if name == "tierio":
            trainer: Any = TierioTrainer(model=model, args=args, train_dataset=data, tierio_tiers=[str(work / "tiers")])
        else:
            trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        settle = trainer.tierio.wait_published if name == "tierio" else (lambda: None)
        first, median = _median_call(lambda t=trainer: t._save_checkpoint(t.model, None), settle, repeat)
        out[f"{name}_first_s"], out[f"{name}_s"] = first, median
        if name == "tierio":
            out["checkpoint_bytes"] = trainer.tierio.manager.stats()["saves"][-1]["bytes"]
            trainer.tierio.close()
        del trainer, model
        shutil.rmtree(work / name, ignore_errors=True)
    out["ratio"] = out["default_s"] / out["tierio_s"]
    return out


def _fsdp(nbytes: int, work: Path, repeat: int) -> dict[str, Any]:
    from tierio.bench import fsdp

    return fsdp.measure(nbytes, work, repeat)


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def measure(size: int, work: Path, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Both stall ratios (NaN, with the reason, where the framework is not installed)."""
    nbytes = min(size, MAX_BYTES)
    result: dict[str, Any] = {"checkpoint_target_bytes": nbytes, "ratios": {}, "skipped": {}}
    for ratio, label, fn in (("lightning_save_stall_vs_torch_checkpointio", "lightning", _lightning),
                             ("hf_trainer_save_stall_vs_default", "hf_trainer", _hf),
                             ("fsdp_save_vs_framework_default", "fsdp", _fsdp)):
        log(f"{label}: checkpoint save stall, default vs tierio")
        try:
            # The frameworks print progress and logs: keep stdout for the benchmark's own output.
            with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr), _quiet("lightning.pytorch"):
                warnings.simplefilter("ignore")
                result[label] = fn(nbytes, work / label, repeat)
            result["ratios"][ratio] = result[label]["ratio"]
        except ImportError as exc:
            result["ratios"][ratio] = float("nan")
            result["skipped"][ratio] = f"{exc.name or exc} is not installed: pip install 'tierio[lightning,hf]'"
        finally:
            shutil.rmtree(work / label, ignore_errors=True)
    return result


def run(args: Any) -> dict[str, Any]:
    """`tierio bench integrations`: the framework stalls, the GIL tax and preemption, in one run."""
    import tempfile

    from tierio.bench import common, ddp, gil, preempt
    from tierio.units import parse_size

    log = common.logger("bench integrations")
    work = Path(args.dir or tempfile.mkdtemp(prefix="tierio-bench-integrations-")) / "tierio-bench-integrations"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        out: dict[str, Any] = {"benchmark": "integrations", "machine": common.machine_facts(), "ratios": {}}
        if not args.no_frameworks:
            out["frameworks"] = measure(parse_size(args.size), work / "frameworks", args.repeat, log)
            out["ratios"].update(out["frameworks"]["ratios"])
            out["ddp"] = ddp.measure(parse_size(args.ddp_size), work / "ddp", log)
            out["ratios"].update(out["ddp"]["ratios"])
        out["gil"] = gil.measure(parse_size(args.size), work / "gil", args.rounds, log)
        out["preempt"] = preempt.measure(parse_size(args.preempt_size), work / "preempt", log)
        for part in ("gil", "preempt"):
            out["ratios"].update(out[part]["ratios"])
        targets = {**TARGETS, **ddp.TARGETS}
        out["met"] = common.check_targets(out["ratios"], {k: v for k, v in targets.items() if k in out["ratios"]})
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
