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
only); under DDP, ``TierioDDPStrategy`` makes every rank save its share. Every rank can load. The
``.ckpt`` files are not ``torch.load``-able: load them through this plugin.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierio.ckpt import CheckpointManager
from tierio.ckpt.replicated import spread
from tierio.errors import StorageError
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
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[no-redef]
    from pytorch_lightning.strategies import DDPStrategy  # type: ignore[no-redef]

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

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        """The checkpoint a ``.ckpt`` pointer names (tensors on the CPU; Lightning moves them)."""
        self.wait_published()
        target = local_target(path, "Lightning")
        pointer = Pointer.read(target)
        self._saver.watch(target.parent)
        return restore(self._saver.tiers, pointer, str(target), rank=0, world_size=1)

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


class TierioDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with every rank saving through a :class:`TierioCheckpointIO`: the
    replicated model and optimizer state is written once overall, about 1/N a rank, instead of all
    of it by global rank zero. ``ModelCheckpoint``'s top-k and ``last`` bookkeeping is unchanged
    (rank 0 writes and removes the pointer files).

        Trainer(strategy=TierioDDPStrategy(["/nvme/ckpt", "s3://bucket/run1"]), devices=N, ...)

    ``manager_options`` as for :class:`TierioCheckpointIO`; other keywords go to ``DDPStrategy``."""

    def __init__(self, tiers: Any, manager_options: dict[str, Any] | None = None, **ddp: Any) -> None:
        io = TierioCheckpointIO(tiers, **(manager_options or {}))
        io.every_rank()
        super().__init__(checkpoint_io=io, **ddp)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _pointers_in(directory: Path) -> Iterable[Path]:
    return (p for p in directory.iterdir() if p.suffix == ".ckpt")


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


__all__ = ["TierioCheckpointIO", "TierioDDPStrategy"]
