"""What the KV cache's calls return: lookups, the outcome of moving one block up a tier, and
handles on batched transfers running in the background with their outcomes."""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from tierio.handle import Handle
from tierio.io.engine import Request, submit
from tierio.kv.rule import FetchRule
from tierio.kv.stats import KVTier
from tierio.stats import Stats

R = TypeVar("R")


@dataclass(frozen=True)
class Lookup(Stats):
    """The longest cached prefix of a chain: ``blocks`` whole blocks (``tokens`` tokens), and the
    tier each of them is in. ``rule``: the decode-latency rule, when an SLA was given and the prefix
    reaches a slower tier; if it was not viable the prefix stops before the first slower block."""

    blocks: int
    tokens: int
    tiers: list[KVTier] = field(default_factory=list)
    rule: FetchRule | None = None


@dataclass(frozen=True)
class PutResult(Stats):
    stored: int            # blocks copied into the cache
    already_cached: int    # blocks it held already (not copied again)
    dropped: int           # blocks not stored: no slot could be freed in time (the rest of the chain with them)


@dataclass(frozen=True)
class GetResult(Stats):
    """``blocks``: how many leading blocks were delivered, verified (the usable prefix; everything
    after a miss is useless without it); ``tiers``: where each came from; ``missed``: asked for and
    not delivered."""

    blocks: int
    tiers: list[KVTier]
    missed: int


class Move(enum.Enum):
    """What became of one block a prefetch asked to bring up a tier."""

    MOVED = "moved"      # copied up
    PRESENT = "present"  # already there (or another thread brought it up first)
    LATE = "late"        # not started: the deadline had passed
    FAILED = "failed"    # not found, no slot, or a failed read or check


@dataclass(frozen=True)
class PrefetchResult(Stats):
    moved: int     # blocks brought up into DRAM
    present: int   # blocks already in DRAM
    late: int      # skipped: the deadline had passed before they could start
    failed: int    # not found, no slot, or failed a read or a check (counted in stats)

    @classmethod
    def of(cls, outcomes: Iterable[Move]) -> PrefetchResult:
        n = Counter(outcomes)
        return cls(n[Move.MOVED], n[Move.PRESENT], n[Move.LATE], n[Move.FAILED])


class Pending(Handle[R]):
    """A batched call running on tierio's shared I/O pool. ``wait()`` (or ``result()``) returns
    its outcome, running it on the calling thread when no pool thread has started it yet (so
    waiting on it never queues behind other work); it may be called any number of times."""

    def __init__(self, request: Request[R] | None, value: R | None = None) -> None:
        self._request = request
        self._lock = threading.Lock()
        self._settled = request is None
        self._value: R | None = value
        self._error: BaseException | None = None

    @classmethod
    def run(cls, call: Callable[[], R], inline: bool) -> Pending[R]:
        """``call`` on the shared pool, or (``inline``: a transfer too small to be worth a thread
        hand-off) right here, returning an already-settled handle."""
        return cls(None, call()) if inline else cls(submit(call))

    def wait(self, timeout: float | None = None) -> R:
        # A timeout bounds only the wait for a pool thread's run: a call not yet started runs here.
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"the KV transfer did not finish within {timeout} s")
        try:
            if not self._settled:
                assert self._request is not None
                if timeout is not None and not self._request.future.cancel():  # started: wait for it
                    self._request.future.exception(timeout)  # TimeoutError past it, leaving it unsettled
                try:
                    self._value = self._request.result()
                except BaseException as exc:  # noqa: BLE001 - kept and re-raised to every caller
                    self._error = exc
                self._settled = True
        finally:
            self._lock.release()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def done(self) -> bool:
        if self._settled or self._request is None:
            return True
        f = self._request.future
        return f.done() and not f.cancelled()


__all__ = ["GetResult", "Lookup", "Move", "Pending", "PrefetchResult", "PutResult"]
