"""What tierio did, for whoever listens: the capabilities report events here, exporters subscribe.

The capabilities (checkpoints, data, weights, caches, the KV cache) call ``emit(event)`` at the few points
where something worth measuring finishes; ``tierio.metrics`` (or any user code) subscribes. With
no subscriber an emit costs one list check. An observer that raises is logged once and never
fails the operation that reported. Events are plain frozen dataclasses; seconds are wall-clock
seconds of the operation, tiers are store URLs.

Observers run in the thread that emits (a save's background thread, a loader's iterator), so
they must be quick: count, record, return. A process forked after ``subscribe`` (a DataLoader
worker) inherits the subscription, but what its observers record stays in that process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar, Union

log = logging.getLogger("tierio.events")

T = TypeVar("T")


# -- checkpoints ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointStaged:
    """``save()`` returned: the state is in staging memory. ``blocking_seconds`` is what the
    caller waited, ``wait_seconds`` the part spent waiting for the previous save's buffer."""

    step: int
    tier: str  # the first tier
    bytes: int
    blocking_seconds: float
    wait_seconds: float


@dataclass(frozen=True)
class CheckpointPersisted:
    """The step is committed on the first tier; ``seconds`` from the start of the write."""

    step: int
    tier: str
    bytes: int
    seconds: float
    promoting: bool  # slower tiers will receive it


@dataclass(frozen=True)
class TierWritten:
    """One shard written to one tier (the first tier's persist or a promotion copy)."""

    tier: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class CheckpointPromoted:
    """Every slower tier now holds the step that ``source`` (the first tier) committed."""

    step: int
    source: str


@dataclass(frozen=True)
class PromotionFailed:
    step: int
    source: str
    reason: str
    integrity: bool  # a checksum mismatch or damaged copy, not an outage


@dataclass(frozen=True)
class CheckpointRestored:
    step: int
    tier: str  # the tier the state was read from
    seconds: float


@dataclass(frozen=True)
class CopyUnusable:
    """A restore found this tier's copy of the step damaged or incomplete and tried the next tier."""

    step: int
    tier: str
    reason: str


# -- data, caches, weights, KV ----------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimed:
    """A WaitTimer/StepTimer named ``timer`` closed one training step (the first, warm-up, is not reported)."""

    timer: str
    seconds: float
    data_wait: float
    checkpoint_stall: float


@dataclass(frozen=True)
class DataWait:
    """The training loop waited ``seconds`` for one batch of ``loader``."""

    loader: str
    seconds: float


@dataclass(frozen=True)
class CacheLookup:
    cache: str  # "shards", "weights", ...
    hit: bool


@dataclass(frozen=True)
class CacheEviction:
    cache: str
    bytes: int


@dataclass(frozen=True)
class WeightsLoaded:
    source: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class KvGet:
    """A KV-cache get asked for ``blocks`` blocks; each tier served its count, the rest missed."""

    blocks: int
    dram: int
    nvme: int
    shared: int
    device: int = 0  # the optional accelerator tier above DRAM

    @property
    def missed(self) -> int:
        return self.blocks - self.device - self.dram - self.nvme - self.shared


Event = Union[
    CheckpointStaged, CheckpointPersisted, TierWritten, CheckpointPromoted, PromotionFailed, CheckpointRestored,
    CopyUnusable, StepTimed, DataWait, CacheLookup, CacheEviction, WeightsLoaded, KvGet,
]
Observer = Callable[[Event], None]

_observers: tuple[Observer, ...] = ()  # replaced, never mutated: emit reads it without a lock
_lock = threading.Lock()
_failed: set[int] = set()  # observers whose failure was logged already


class Subscription:
    """Returned by :func:`subscribe`; ``close()`` stops the deliveries (idempotent)."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def close(self) -> None:
        global _observers
        with _lock:
            _observers = tuple(o for o in _observers if o is not self.observer)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subscribe(observer: Observer) -> Subscription:
    """Call ``observer(event)`` for every event from now on, in the emitting thread."""
    global _observers
    with _lock:
        _observers = (*_observers, observer)
    return Subscription(observer)


def emit(event: Event) -> None:
    """Deliver ``event`` to every observer; an observer's failure is logged, never raised."""
    for observer in _observers:
        try:
            observer(event)
        except Exception as exc:  # noqa: BLE001 - a metrics bug must not fail a save or a load
            if id(observer) not in _failed:
                _failed.add(id(observer))
                log.warning("event observer %r failed on %s: %s (further failures are not logged)",
                            observer, type(event).__name__, exc)


def timed(batches: Iterable[T], loader: str = "loader") -> Iterator[T]:
    """Yield from ``batches``, reporting each wait for the next batch as a :class:`DataWait`.

    The wait is the time spent inside ``next()``: what the training loop spends blocked on data."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        if _observers:
            emit(DataWait(loader, time.perf_counter() - t0))
        yield batch


__all__ = [
    "CacheEviction", "CacheLookup", "CheckpointPersisted", "CheckpointPromoted", "CheckpointRestored",
    "CheckpointStaged", "CopyUnusable", "DataWait", "Event", "KvGet", "Observer", "PromotionFailed",
    "StepTimed", "Subscription", "TierWritten", "WeightsLoaded", "emit", "subscribe", "timed",
]
