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
``class MyTrainer(TierioCheckpointsMixin, SFTTrainer)``. Single-process, DDP and FSDP2 training
(``torchrun`` or ``accelerate launch`` on N processes) are supported: under DDP every rank saves, the
replicated model and optimizer state written once overall, about 1/N a rank; under FSDP2 every rank
writes its own shards with their global offsets (``integrations.sharded``). A run resumes on any
number of processes, resharded. FSDP1 and DeepSpeed are refused with a ConfigError naming the option.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tierio.ckpt import rng_state, set_rng_state
from tierio.ckpt.preempt import PreemptOptions, Preemption
from tierio.ckpt.replicated import spread
from tierio.diag.timers import StepClock
from tierio.dist import rank_world
from tierio.errors import ConfigError
from tierio.integrations import sharded
from tierio.integrations.hf_position import DataPosition, check_geometry, check_skip
from tierio.integrations.checkpoints import (
    Pointer,
    PublishingSaver,
    check_manager_options,
    restore,
    unstorable_advice,
)
from tierio.io.durable import atomic_write, fsync_dir, temp_name

from transformers import Trainer, TrainerCallback
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

    def __init__(self, tiers: Any, options: dict[str, Any], every_rank: bool = False, sharded: bool = False) -> None:
        # the checkpoint-N folders say what to keep
        super().__init__(tiers, {"min_keep": 1, **check_manager_options(options)}, ADVICE, _pointers_in, every_rank)
        self.sharded = sharded  # FSDP2: model and optimizer state are DTensor shards
        self.restored: dict[str, dict[str, Any]] = {}  # checkpoint folder -> parts not applied yet
        self._restored_lock = threading.Lock()

    def save_folder(self, state: dict[str, Any], folder: Path, trainer_state: str, after: Callable[[], None],
                    global_step: int | None, epoch: int | None, reason: str | None = None) -> Future:
        """Stage ``state``; once durable, publish ``folder`` and call ``after()`` (rotation). Returns
        the future of the publication (see ``PublishingSaver.save``)."""

        def publish(pointer: Pointer) -> None:
            publish_folder(folder, pointer, trainer_state)
            after()

        return self.save(state, folder.parent, publish, global_step, epoch, reason=reason)

    def load(self, folder: str, into: Any = None) -> dict[str, Any]:
        """The restored parts of ``folder``'s checkpoint still to be applied (restored once; the
        first call passes the DTensor targets of a sharded state as ``into``)."""
        self.wait_published()
        with self._restored_lock:
            if folder in self.restored:
                return self.restored[folder]
        self.watch(Path(folder).parent)
        rank, world = rank_world() if self.every_rank else (0, 1)
        # Each rank reads alone (no collective), whole tensors; its own RNG states are its namesake's.
        state = restore(self.tiers, Pointer.read(Path(folder) / POINTER_NAME), folder, per_rank="own", into=into,
                        rank=rank, world_size=world)
        with self._restored_lock:
            self.restored = {folder: state}  # older restores are done with
        return state


def _pointers_in(run_dir: Path) -> Iterable[Path]:
    return (p / POINTER_NAME for p in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir())


class PreemptCallback(TrainerCallback):
    """Installs the signal handlers once a resume has loaded its checkpoint (main thread, process
    group up); at the end of every optimizer step, asks whether the ranks agreed to save now."""

    def __init__(self, trainer: TierioCheckpointsMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the loads: their readers are closed before the saving manager (and its lease) exists.
        options = self.trainer._tierio_preempt
        if options is not None and self.trainer.preemption is None:
            self.trainer.preemption = Preemption(self.trainer.tierio.start(), options)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        preempt = self.trainer.preemption
        if preempt is not None and preempt.requested(state.global_step):
            self.trainer._tierio_emergency_save(preempt)


class StepTimeCallback(TrainerCallback):
    """Reports every optimizer step's time to ``tierio.metrics`` (``tierio_step_seconds{timer="trainer"}``);
    the time tierio's saves hold the loop is the checkpoint stall of the step they follow."""

    def __init__(self) -> None:
        self.clock = StepClock("trainer")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock = StepClock("trainer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock.step_done()


class TierioCheckpointsMixin:
    """Mix into a ``transformers.Trainer`` (sub)class: its checkpoints go through tierio.

    ``tierio_tiers``: tier URLs, fastest first; ``tierio_options``: CheckpointManager keywords
    (``memory_budget_bytes``, ``promote_bandwidth``, ``min_keep``, ...); ``tierio_preemption``:
    ``True`` or a ``PreemptOptions``: a scheduler's signal (SIGTERM, SIGUSR1) becomes a Trainer
    checkpoint of the step every rank agrees on, published before the process exits."""

    def __init__(self, *args: Any, tierio_tiers: Any, tierio_options: dict[str, Any] | None = None,
                 tierio_preemption: bool | PreemptOptions = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_supported()
        t: Any = self
        self.tierio = TrainerCheckpoints(tierio_tiers, tierio_options or {}, every_rank=self.args.world_size > 1,
                                         sharded=t.is_fsdp_enabled)
        if not isinstance(tierio_preemption, (bool, PreemptOptions)):
            raise ConfigError(f"tierio_preemption takes True, False or a tierio.ckpt.PreemptOptions, not "
                              f"{type(tierio_preemption).__name__}")
        self._tierio_preempt = PreemptOptions() if tierio_preemption is True else tierio_preemption or None
        self.preemption: Preemption | None = None  # installed while train() runs
        self._tierio_steps_per_epoch: int | None = None
        self._tierio_position: tuple[str, DataPosition] | None = None  # the resumed folder's
        if self._tierio_preempt is not None:
            t.add_callback(PreemptCallback(self))
        self._tierio_steps = StepTimeCallback()
        t.add_callback(self._tierio_steps)

    def _check_supported(self) -> None:
        t: Any = self
        if t.is_deepspeed_enabled:
            raise ConfigError(
                "TierioTrainer does not checkpoint DeepSpeed runs (TrainingArguments(deepspeed=...)): ZeRO keeps the "
                "model and optimizer partitions inside DeepSpeed's engine and saves them with its own code, which "
                "tierio does not replace. Shard with FSDP2 instead (TrainingArguments(fsdp=True, "
                "fsdp_config={'version': 2})): every rank then saves its shards through tierio. Or keep DeepSpeed "
                "with the plain Trainer.")
        version = getattr(getattr(t.accelerator.state, "fsdp_plugin", None), "fsdp_version", 2)
        if t.is_fsdp_enabled and version != 2:
            raise ConfigError(
                f"TierioTrainer checkpoints FSDP2 only; this run uses FSDP{version} (fsdp_config['version'] = "
                f"{version}), whose flat-parameter state tierio does not store: set fsdp_config={{'version': 2}} "
                "(the default), or use the plain Trainer.")

    # -- saving ---------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        with self._tierio_steps.clock.stall():
            self._tierio_save(trial)

    def _tierio_emergency_save(self, preempt: Preemption) -> None:
        """The checkpoint of the agreed step, as the Trainer's own (``checkpoint-N/``, rotation,
        ``on_save``); the process exits once it is published (rank 0) or committed (other ranks)."""
        t: Any = self
        step = t.state.global_step
        preempt.begin(step)
        published = self._tierio_save(None, reason=preempt.reason)
        t.control = t.callback_handler.on_save(t.args, t.state, t.control)
        preempt.finish(step, published)
        t.control.should_training_stop = True  # exit_code=None: finish returned; train() ends here

    def _tierio_save(self, trial: Any, reason: str | None = None) -> Future:
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
        return self.tierio.save_folder(self._tierio_state(trainer_state), folder, trainer_state,
                                       lambda: self._tierio_rotate(run_dir), t.state.global_step, epoch, reason)

    def _tierio_state(self, trainer_state: str) -> dict[str, Any]:
        """What a checkpoint holds. Under DDP the replicated parts are spread: every rank writes
        about 1/N of them (``ckpt.replicated``); under FSDP2 each rank writes its DTensor shards and
        the plain tensors left are spread; the RNG states stay each rank's own."""
        t: Any = self
        shared = spread if self.tierio.every_rank else (lambda x: x)
        optimizers = [] if t.args.save_only_model else [t.optimizer]
        if self.tierio.sharded:  # t.model is the FSDP2 module
            model_state, optimizer_states = sharded.state_dicts(t.model, optimizers)
        else:
            model_state, optimizer_states = t.model.state_dict(), [o.state_dict() for o in optimizers]
        state: dict[str, Any] = {"model": shared(model_state), "trainer_state": trainer_state}
        if optimizers:
            state["optimizer"] = shared(optimizer_states[0])
            if t.lr_scheduler is not None:
                state["scheduler"] = shared(t.lr_scheduler.state_dict())
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = shared(scaler.state_dict())
            state["rng"] = rng_state()
        if getattr(self, "_tierio_steps_per_epoch", None):  # the Trainer's loop set it (see set_initial_training_values)
            args = t.args
            state["data_position"] = DataPosition(args.world_size, t._train_batch_size, args.gradient_accumulation_steps,
                                                  self._tierio_steps_per_epoch, t.state.global_step).to_json()
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
        leases are released then, so another run may write them). With ``tierio_preemption`` the
        signal handlers are installed from the train start on (``PreemptCallback``)."""
        self._tierio_position = None
        try:
            out = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            try:
                self.tierio.close()  # what was staged still becomes durable
            except Exception as exc:  # noqa: BLE001 - the training error is the one to see
                log.warning("while finishing the checkpoints after an error: %s", exc)
            raise
        finally:
            if self.preemption is not None:
                self.preemption.close()  # the previous handlers are back
                self.preemption = None
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
        self._tierio_check_position(resume_from_checkpoint)
        model = model if model is not None else t.model
        if self.tierio.sharded:  # after prepare: the optimizer exists, and both are filled shard by shard
            model_state, optimizer_states = sharded.state_dicts(model, [t.optimizer])
            parts = self.tierio.load(resume_from_checkpoint, into={"model": model_state, "optimizer": optimizer_states[0]})
            sharded.apply(model, [t.optimizer], parts.pop("model"), [parts.pop("optimizer")] if "optimizer" in parts else [])
            return None
        model.load_state_dict(self.tierio.load(resume_from_checkpoint).pop("model"))

    def _tierio_check_position(self, folder: str) -> None:
        """The resumed checkpoint's data position, refused now if this run's global batch differs."""
        t: Any = self
        doc = self.tierio.load(folder).get("data_position")
        if doc is None:  # saved before positions were recorded
            return
        position = DataPosition.from_json(doc, folder)
        self._tierio_position = (folder, position)
        if not t.args.ignore_data_skip:
            check_geometry(position, t.args.world_size, t._train_batch_size, t.args.gradient_accumulation_steps, folder)

    def set_initial_training_values(self, *args: Any, **kwargs: Any) -> Any:
        out = super().set_initial_training_values(*args, **kwargs)  # type: ignore[misc]
        self._tierio_steps_per_epoch = out[1]  # num_update_steps_per_epoch, recorded with every checkpoint
        return out

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The Trainer's mid-epoch skip, checked against the samples the checkpoint had consumed."""
        t: Any = self
        if self._tierio_position is not None:
            folder, position = self._tierio_position
            check_skip(position, num_batches, t.args.world_size, t._train_batch_size, folder)
        return super().get_resumed_dataloader(dataloader, num_batches)  # type: ignore[misc]

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
        into = {"model": sharded.state_dicts(t.model, [])[0]} if self.tierio.sharded else None
        # The model only (not the optimizer): every rank reads it alone, under FSDP2 just its shards.
        state = restore(self.tierio.tiers, Pointer.read(Path(best) / POINTER_NAME), best, per_rank="own", into=into,
                        parts=["model"], rank=0, world_size=1)
        if self.tierio.sharded:
            sharded.apply(t.model, [], state["model"], [])
        else:
            t.model.load_state_dict(state["model"])


class TierioTrainer(TierioCheckpointsMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go through tierio (see the module's docs)."""


__all__ = ["StepTimeCallback", "TierioCheckpointsMixin", "TierioTrainer", "TrainerCheckpoints", "is_tierio_checkpoint"]
