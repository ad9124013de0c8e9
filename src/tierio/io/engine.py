"""The one windowed parallel read engine: aligned windows, several in flight, on one shared pool.

Every loop in tierio that moves a large range of bytes has the same shape: the wanted byte ranges
are merged into regions (holes up to a merge gap are read through rather than costing
another request), each region is cut into windows that start on an alignment grid, and ``depth``
windows are in flight at once while a per-window body reads the bytes and puts them where they
belong. File reads and copies (io.ranges), checkpoint restores (storage.scatter) and weight loads
(weights.engine) are that shape with different window sizes, depths, gaps and bodies; this module
holds the shape once.

Requests run on one process-wide thread pool (the threads block in the kernel with the GIL
released, so a few dozen saturate a disk); requests from background threads run on a second pool of
background threads (io.background). Bodies may use the engine themselves: a restore's
scatter window reads through LocalStore.read_into, which cuts the window again. Bounded pools and
nested waits deadlock when every pool thread waits for a request still queued behind it, so a
waiting thread never waits for a request that has not started: it takes that request back
(cancels it) and runs it itself. Requests are reaped oldest first, so the request taken back is the
one the thread would have waited for anyway, and no request waits on anything but a request that is
running on another thread, which finishes by the same rule. Nested use therefore cannot deadlock,
however busy the pool.

On an error the requests that have not started are cancelled and the running ones are waited for
before the error propagates, so a caller may close the file descriptors they use.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from tierio.io import background
from tierio.io.buffers import ALIGN, align_down

T = TypeVar("T")
R = TypeVar("R")

POOL_THREADS = 32  # enough to keep several NVMe queues and a few nested users busy at once

_pools = background.Pools("tierio-io", POOL_THREADS)


def _reset_after_fork() -> None:
    """A forked child (a DataLoader worker) inherits the thread pool objects but none of their threads,
    and possibly a lock held by a parent thread: start afresh so its first I/O does not hang.
    (Buffer pools are reset the same way in io.buffers.)"""
    global _pools
    _pools = background.Pools("tierio-io", POOL_THREADS)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def executor(nice: int | None = None) -> ThreadPoolExecutor:
    """The shared pool for I/O requests at ``nice`` (default: the calling thread's, so a background
    thread's requests run in the background too; made on first use, per process)."""
    return _pools.here(nice)


# -- requests ----------------------------------------------------------------------------------
@dataclass
class Request(Generic[R]):
    """One call submitted to the shared pool (see ``submit``). ``result`` runs it on the waiting
    thread instead when no pool thread has picked it up yet (see the module docstring)."""

    call: Callable[[], R]
    future: Future

    def result(self) -> R:
        if self.future.cancel():  # still queued: every pool thread is busy, so run it here
            return self.call()
        return self.future.result()

    def cancel(self) -> bool:
        """Drop the request if it has not started; True when it will never run."""
        return self.future.cancel()

    def settle(self) -> None:
        """Cancel the request if it has not started, else wait for it, ignoring its outcome."""
        if not self.future.cancel():
            self.future.exception()


def submit(call: Callable[[], R]) -> Request[R]:
    """Start ``call`` on the shared pool (the background one when called from a background thread)."""
    return Request(call, executor().submit(call))


def settle_all(requests: Iterable[Request]) -> None:
    """Error path: cancel every request not yet started first (so none starts while we wait), then
    wait for the running ones, so that nothing still uses the caller's descriptors or buffers."""
    pending = list(requests)
    for r in pending:
        r.cancel()
    for r in pending:
        r.settle()


def run_windows(windows: Iterable[T], body: Callable[[T], R], depth: int) -> list[R]:
    """``body(window)`` for every window, ``depth`` in flight, oldest reaped first; the results in
    window order. The first error cancels the windows not yet started, waits for the running ones
    and is raised."""
    depth = max(1, depth)
    inflight: deque[Request[R]] = deque()
    results: list[R] = []
    try:
        for w in windows:
            if len(inflight) >= depth:
                results.append(inflight.popleft().result())
            inflight.append(submit(partial(body, w)))
        while inflight:
            results.append(inflight.popleft().result())
    finally:
        settle_all(inflight)  # empty unless an error is on its way out
    return results


_END = object()


def drain(items: Iterable[T], body: Callable[[T], None], workers: int) -> None:
    """``body(item)`` for every item on ``workers`` requests, each taking the next item as soon as
    it finishes one. Unlike ``run_windows``, whose oldest-first reaping starts no new window while
    the oldest is still running, no worker idles behind a slow item: for bodies whose cost varies
    (page faults whose price the host decides). The first error stops the other workers taking
    items and is raised once they are done."""
    it = iter(items)
    lock = threading.Lock()
    failed = threading.Event()

    def worker(_: int) -> None:
        while not failed.is_set():
            with lock:
                item = next(it, _END)
            if item is _END:
                return
            try:
                body(item)  # type: ignore[arg-type]
            except BaseException:
                failed.set()
                raise

    run_windows(range(max(1, workers)), worker, workers)


# -- windows -----------------------------------------------------------------------------------
class HasSpan(Protocol):
    """Anything covering bytes [start, end) of one file or object."""

    start: int
    end: int


@dataclass(frozen=True)
class ByteRange:
    """Bytes [start, end) that a caller wants."""

    start: int
    end: int


@dataclass
class Region:
    """A stretch [start, end) read as one run of windows; ``members`` are the indices (in the
    caller's sequence, in offset order) of the wanted ranges it covers."""

    start: int
    end: int
    members: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Window:
    """One request: bytes [offset, offset + length) of region number ``of``."""

    of: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Windowing:
    """How wanted ranges become requests.

    ``size``: bytes per window; ``depth``: windows in flight; ``merge_gap``: holes of at most this
    many bytes between wanted ranges are read through instead of starting a new region; ``grid``:
    every region starts on a multiple of this (4 KiB for O_DIRECT; 1 MiB where requests that
    straddle a larger allocation unit run slow). Windows are cut every ``size`` bytes from the
    start of their region, so with ``size`` a multiple of ``grid`` every window is on the grid."""

    size: int
    depth: int
    merge_gap: int = 0
    grid: int = ALIGN


def plan(ranges: Sequence[ByteRange], shape: Windowing) -> list[Region]:
    """Merge the non-empty wanted ranges into regions (in offset order) as ``shape`` says."""
    order = sorted((i for i, r in enumerate(ranges) if r.end > r.start), key=lambda i: ranges[i].start)
    out: list[Region] = []
    for i in order:
        r = ranges[i]
        # also merged when its region's grid start would fall inside the previous region: no byte read twice
        if out and (r.start - out[-1].end <= shape.merge_gap or align_down(r.start, shape.grid) < out[-1].end):
            out[-1].end = max(out[-1].end, r.end)
            out[-1].members.append(i)
        else:
            out.append(Region(align_down(r.start, shape.grid), r.end, [i]))
    return out


def windows(regions: Sequence[HasSpan], size: int) -> Iterator[Window]:
    """Windows of ``size`` bytes covering each region from its start, in order."""
    for i, reg in enumerate(regions):
        for at in range(reg.start, reg.end, size):
            yield Window(i, at, min(size, reg.end - at))


def read_windows(regions: Sequence[HasSpan], shape: Windowing, body: Callable[[Window], Any]) -> list[Any]:
    """Cut ``regions`` into windows of ``shape.size`` and run ``body`` on each, ``shape.depth`` at a time."""
    return run_windows(windows(regions, shape.size), body, shape.depth)


def read_range(start: int, end: int, shape: Windowing, body: Callable[[Window], Any]) -> list[Any]:
    """``read_windows`` over the single range [start, end) (no windows when it is empty)."""
    return read_windows(plan([ByteRange(start, end)], shape), shape, body)
