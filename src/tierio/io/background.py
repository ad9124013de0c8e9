"""Background threads: they give a contended core to the training step first.

A checkpoint persists, checksums and promotes on threads of the training process. Their byte loops
run with the GIL released, but they still use CPU (copies into the page cache, hashing, HTTP), and
where every core is busy (a CPU-bound input pipeline, a small VM) they compete with the step's own
thread for the cores. Linux applies niceness per thread, so those threads run at a higher niceness:
the scheduler hands a contended core to the step first (CFS weighs nice 10 at 110 against 1024 for
nice 0) and an idle core to them as before. Where cores are free nothing changes.

Niceness settles who gets a contended core, not who holds the GIL. A background thread asks for
the GIL back each time a call that released it returns, and a training thread running Python is
then made to hand it over (after the 5 ms switch interval): every handover costs the step two
context switches. So background threads also move bytes in few, long calls (``request_shape``):
behind a 512 MiB save, 8 MiB write requests slowed a Python-heavy step by about 5 % where
64 MiB requests cost nothing measurable (docs/integrations.md, "Background work and the GIL").

A thread cannot lower its niceness again without CAP_SYS_NICE, so background work runs on threads
that stay background for their life: pools made with ``pool()`` mark their threads when they start,
and the I/O requests such a thread submits go to the engine's pool of the same niceness
(``io.engine.submit``), so the bytes a background save moves are moved in the background too.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("tierio.io")

DEFAULT_NICE = 10  # the niceness added to background threads (CheckpointOptions.background_nice)
MAX_NICE = 19
REQUEST_BYTES = 64 << 20  # the least a background byte loop moves per call
REQUEST_DEPTH = 2  # and at most this many in flight (the bytes in flight stay about a foreground loop's)

_local = threading.local()


def mark(nice: int) -> None:
    """Make the calling thread a background thread ``nice`` levels below the process (a pool
    initializer). Without the means to renice (not Linux, a sandbox refusing it), the thread still
    counts as background, so its I/O stays on the same pool, and it runs at the process's niceness."""
    nice = max(0, min(int(nice), MAX_NICE))
    _local.nice = nice
    if nice == 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        # relative to the process (its first thread), not to the thread that started this one
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice))
    except OSError as e:
        log.debug("could not lower the priority of background thread %s: %s", threading.current_thread().name, e)


def level() -> int:
    """The calling thread's niceness above the process's (0: not a background thread): as marked,
    or for a thread started by a background thread, the niceness it inherited from it (read once),
    so that its I/O, too, stays off the pools that serve training."""
    nice = getattr(_local, "nice", None)
    if nice is None:
        try:
            nice = max(0, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                       - os.getpriority(os.PRIO_PROCESS, os.getpid()))
        except (OSError, AttributeError):
            nice = 0
        _local.nice = nice
    return nice


def request_shape(chunk_bytes: int | None, depth: int | None, default_chunk: int, default_depth: int) -> tuple[int, int]:
    """(bytes per request, requests in flight) of a byte loop: the caller's, else the defaults,
    which a background thread widens to few long calls (see the module docstring)."""
    if level() == 0:
        return chunk_bytes or default_chunk, depth or default_depth
    return chunk_bytes or max(default_chunk, REQUEST_BYTES), depth or min(default_depth, REQUEST_DEPTH)


def pool(name: str, nice: int, workers: int = 1) -> ThreadPoolExecutor:
    """A pool whose threads are background threads at ``nice`` (0: ordinary threads)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=mark, initargs=(nice,))


class Pools:
    """A shared pool per niceness, made on first use: work runs on the pool of the calling thread's
    level. (A pool's threads start from the thread that submits and inherit its niceness, so one
    pool shared by both kinds of caller would end up with background threads serving training.)"""

    def __init__(self, name: str, workers: int) -> None:
        self.name, self.workers = name, workers
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def here(self, nice: int | None = None) -> ThreadPoolExecutor:
        """The pool for ``nice`` (default: the calling thread's level)."""
        nice = level() if nice is None else nice
        with self._lock:
            got = self._pools.get(nice)
            if got is None:
                name = self.name if nice == 0 else f"{self.name}-bg{nice}"
                got = self._pools[nice] = pool(name, nice, self.workers)
            return got

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.shutdown(wait=wait)


__all__ = ["DEFAULT_NICE", "REQUEST_BYTES", "REQUEST_DEPTH", "Pools", "level", "mark", "pool", "request_shape"]
