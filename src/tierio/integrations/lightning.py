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
the key. Only the global-zero rank saves (Lightning calls the plugin there only); every rank can
load. The ``.ckpt`` files are not ``torch.load``-able: load them through this plugin.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tierio.ckpt import CheckpointManager
from tierio.errors import StorageError, UnstorableError
from tierio.integrations.checkpoints import (
    Pointer,
    check_manager_options,
    local_target,
    pointed_steps,
    restore,
    tier_urls,
    unstorable_advice,
    with_referenced,
)

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[no-redef]

log = logging.getLogger("tierio.integrations")

ADVICE = unstorable_advice(
    "Lightning",
    "A hyper-parameter: leave it out (self.save_hyperparameters(ignore=[...])) or pass a plain value (str, "
    "number, list, dict); from a callback's state_dict() or on_save_checkpoint(): return plain data there.",
)


class TierioCheckpointIO(CheckpointIO):
    """Lightning checkpoints saved asynchronously into tierio ``tiers`` (fastest first).

    ``manager_options`` are :class:`tierio.ckpt.CheckpointManager` keywords (``memory_budget``,
    ``promote_bandwidth``, ...). Two defaults differ: ``double_buffer=True`` (with
    ``save_last=True`` Lightning saves twice in a row, and the second save would otherwise wait
    for the first one's write) and ``min_keep=1`` (Lightning's files say what to keep; tierio
    keeps the newest checkpoint on top)."""

    def __init__(self, tiers: Any, **manager_options: Any) -> None:
        super().__init__()
        self._options = {"double_buffer": True, "min_keep": 1, **check_manager_options(manager_options)}
        self._tiers = with_referenced(tiers, self._named)  # checks that tiers is a list of tiers
        self._plain = list(tiers)
        self._manager: CheckpointManager | None = None
        self._next: int | None = None
        self._published: list[Future] = []
        self._dirs: set[Path] = set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    # -- CheckpointIO ---------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options; configure the tiers instead")
        target = local_target(path, "Lightning")
        self._raise_error()
        manager = self._open()
        if self._next is None:
            self._next = (manager.latest() or 0) + 1
        step = self._next
        try:
            handle = manager.save(step, checkpoint)
        except UnstorableError as exc:
            raise UnstorableError(f"{ADVICE} {exc}", exc.key) from None
        self._next = step + 1
        pointer = Pointer(step, tier_urls(self._plain), _int(checkpoint.get("global_step")), _int(checkpoint.get("epoch")))
        published: Future = Future()
        with self._lock:
            self._dirs.add(target.parent.absolute())
            self._published = [f for f in self._published if not f.done()] + [published]
        handle.persisted.add_done_callback(lambda done: self._publish(done, target, pointer, published))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        """The checkpoint a ``.ckpt`` pointer names (tensors on the CPU; Lightning moves them)."""
        self.wait_published()
        target = local_target(path, "Lightning")
        pointer = Pointer.read(target)
        with self._lock:
            self._dirs.add(target.parent.absolute())
        return restore(self._tiers, pointer, str(target), rank=0, world_size=1)

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
        manager, self._manager = self._manager, None
        try:
            if manager is not None:
                manager.close()
            self.wait_published()
        finally:
            self._raise_error()

    # -- public helpers -------------------------------------------------------------------------
    def wait_published(self) -> None:
        """Wait until the pointer of every save made so far is written (or its save failed)."""
        with self._lock:
            pending = list(self._published)
        for f in pending:
            f.exception()

    @property
    def manager(self) -> CheckpointManager | None:
        """The manager saving now (None before the first save and after teardown)."""
        return self._manager

    # -- internals ------------------------------------------------------------------------------
    def _open(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(self._tiers, rank=0, world_size=1, **self._options)
        return self._manager

    def _publish(self, persisted: Future, target: Path, pointer: Pointer, published: Future) -> None:
        """Runs when the step is durable: write its pointer. A failed persist leaves no pointer
        (the manager raises that failure at the next save or at teardown)."""
        try:
            if persisted.exception() is None:
                pointer.write(target)
        except BaseException as exc:  # noqa: BLE001 - raised at the next save or teardown
            log.error("could not write the checkpoint pointer %s: %s", target, exc)
            with self._lock:
                self._error = self._error or exc
        finally:
            published.set_result(None)

    def _named(self) -> set[int]:
        """Steps some ``.ckpt`` pointer in the directories this plugin saved to still names."""
        with self._lock:
            dirs = sorted(self._dirs)
        return pointed_steps(p for d in dirs if d.is_dir() for p in d.iterdir() if p.suffix == ".ckpt")

    def _raise_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


__all__ = ["TierioCheckpointIO"]
