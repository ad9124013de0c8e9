"""Deadlines for store operations that talk to a remote endpoint, and the parallel runner that honours them.

A store call must end, with an answer or a typed error, within a bounded time even when the
endpoint accepts connections and then never answers. One request is bounded by its connect and
read timeouts; a call made of many requests (a listing of many pages, a multipart upload, parallel
ranged reads) shares one ``Deadline``: each request that completes moves it forward, so a large
transfer that keeps moving is never cut off, while a stalled one fails ``budget`` seconds after the
endpoint last answered. The first failure of a parallel call cancels its other requests.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from typing import TypeVar

from tierio.errors import StoreUnavailableError

A = TypeVar("A")
T = TypeVar("T")


class Cancelled(StoreUnavailableError):
    """A request skipped because another request of the same call already failed."""


class Deadline:
    """The time a store call may still wait on its endpoint (``budget`` seconds after its last progress)."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.started = time.monotonic()
        self._end = self.started + budget
        self._lock = threading.Lock()
        self.error: BaseException | None = None  # the first failure; set once, cancels the call

    def progress(self) -> None:
        """A request completed: the endpoint is alive, allow another ``budget`` seconds from now."""
        self._end = time.monotonic() + self.budget

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether something that may take ``seconds`` would end before the deadline."""
        return seconds <= self.remaining()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def cancelled(self) -> bool:
        return self.error is not None

    def fail(self, exc: BaseException) -> None:
        """Record the call's first failure; later requests of the call see ``cancelled``."""
        with self._lock:
            if self.error is None:
                self.error = exc

    def check(self) -> None:
        """Raise Cancelled when another request of this call has failed."""
        if self.error is not None:
            raise Cancelled("cancelled: another request of the same store call failed first")


def backoff(attempt: int, cap: float = 2.0) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2, ...): exponential with full jitter, so
    many clients throttled together do not come back in step."""
    return random.uniform(0.0, min(cap, 0.05 * (2 ** attempt)))


def run_all(pool: Executor, fn: Callable[[A], T], items: Iterable[A], deadline: Deadline) -> list[T]:
    """``[fn(x) for x in items]`` on ``pool``, in order.

    On the first failure the call is cancelled: queued items are dropped, items already running
    stop at their next check, and this returns only once none is running any more (they write into
    the caller's memory or file, which the caller may free or close as soon as this raises). The
    error raised is the first failure, not a cancellation it caused."""

    def one(x: A) -> T:
        deadline.check()
        try:
            return fn(x)
        except BaseException as exc:
            deadline.fail(exc)
            raise

    futures: list[Future[T]] = [pool.submit(one, x) for x in items]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException as exc:  # KeyboardInterrupt in the waiting thread
        deadline.fail(exc)
        _stop(futures)
        raise
    if deadline.error is None:
        return [f.result() for f in futures]
    _stop(futures)
    raise deadline.error


def _stop(futures: list[Future]) -> None:
    for f in futures:
        f.cancel()
    wait(futures)
