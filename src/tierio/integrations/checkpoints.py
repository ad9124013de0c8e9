"""What the framework adapters share: small pointer files that name tierio checkpoints, the
retention that keeps what the pointers name, and restores that never roll anything back.

A framework thinks in file names (``epoch=3-step=40.ckpt``, ``checkpoint-500/``); tierio thinks
in step numbers on tiers. An adapter saves the state with a :class:`CheckpointManager` under its
own increasing step number and, once that step is committed on the first tier, writes a pointer
(a few hundred bytes of JSON, temp + fsync + rename) where the framework expects its file. So a
pointer exists only for a durable checkpoint: a job killed mid-save resumes from the previous one.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tierio.ckpt import CheckpointManager, CheckpointOptions, Tier
from tierio.ckpt.steps.retention import AnyOf, Retention
from tierio.ckpt.tier import as_tier
from tierio.errors import ConfigError, NotFoundError, TierioError, UnstorableError
from tierio.io.durable import write_json_atomic
from tierio.io.untrusted import Fields, check_str, read_json_file

log = logging.getLogger("tierio.integrations")

POINTER_FORMAT = "tierio-checkpoint"
POINTER_VERSION = 1
POINTER_LIMIT = 64 << 10  # a pointer is a few hundred bytes; anything larger is not one


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: tierio step ``step`` on ``tiers`` (as saved; informational),
    and the framework's own step and epoch for people reading it."""

    step: int
    tiers: tuple[str, ...]
    global_step: int | None = None
    epoch: int | None = None

    def write(self, path: str | Path) -> None:
        write_json_atomic(path, {"format": POINTER_FORMAT, "version": POINTER_VERSION, "step": self.step,
                                 "tiers": list(self.tiers), "global_step": self.global_step, "epoch": self.epoch})

    @classmethod
    def read(cls, path: str | Path) -> Pointer:
        """Parse a pointer file; FormatError (naming the file) for anything that is not one."""
        doc = read_json_file(path, missing="save a checkpoint there first, or name an existing one",
                             what="not a tierio checkpoint pointer (a file saved without tierio loads without it)",
                             limit=POINTER_LIMIT)
        f = Fields(doc, str(path))
        f.const("format", POINTER_FORMAT)
        f.const("version", POINTER_VERSION)
        tiers = tuple(check_str(t, f"{path}: tiers") for t in f.list("tiers", 16))
        optional = {k: (f.int(k, default=None) if f.doc.get(k) is not None else None) for k in ("global_step", "epoch")}
        return cls(f.int("step"), tiers, **optional)


def tier_urls(tiers: Iterable[str | Path | Tier]) -> tuple[str, ...]:
    return tuple(str(as_tier(t).url) for t in tiers)


@dataclass(frozen=True)
class Referenced(Retention):
    """Keeps the steps that ``named()`` returns: the ones some pointer file still names."""

    named: Callable[[], set[int]]

    def keep(self, steps, now):
        wanted = self.named()
        return {s.step for s in steps if s.step in wanted}

    def __str__(self) -> str:
        return "referenced"


def with_referenced(tiers: Sequence[str | Path | Tier], named: Callable[[], set[int]]) -> list[Tier]:
    """The tiers, each keeping what a pointer names on top of its own policy (a tier without one
    keeps only that; ``KeepAll()`` still keeps everything)."""
    if isinstance(tiers, (str, Path, Tier)) or not tiers:
        raise ConfigError("pass a list of tiers, fastest first, e.g. ['/nvme/ckpt', 's3://bucket/run1']")
    out = []
    for t in tiers:
        tier = as_tier(t)
        policy: Retention = Referenced(named) if tier.retention is None else AnyOf((tier.retention, Referenced(named)))
        out.append(Tier(tier.url, policy))
    return out


_FIXED = ("rank", "world_size", "process_group")


def check_manager_options(options: dict[str, Any], fixed: Sequence[str] = _FIXED) -> dict[str, Any]:
    """``options`` as CheckpointManager keywords, checked now rather than at the first save."""
    taken = sorted(set(options) & set(fixed))
    if taken:
        raise ConfigError(f"{', '.join(taken)} are set by the integration (the framework decides who saves); leave them out")
    # the manager's own keywords, and the CheckpointOptions fields it takes as keywords too
    params = set(inspect.signature(CheckpointManager).parameters) | {f.name for f in fields(CheckpointOptions)}
    unknown = sorted(k for k in options if k not in params or k in ("tiers", "overrides"))
    if unknown:
        raise ConfigError(f"unknown CheckpointManager option(s) {unknown}; see help(tierio.ckpt.CheckpointManager)")
    return dict(options)


def restore(tiers: Sequence[str | Path | Tier], pointer: Pointer, where: str, per_rank: str = "strict",
            into: Any = None, parts: Sequence[str] | None = None, **manager: Any) -> Any:
    """The state a pointer names, from the fastest tier with a good copy (``per_rank``, ``into`` and
    ``parts``: as for ``CheckpointManager.restore``; DTensors in ``into`` receive their shard, resharded).

    A manager of its own reads it, so loading (for a resume, a test or a "best" checkpoint) never
    starts tierio's rollback of the saving manager: the framework's files say what exists."""
    with CheckpointManager(tiers, **manager) as reader:
        if pointer.step not in reader.steps():
            raise NotFoundError(
                f"{where} names tierio step {pointer.step} (saved to {', '.join(pointer.tiers)}), which is on none of "
                f"the tiers {', '.join(reader.tiers)}: it was deleted, or this job points at other tiers"
            )
        return reader.restore(step=pointer.step, into=into, per_rank=per_rank, parts=parts)


def unstorable_advice(framework: str, fix: str) -> str:
    return (f"{framework}'s checkpoint holds a value tierio cannot store without pickle. {fix} "
            "Nothing was written for this checkpoint; earlier checkpoints are intact.")


def pointed_steps(paths: Iterable[Path]) -> set[int]:
    """The steps the pointer files among ``paths`` name; other files (and vanished ones) are skipped."""
    steps: set[int] = set()
    for p in paths:
        try:
            if p.is_file() and p.stat().st_size <= POINTER_LIMIT:
                steps.add(Pointer.read(p).step)
        except (TierioError, OSError):
            continue  # not ours, or removed while we looked
    return steps


def local_target(path: str | os.PathLike[str], framework: str) -> Path:
    """The file system path of a pointer the framework names; URLs are refused (tiers hold the data)."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(f"{framework} asked to save to {text}: point it at a local or shared-filesystem directory; "
                          "the checkpoint data goes to the tierio tiers, the file there only names it")
    return Path(text.removeprefix("file://"))


__all__ = ["Pointer", "Referenced", "check_manager_options", "local_target", "pointed_steps", "restore",
           "tier_urls", "unstorable_advice", "with_referenced"]


class PublishingSaver:
    """One manager behind a framework adapter: saves under increasing step numbers (after the
    newest on the tiers), each followed, once durable, by ``publish(pointer)`` (a pointer file,
    a checkpoint folder). A failed publish is raised at the next save or at :meth:`close`.

    ``pointers_in(directory)`` lists the pointer files in a directory the framework saved to;
    the steps they name are what retention keeps (with ``min_keep``).

    ``every_rank``: every rank of the process group calls ``save`` (data-parallel state spread
    over them, ``ckpt.replicated``); the manager is the group's, a step is published by rank 0
    once it is committed, and step numbers agree because every rank lists the same tiers before
    its first save. Otherwise one process saves alone (rank 0 of a world of 1)."""

    def __init__(self, tiers: Sequence[str | Path | Tier], options: dict[str, Any], advice: str,
                 pointers_in: Callable[[Path], Iterable[Path]], every_rank: bool = False) -> None:
        self.options = options
        self.every_rank = every_rank
        self.tiers = with_referenced(tiers, self.named)  # checks that tiers is a list of tiers
        self.plain = list(tiers)
        self.manager: CheckpointManager | None = None
        self._advice = advice
        self._pointers_in = pointers_in
        self._next: int | None = None
        self._published: list[Future] = []
        self._dirs: set[Path] = set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def start(self) -> CheckpointManager:
        """The manager, created now if no save has created it yet (``Preemption`` needs it before
        the first save)."""
        if self.manager is None:
            alone = {} if self.every_rank else {"rank": 0, "world_size": 1}
            self.manager = CheckpointManager(self.tiers, **alone, **self.options)
        return self.manager

    def save(self, state: dict[str, Any], directory: Path, publish: Callable[[Pointer], None],
             global_step: int | None = None, epoch: int | None = None, reason: str | None = None) -> Future:
        """Stage ``state``; once it is durable, ``publish`` its pointer (``directory`` is where the
        framework keeps its checkpoints: watched for the pointers retention must keep). Returns a
        future done once the pointer is published (on every rank: once the step is durable),
        raising the save's or the publication's failure. ``reason`` goes into the manifest."""
        self.raise_error()
        manager = self.start()
        if self._next is None:
            self._next = (manager.latest() or 0) + 1
        step = self._next
        try:
            handle = manager.save(step, state, reason=reason)
        except UnstorableError as exc:
            raise UnstorableError(f"{self._advice} {exc}", exc.key) from None
        self._next = step + 1
        pointer = Pointer(step, tier_urls(self.plain), global_step, epoch)
        done: Future = Future()
        self.watch(directory)
        with self._lock:
            self._published = [f for f in self._published if not f.done()] + [done]

        leader = manager.rank == 0

        def on_durable(durable: Future) -> None:
            # A failed persist publishes nothing (the manager raises that failure itself).
            failure = durable.exception()
            try:
                if failure is None and leader:
                    publish(pointer)
            except BaseException as exc:  # noqa: BLE001 - raised at the next save or at close
                log.error("could not publish checkpoint step %d in %s: %s", step, directory, exc)
                with self._lock:
                    self._error = self._error or exc
                failure = exc
            if failure is None:
                done.set_result(pointer)
            else:
                done.set_exception(failure)

        # Alone, durable on tier 0 is enough; with every rank, the step must be committed (all ranks' parts).
        (handle.committed if self.every_rank else handle.persisted).add_done_callback(on_durable)
        return done

    def watch(self, directory: Path) -> None:
        """Count the pointers in ``directory`` among those retention keeps."""
        with self._lock:
            self._dirs.add(directory.absolute())

    def named(self) -> set[int]:
        """Steps some pointer in the watched directories still names."""
        with self._lock:
            dirs = sorted(self._dirs)
        return pointed_steps(p for d in dirs if d.is_dir() for p in self._pointers_in(d))

    def in_flight(self) -> list[Future]:
        """The futures of the saves not published yet (``save``'s), oldest first."""
        with self._lock:
            return [f for f in self._published if not f.done()]

    def wait_published(self) -> None:
        """Wait until every save made so far is published (or its save failed)."""
        for f in self.in_flight():
            f.exception()

    def wait(self) -> None:
        """Every save durable and published, every promotion done; raises a failure."""
        if self.manager is not None:
            self.manager.wait()
        self.wait_published()
        self.raise_error()

    def close(self) -> None:
        """Finish every save (write, publish, promotion) and close the manager; raises a failure."""
        manager, self.manager = self.manager, None
        try:
            if manager is not None:
                manager.close()
            self.wait_published()
        finally:
            self.raise_error()

    def raise_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err
