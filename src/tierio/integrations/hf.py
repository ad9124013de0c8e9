"""Hugging Face ``Trainer``: checkpoints through tierio, asynchronously, resumed bit-exact.

    from tierio.integrations.hf import TierioTrainer

    trainer = TierioTrainer(model=model, args=TrainingArguments("out", save_steps=500),
                            train_dataset=ds, tierio_tiers=["/nvme/ckpt", "s3://bucket/run1"])
    trainer.train(resume_from_checkpoint=True)

A save copies model, optimizer, scheduler, gradient scaler, RNG states and the trainer state into
staging memory and returns; the write, the commit and the promotion run behind training. The
``checkpoint-N`` folder the Trainer looks for appears once the checkpoint is durable on the first
tier, holding ``trainer_state.json`` (the Trainer reads it before anything else) and
``tierio.json`` (which tierio checkpoint it is). ``resume_from_checkpoint=True`` therefore picks
the newest complete checkpoint even after a kill mid-save. ``save_total_limit`` rotates the
folders as usual; tierio deletes the checkpoints no folder names any more with its retention
rules. Folders written by a plain ``Trainer`` still load (the stock code path).

For a ``Trainer`` subclass of your own, mix :class:`TierioCheckpointsMixin` in before it:
``class MyTrainer(TierioCheckpointsMixin, SFTTrainer)``. Single-process and DDP training (``torchrun``
or ``accelerate launch`` on N processes) are supported: under DDP every rank saves, the replicated
model and optimizer state written once overall, about 1/N a rank, and a run resumes on any number of
processes. DeepSpeed and FSDP keep their own checkpoint formats and are refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tierio.ckpt import rng_state, set_rng_state
from tierio.ckpt.replicated import spread
from tierio.dist import rank_world
from tierio.errors import ConfigError
from tierio.integrations.checkpoints import (
    Pointer,
    PublishingSaver,
    check_manager_options,
    restore,
    unstorable_advice,
)
from tierio.io.durable import atomic_write, fsync_dir, temp_name

from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

log = logging.getLogger("tierio.integrations")

POINTER_NAME = "tierio.json"
STATE_NAME = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
ADVICE = unstorable_advice(
    "The Trainer", "Return plain data (tensors, numbers, strings, lists, dicts) from the state_dict() of the "
    "optimizer, scheduler or callback that holds it.",
)


def is_tierio_checkpoint(folder: str | os.PathLike[str] | None) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, POINTER_NAME))


def publish_folder(folder: Path, pointer: Pointer, trainer_state: str) -> None:
    """Make ``folder`` appear whole: files written and synced under a hidden temp name, then one
    rename. A folder of the same name (an older run's) is replaced."""
    tmp = temp_name(folder)
    tmp.mkdir(parents=True)
    try:
        atomic_write(tmp / STATE_NAME, [trainer_state.encode()], direct=False)
        pointer.write(tmp / POINTER_NAME)
        if folder.exists():
            old = temp_name(folder)
            os.rename(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, folder)
        fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class TrainerCheckpoints(PublishingSaver):
    """The tierio side of a Trainer: one manager, the saves in flight, and restored state waiting
    to be applied (the Trainer loads model, optimizer and RNG at different moments)."""

    def __init__(self, tiers: Any, options: dict[str, Any], every_rank: bool = False) -> None:
        # the checkpoint-N folders say what to keep
        super().__init__(tiers, {"min_keep": 1, **check_manager_options(options)}, ADVICE, _pointers_in, every_rank)
        self.restored: dict[str, dict[str, Any]] = {}  # checkpoint folder -> parts not applied yet
        self._restored_lock = threading.Lock()

    def save_folder(self, state: dict[str, Any], folder: Path, trainer_state: str, after: Callable[[], None],
                    global_step: int | None, epoch: int | None) -> None:
        """Stage ``state``; once durable, publish ``folder`` and call ``after()`` (rotation)."""

        def publish(pointer: Pointer) -> None:
            publish_folder(folder, pointer, trainer_state)
            after()

        self.save(state, folder.parent, publish, global_step, epoch)

    def load(self, folder: str) -> dict[str, Any]:
        """The restored parts of ``folder``'s checkpoint still to be applied (restored once)."""
        self.wait_published()
        with self._restored_lock:
            if folder in self.restored:
                return self.restored[folder]
        self.watch(Path(folder).parent)
        rank, world = rank_world() if self.every_rank else (0, 1)
        # Each rank reads alone (no collective), whole tensors; its own RNG states are its namesake's.
        state = restore(self.tiers, Pointer.read(Path(folder) / POINTER_NAME), folder, per_rank="own", rank=rank,
                        world_size=world)
        with self._restored_lock:
            self.restored = {folder: state}  # older restores are done with
        return state


def _pointers_in(run_dir: Path) -> Iterable[Path]:
    return (p / POINTER_NAME for p in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir())


class TierioCheckpointsMixin:
    """Mix into a ``transformers.Trainer`` (sub)class: its checkpoints go through tierio.

    ``tierio_tiers``: tier URLs, fastest first; ``tierio_options``: CheckpointManager keywords
    (``memory_budget_bytes``, ``promote_bandwidth``, ``min_keep``, ...)."""

    def __init__(self, *args: Any, tierio_tiers: Any, tierio_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_supported()
        self.tierio = TrainerCheckpoints(tierio_tiers, tierio_options or {}, every_rank=self.args.world_size > 1)

    def _check_supported(self) -> None:
        t: Any = self
        other = [name for name, on in (("DeepSpeed", t.is_deepspeed_enabled), ("FSDP", t.is_fsdp_enabled)) if on]
        if other:
            raise ConfigError(f"TierioTrainer checkpoints single-process and DDP training; this run uses "
                              f"{' and '.join(other)}, whose sharded checkpoints tierio does not take from the "
                              "Trainer yet: use the plain Trainer, or save through tierio.ckpt.dcp.TierioWriter")

    # -- saving ---------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        t: Any = self
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = Path(t._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}"
        if t.state.best_global_step:
            best = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}"
            if best.exists() or t.state.best_global_step == t.state.global_step:  # this one appears once durable
                t.state.best_model_checkpoint = str(best)
        for cb in [cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)]:
            name = type(cb).__name__
            if isinstance(t.state.stateful_callbacks.get(name), list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        trainer_state = json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True) + "\n"
        epoch = int(t.state.epoch) if t.state.epoch is not None else None
        self.tierio.save_folder(self._tierio_state(trainer_state), folder, trainer_state,
                                lambda: self._tierio_rotate(run_dir), t.state.global_step, epoch)

    def _tierio_state(self, trainer_state: str) -> dict[str, Any]:
        """What a checkpoint holds. Under DDP the replicated parts are spread: every rank writes
        about 1/N of them (``ckpt.replicated``); the RNG states stay each rank's own."""
        t: Any = self
        shared = spread if self.tierio.every_rank else (lambda x: x)
        state: dict[str, Any] = {"model": shared(t.model.state_dict()), "trainer_state": trainer_state}
        if not t.args.save_only_model:
            state["optimizer"] = shared(t.optimizer.state_dict())
            if t.lr_scheduler is not None:
                state["scheduler"] = shared(t.lr_scheduler.state_dict())
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = shared(scaler.state_dict())
            state["rng"] = rng_state()
        return state

    def _tierio_rotate(self, run_dir: Path) -> None:
        """The Trainer's folder rotation, run once a new folder is published."""
        t: Any = self
        limit = t.args.save_total_limit
        if not limit or limit <= 0:
            return
        try:
            from transformers.trainer_utils import rotate_checkpoints
        except ImportError:  # transformers 4.x: a method
            t._rotate_checkpoints(use_mtime=False, output_dir=str(run_dir))
            return
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=limit,
                           best_model_checkpoint=t.state.best_model_checkpoint, use_mtime=False)

    def tierio_wait(self) -> None:
        """Wait until every checkpoint is durable, published and promoted (raises a failure)."""
        self.tierio.wait()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; returns once every checkpoint is durable and promoted (the tiers'
        leases are released then, so another run may write them)."""
        try:
            out = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            try:
                self.tierio.close()  # what was staged still becomes durable
            except Exception as exc:  # noqa: BLE001 - the training error is the one to see
                log.warning("while finishing the checkpoints after an error: %s", exc)
            raise
        self.tierio.close()
        return out

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # The best and last folders must exist before the Trainer loads or rotates them.
        self.tierio.wait_published()
        self.tierio.raise_error()
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    # -- loading --------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_tierio_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        t: Any = self
        parts = self.tierio.load(resume_from_checkpoint)
        (model if model is not None else t.model).load_state_dict(parts.pop("model"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not is_tierio_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        t: Any = self
        parts = self.tierio.load(str(checkpoint))
        if "optimizer" in parts:
            t.optimizer.load_state_dict(parts.pop("optimizer"))
        if "scheduler" in parts and t.lr_scheduler is not None:
            t.lr_scheduler.load_state_dict(parts.pop("scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not is_tierio_checkpoint(checkpoint):
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        t: Any = self
        parts = self.tierio.load(str(checkpoint))
        scaler = getattr(t.accelerator, "scaler", None)
        if "scaler" in parts and scaler is not None:
            scaler.load_state_dict(parts.pop("scaler"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not is_tierio_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        parts = self.tierio.load(str(checkpoint))
        if "rng" in parts:
            set_rng_state(parts["rng"])

    def _load_best_model(self) -> None:
        t: Any = self
        self.tierio.wait_published()  # the best folder appears once its checkpoint is durable
        best = t.state.best_model_checkpoint
        if not is_tierio_checkpoint(best):
            return super()._load_best_model()  # type: ignore[misc]
        state = restore(self.tierio.tiers, Pointer.read(Path(best) / POINTER_NAME), best, rank=0, world_size=1)
        t.model.load_state_dict(state["model"])


class TierioTrainer(TierioCheckpointsMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through tierio (see the module's docs)."""


__all__ = ["TierioCheckpointsMixin", "TierioTrainer", "TrainerCheckpoints", "is_tierio_checkpoint"]
