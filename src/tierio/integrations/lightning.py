"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves into tierio tiers asynchronously.

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tierio.integrations.lightning import TierioCheckpointIO

    trainer = Trainer(plugins=[TierioCheckpointIO(["/nvme/ckpt", "s3://bucket/run1"])],
                      callbacks=[ModelCheckpoint(dirpath="checkpoints", save_last=True)])
    trainer.fit(model, ckpt_path="last")

``save_checkpoint`` returns once the state is copied into staging memory; the write, the commit
and the promotion to slower tiers run behind the training loop. The ``.ckpt`` file Lightning
names appears (a small pointer, see ``integrations.checkpoints``) once its checkpoint is durable
on the first tier, so ``ckpt_path="last"`` after a kill resumes from the newest complete one.
Lightning's own bookkeeping (top-k, ``last.ckpt``, removals) works on those files unchanged;
tierio deletes the checkpoints no ``.ckpt`` file in the directories it writes to names any more,
with its retention rules (the newest and ``min_keep`` of them always stay).

Lightning's checkpoint holds hyper-parameters and loop state besides tensors: what JSON and
tensors can hold is stored without pickle; anything else is refused with an error that names
the key. With the plugin alone, only the global-zero rank saves (Lightning calls the plugin there
only); under DDP, ``TierioDDPStrategy`` makes every rank save its share, and under FSDP2
(``ModelParallelStrategy``) ``TierioModelParallelStrategy`` makes every rank write its own shards
(Lightning's sharded save would otherwise bypass the plugin). Every rank can load, and gets its
own loop state back (a stateful loader's position). The ``.ckpt`` files are not
``torch.load``-able: load them through this plugin.

``TierioPreemption`` (a callback) turns a scheduler's SIGTERM or SIGUSR1 into one emergency
checkpoint, at a step every rank agrees on, that ``ckpt_path="last"`` resumes from.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierio.ckpt import CheckpointManager
from tierio.ckpt.preempt import PreemptOptions, Preemption
from tierio.ckpt.replicated import spread
from tierio.ckpt.restore.plan import PER_RANK
from tierio.diag.timers import StepClock
from tierio.data.position import STATE_FORMAT as POSITION_FORMAT
from tierio.dist import rank_world
from tierio.errors import ConfigError, StorageError
from tierio.integrations import sharded
from tierio.integrations.checkpoints import (
    Pointer,
    PublishingSaver,
    check_manager_options,
    local_target,
    restore,
    unstorable_advice,
)

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # type: ignore[no-redef]
    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy  # type: ignore[no-redef]

log = logging.getLogger("tierio.integrations")

# How many ranks' loop states a checkpoint holds (each rank's own under the Tierio strategies, one
# with the plugin alone): a stateful loader's position is only faithful on that many ranks.
LOOP_RANKS = "tierio_loop_ranks"

ADVICE = unstorable_advice(
    "Lightning",
    "A hyper-parameter: leave it out (self.save_hyperparameters(ignore=[...])) or pass a plain value (str, "
    "number, list, dict); from a callback's state_dict() or on_save_checkpoint(): return plain data there.",
)


class TierioCheckpointIO(CheckpointIO):
    """Lightning checkpoints saved asynchronously into tierio ``tiers`` (fastest first).

    ``manager_options`` are :class:`tierio.ckpt.CheckpointManager` keywords (``memory_budget_bytes``,
    ``promote_bandwidth``, ...). Two defaults differ: ``double_buffer=True`` (with
    ``save_last=True`` Lightning saves twice in a row, and the second save would otherwise wait
    for the first one's write) and ``min_keep=1`` (Lightning's files say what to keep; tierio
    keeps the newest checkpoint on top).

    ``per_rank``: ``"strict"`` refuses, on a world size other than the saved one, what has no place
    there (the position of a stateful train dataloader, rank-local tensors that differ);
    ``"own"`` gives each rank the saved state of the rank with its number (rank 0's beyond them)."""

    def __init__(self, tiers: Any, per_rank: str = "strict", **manager_options: Any) -> None:
        super().__init__()
        if per_rank not in PER_RANK:
            raise ConfigError(f"per_rank={per_rank!r}: take one of {', '.join(map(repr, PER_RANK))}")
        self.per_rank = per_rank
        options = {"double_buffer": True, "min_keep": 1, **check_manager_options(manager_options)}
        self._saver = PublishingSaver(tiers, options, ADVICE, _pointers_in)
        # Saves and removals in order: ModelCheckpoint may remove a top-k file before its save is
        # durable; that pointer must then never appear (it would keep its checkpoint on the tiers).
        self._lock = threading.Lock()
        self._seq = 0
        self._removed: dict[Path, int] = {}

    def every_rank(self) -> None:
        """Every rank calls ``save_checkpoint`` (``TierioDDPStrategy``): the replicated checkpoint is
        spread over them (``ckpt.replicated``) and rank 0 writes the pointer once it is committed."""
        self._saver.every_rank = True

    # -- CheckpointIO ---------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Stage ``checkpoint``; its pointer appears at ``path`` once durable. ``storage_options``
        may be ``{"reason": "..."}``, recorded in the manifest (``tierio ckpt ls`` shows it)."""
        reason = _reason(storage_options, type(self).__name__)
        target = local_target(path, "Lightning")
        seq = self._next_seq()
        self._saver.save(self._state(checkpoint), target.parent, lambda pointer: self._publish(pointer, target, seq),
                         _int(checkpoint.get("global_step")), _int(checkpoint.get("epoch")), reason=reason)

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _publish(self, pointer: Pointer, target: Path, seq: int) -> None:
        with self._lock:  # a removal after this save was staged wins, even one that came first
            if self._removed.get(target.absolute(), 0) < seq:
                pointer.write(target)

    def _state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What this rank saves. With every rank saving, the model, optimizer and callback state is
        the same on each and is spread over them; the loops are each rank's own (a stateful
        loader's position differs between ranks), so each rank keeps its own, tensors included."""
        if not self._saver.every_rank:
            return {**checkpoint, LOOP_RANKS: 1}
        shared = spread({k: v for k, v in checkpoint.items() if k != "loops"})
        return {**{k: v if k == "loops" else shared[k] for k, v in checkpoint.items()}, LOOP_RANKS: rank_world()[1]}

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None,
                        into: Any = None) -> dict[str, Any]:
        """The checkpoint a ``.ckpt`` pointer names (tensors on the CPU; Lightning moves them).
        DTensors in ``into`` (a sharded model's state dicts) receive their shard, resharded. With
        every rank saving, each rank gets its own loop state back (see ``per_rank``)."""
        self.wait_published()
        target = local_target(path, "Lightning")
        pointer = Pointer.read(target)
        self._saver.watch(target.parent)
        rank, world = rank_world()
        mine = (rank, world) if self._saver.every_rank else (0, 1)
        checkpoint = restore(self._saver.tiers, pointer, str(target), per_rank=self.per_rank, into=into,
                             rank=mine[0], world_size=mine[1])
        saved = checkpoint.pop(LOOP_RANKS, 1)
        if saved != world and self.per_rank == "strict":
            _check_no_loader_state(checkpoint, str(target), saved, world)
        return checkpoint

    def start(self) -> CheckpointManager:
        """The manager, created now if no save has yet (``TierioPreemption`` needs it at fit start)."""
        return self._saver.start()

    def in_flight(self) -> list[Any]:
        """Futures of the saves not published yet (each done once its pointer is written)."""
        return self._saver.in_flight()

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer (or, when its save is not durable yet, keep it from appearing); its
        checkpoint goes with the next retention pass (after a commit)."""
        target = local_target(path, "Lightning")
        seq = self._next_seq()
        with self._lock:
            self._removed[target.absolute()] = seq
            try:
                os.unlink(target)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(f"cannot remove {target}: {exc.strerror or exc}") from None

    def teardown(self) -> None:
        """Wait for every save (write, pointer, promotion) and close the manager; raises a failure."""
        self._saver.close()

    # -- public helpers -------------------------------------------------------------------------
    def wait_published(self) -> None:
        """Wait until the pointer of every save made so far is written (or its save failed)."""
        self._saver.wait_published()

    @property
    def manager(self) -> CheckpointManager | None:
        """The manager saving now (None before the first save and after teardown)."""
        return self._saver.manager


def _every_rank_io(tiers: Any, manager_options: dict[str, Any] | None, per_rank: str) -> TierioCheckpointIO:
    io = TierioCheckpointIO(tiers, per_rank, **(manager_options or {}))
    io.every_rank()
    return io


class _EveryRankSaves:
    """Every rank saves through the strategy's TierioCheckpointIO; rank 0 alone removes the pointer
    files, so ``ModelCheckpoint``'s top-k and ``last`` bookkeeping is unchanged."""

    checkpoint_io: Any
    is_global_zero: bool

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


class TierioDDPStrategy(_EveryRankSaves, DDPStrategy):
    """Lightning's DDP strategy with every rank saving through a :class:`TierioCheckpointIO`: the
    replicated model and optimizer state is written once overall, about 1/N a rank, instead of all
    of it by global rank zero. ``ModelCheckpoint``'s top-k and ``last`` bookkeeping is unchanged
    (rank 0 writes and removes the pointer files).

        Trainer(strategy=TierioDDPStrategy(["/nvme/ckpt", "s3://bucket/run1"]), devices=N, ...)

    ``manager_options`` and ``per_rank`` as for :class:`TierioCheckpointIO`; other keywords go to ``DDPStrategy``."""

    def __init__(self, tiers: Any, manager_options: dict[str, Any] | None = None, per_rank: str = "strict",
                 **ddp: Any) -> None:
        super().__init__(checkpoint_io=_every_rank_io(tiers, manager_options, per_rank), **ddp)


class TierioModelParallelStrategy(_EveryRankSaves, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism: DTensor state) with every
    rank writing its own shards through a :class:`TierioCheckpointIO`, at their global offsets,
    instead of Lightning's own DCP folder (which bypasses any CheckpointIO). A resume fills this
    rank's shards on any number of processes (resharded); ``ModelCheckpoint`` works unchanged.

        Trainer(strategy=TierioModelParallelStrategy(["/nvme/ckpt"], data_parallel_size=N,
                tensor_parallel_size=1), devices=N, ...)

    ``manager_options`` and ``per_rank`` as for :class:`TierioCheckpointIO`; other keywords go to
    ``ModelParallelStrategy``."""

    def __init__(self, tiers: Any, manager_options: dict[str, Any] | None = None, per_rank: str = "strict",
                 **model_parallel: Any) -> None:
        if model_parallel.get("save_distributed_checkpoint", True) is not True:
            raise ConfigError("TierioModelParallelStrategy always saves every rank's shards: leave out "
                              "save_distributed_checkpoint=False (a tierio checkpoint restores whole on one process "
                              "anyway: TierioCheckpointIO(tiers).load_checkpoint(path))")
        super().__init__(**model_parallel)
        self.checkpoint_io = _every_rank_io(tiers, manager_options, per_rank)

    def teardown(self) -> None:
        super().teardown()
        self.checkpoint_io.teardown()  # ModelParallelStrategy's own teardown leaves it out: finish the saves

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        """Restore the model and optimizers in place, shard by shard; returns the rest of the
        checkpoint (loops, schedulers, callbacks), as Lightning's own sharded load does."""
        assert self.model is not None and self.lightning_module is not None
        model_state, optimizer_states = sharded.state_dicts(self.model, self.optimizers)
        checkpoint = self.checkpoint_io.load_checkpoint(
            checkpoint_path, into={"state_dict": model_state, "optimizer_states": optimizer_states})
        sharded.apply(self.model, self.optimizers, checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", []),
                      strict=self.lightning_module.strict_loading)
        return checkpoint


class TierioStepTime(Callback):
    """Reports every training batch's time to ``tierio.metrics`` (``tierio_step_seconds{timer=name}``,
    P50/P99 gauges and the step-time alert): ``Trainer(callbacks=[TierioStepTime()], ...)``."""

    def __init__(self, name: str = "lightning") -> None:
        self.name = name
        self.clock = StepClock(name)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.clock = StepClock(self.name)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.step_done()


class TierioPreemption(Callback):
    """A scheduler's SIGTERM or SIGUSR1 becomes one emergency checkpoint that ``ckpt_path="last"``
    resumes from, durable before the process exits (``tierio.ckpt.preempt``; ``options`` are
    :class:`~tierio.ckpt.preempt.PreemptOptions`: ``signals``, ``grace_seconds``, ``exit_code``,
    ``requeue``).

        Trainer(strategy=TierioDDPStrategy(tiers), callbacks=[ModelCheckpoint(dirpath="ck", save_last=True),
                TierioPreemption(grace_seconds=100)], ...)

    At fit start, after Lightning has installed its handlers, tierio's take the signals it names
    (Lightning's SIGTERM handler runs a collective inside the handler; tierio's only notes the
    signal); Lightning's are back at the end of training. After each batch, once the ranks have
    agreed on the step (through the process group's store), every rank saves the checkpoint to
    the first ``ModelCheckpoint``'s ``last.ckpt`` with the reason ``"emergency: SIGTERM"``, and the
    process exits with ``exit_code`` once its pointer is written (rank 0) or the step committed
    (the others). With ``exit_code=None`` the fit stops after the save instead."""

    def __init__(self, options: PreemptOptions | None = None, **overrides: Any) -> None:
        self.options = PreemptOptions.resolve(options, overrides)
        self.preemption: Preemption | None = None
        self._io: TierioCheckpointIO | None = None
        self._target: Path | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._io = _saving_io(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning installed its handlers just before the run starts: ours replace them from here.
        assert self._io is not None
        self._target = _last_path(trainer)
        self.preemption = Preemption(self._io.start(), self.options)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        preempt, step = self.preemption, trainer.global_step
        if preempt is None or self._io is None or not preempt.requested(step):
            return
        preempt.begin(step)
        trainer.save_checkpoint(self._target, storage_options={"reason": preempt.reason})
        preempt.finish(step, *self._io.in_flight())  # exits here unless exit_code=None
        trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        preemption, self.preemption = self.preemption, None
        if preemption is not None:
            preemption.close()  # Lightning's handlers are back; its teardown restores the ones before fit


def _saving_io(trainer: Any) -> TierioCheckpointIO:
    """The trainer's TierioCheckpointIO, where every save of this trainer reaches it; else a ConfigError."""
    strategy, io = trainer.strategy, trainer.strategy.checkpoint_io
    name = type(strategy).__name__
    if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)) and not isinstance(strategy, TierioModelParallelStrategy):
        raise ConfigError(
            f"{name} writes its sharded checkpoints itself and bypasses any CheckpointIO plugin (or gathers the whole "
            "state on rank 0 for it): use strategy=TierioModelParallelStrategy(tiers, data_parallel_size=N, "
            "tensor_parallel_size=1) instead of the plugin (every rank then writes its own shards through tierio)")
    if not isinstance(io, TierioCheckpointIO):
        raise ConfigError(f"TierioPreemption saves through tierio, and {name} saves with {type(io).__name__}: use "
                          "strategy=TierioDDPStrategy(tiers) or TierioModelParallelStrategy(tiers), or plugins=["
                          "TierioCheckpointIO(tiers)] on one process")
    if trainer.world_size > 1 and not io._saver.every_rank:
        raise ConfigError(f"TierioPreemption on {trainer.world_size} processes needs every rank to save (so the ranks "
                          f"agree on the step and the save is theirs): use strategy=TierioDDPStrategy(tiers) instead of "
                          f"{name} with the TierioCheckpointIO plugin")
    return io


def _last_path(trainer: Any) -> Path:
    """Where ``ckpt_path="last"`` looks: the ``last.ckpt`` of the trainer's first ModelCheckpoint."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
        raise ConfigError("TierioPreemption saves where ckpt_path='last' looks, a ModelCheckpoint's directory: add "
                          "ModelCheckpoint(dirpath=..., save_last=True) to the callbacks (or keep enable_checkpointing=True)")
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


def _reason(storage_options: Any, who: str) -> str | None:
    if storage_options is None:
        return None
    if isinstance(storage_options, dict) and set(storage_options) <= {"reason"}:
        return storage_options.get("reason")
    raise ConfigError(f"{who} takes storage_options={{'reason': '...'}} only (recorded in the manifest), not "
                      f"{storage_options!r}; configure where and how it saves with the tiers and manager options")


def _check_no_loader_state(checkpoint: dict[str, Any], where: str, saved: int, world: int) -> None:
    """On another world size, a stateful train dataloader's saved positions have no faithful place."""
    loops = checkpoint.get("loops")
    held = [name for name, loop in (loops.items() if isinstance(loops, dict) else ())
            if isinstance(loop, dict) and isinstance(loop.get("state_dict"), dict)
            and not _global_positions(loop["state_dict"].get("combined_loader"))]
    if held:
        raise ConfigError(
            f"{where} holds the data position of a stateful train dataloader ({', '.join(held)}) for each of {saved} "
            f"rank(s), which has no faithful place on {world}: resume on {saved} process(es), or pass per_rank='own' "
            "(TierioDDPStrategy, TierioModelParallelStrategy or TierioCheckpointIO) to give each rank the position of "
            "the saved rank with its number (rank 0's beyond them), knowing that some data is then seen twice or not at all")


def _global_positions(states: Any) -> bool:
    """No loader state, or only tierio global positions (the same on every rank: any world size resumes them)."""
    if not states:
        return True
    return isinstance(states, list) and all(isinstance(s, dict) and s.get("format") == POSITION_FORMAT for s in states)


def _pointers_in(directory: Path) -> Iterable[Path]:
    return (p for p in directory.iterdir() if p.suffix == ".ckpt")


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


__all__ = ["TierioCheckpointIO", "TierioDDPStrategy", "TierioModelParallelStrategy", "TierioPreemption", "TierioStepTime"]
