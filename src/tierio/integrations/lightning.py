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
(Lightning's sharded save would otherwise bypass the plugin). Every rank can load. The ``.ckpt``
files are not ``torch.load``-able: load them through this plugin.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierio.ckpt import CheckpointManager
from tierio.ckpt.replicated import spread
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
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[no-redef]
    from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy  # type: ignore[no-redef]

log = logging.getLogger("tierio.integrations")

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
    keeps the newest checkpoint on top)."""

    def __init__(self, tiers: Any, **manager_options: Any) -> None:
        super().__init__()
        options = {"double_buffer": True, "min_keep": 1, **check_manager_options(manager_options)}
        self._saver = PublishingSaver(tiers, options, ADVICE, _pointers_in)

    def every_rank(self) -> None:
        """Every rank calls ``save_checkpoint`` (``TierioDDPStrategy``): the replicated checkpoint is
        spread over them (``ckpt.replicated``) and rank 0 writes the pointer once it is committed."""
        self._saver.every_rank = True

    # -- CheckpointIO ---------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options; configure the tiers instead")
        target = local_target(path, "Lightning")
        state = spread(checkpoint) if self._saver.every_rank else checkpoint
        self._saver.save(state, target.parent, lambda pointer: pointer.write(target),
                         _int(checkpoint.get("global_step")), _int(checkpoint.get("epoch")))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None,
                        into: Any = None) -> dict[str, Any]:
        """The checkpoint a ``.ckpt`` pointer names (tensors on the CPU; Lightning moves them).
        DTensors in ``into`` (a sharded model's state dicts) receive their shard, resharded."""
        self.wait_published()
        target = local_target(path, "Lightning")
        pointer = Pointer.read(target)
        self._saver.watch(target.parent)
        return restore(self._saver.tiers, pointer, str(target), into=into, rank=0, world_size=1)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer; its checkpoint goes with the next retention pass (after a commit)."""
        target = local_target(path, "Lightning")
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


def _every_rank_io(tiers: Any, manager_options: dict[str, Any] | None) -> TierioCheckpointIO:
    io = TierioCheckpointIO(tiers, **(manager_options or {}))
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

    ``manager_options`` as for :class:`TierioCheckpointIO`; other keywords go to ``DDPStrategy``."""

    def __init__(self, tiers: Any, manager_options: dict[str, Any] | None = None, **ddp: Any) -> None:
        super().__init__(checkpoint_io=_every_rank_io(tiers, manager_options), **ddp)


class TierioModelParallelStrategy(_EveryRankSaves, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism: DTensor state) with every
    rank writing its own shards through a :class:`TierioCheckpointIO`, at their global offsets,
    instead of Lightning's own DCP folder (which bypasses any CheckpointIO). A resume fills this
    rank's shards on any number of processes (resharded); ``ModelCheckpoint`` works unchanged.

        Trainer(strategy=TierioModelParallelStrategy(["/nvme/ckpt"], data_parallel_size=N,
                tensor_parallel_size=1), devices=N, ...)

    ``manager_options`` as for :class:`TierioCheckpointIO`; other keywords go to ``ModelParallelStrategy``."""

    def __init__(self, tiers: Any, manager_options: dict[str, Any] | None = None, **model_parallel: Any) -> None:
        if model_parallel.get("save_distributed_checkpoint", True) is not True:
            raise ConfigError("TierioModelParallelStrategy always saves every rank's shards: leave out "
                              "save_distributed_checkpoint=False (a tierio checkpoint restores whole on one process "
                              "anyway: TierioCheckpointIO(tiers).load_checkpoint(path))")
        super().__init__(**model_parallel)
        self.checkpoint_io = _every_rank_io(tiers, manager_options)

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


def _pointers_in(directory: Path) -> Iterable[Path]:
    return (p for p in directory.iterdir() if p.suffix == ".ckpt")


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


__all__ = ["TierioCheckpointIO", "TierioDDPStrategy", "TierioModelParallelStrategy"]
