"""Linux native AIO (io_submit) for many small O_DIRECT reads from one thread.

Why: a read per ``os.preadv`` call costs a system call, a thread switch and some Python per
request; for pieces of a few KiB (a tensor-parallel rank's row pieces) that, not the device,
was the limit. ``io_submit`` hands the kernel a whole array of requests in one call and
``io_getevents`` returns many completions in one, so Python's work is per batch: the request
descriptors (``struct iocb``) are built for all requests at once as a numpy record array.

Only O_DIRECT reads are asynchronous under native AIO (a buffered one runs inside io_submit), so
callers use it for O_DIRECT descriptors only. Where the system calls are missing (another
architecture, a kernel without AIO, ``fs.aio-max-nr`` exhausted) ``available()`` is False or
``Context`` raises OSError, and the caller reads with threads instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from functools import lru_cache

import numpy as np

from tierio.io.pagecache import libc

# (io_setup, io_destroy, io_submit, io_getevents) by machine
_SYSCALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_IOCB_CMD_PREAD = 0

IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                 ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                 ("flags", "<u4"), ("resfd", "<u4")])
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert IOCB.itemsize == 64 and EVENT.itemsize == 32


@lru_cache(maxsize=1)
def _numbers() -> tuple[int, int, int, int] | None:
    if libc() is None or not hasattr(libc(), "syscall"):
        return None
    return _SYSCALLS.get(platform.machine())


def available() -> bool:
    return _numbers() is not None


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class Context:
    """One AIO context of ``depth`` slots; ``read`` runs an array of reads through it."""

    def __init__(self, depth: int) -> None:
        nums = _numbers()
        if nums is None:
            raise OSError(errno.ENOSYS, f"native AIO is not available on {platform.machine()}")
        self._setup, self._destroy, self._submit, self._getevents = nums
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        if libc().syscall(ctypes.c_long(self._setup), ctypes.c_long(depth), ctypes.byref(self._ctx)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_setup({depth}): {os.strerror(code)}")

    @property
    def open(self) -> bool:
        return bool(self._ctx.value)

    def close(self) -> None:
        if self._ctx.value:
            libc().syscall(ctypes.c_long(self._destroy), self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addresses: np.ndarray) -> np.ndarray:
        """Read ``lengths[i]`` bytes at ``offsets[i]`` into memory at ``addresses[i]`` for every i,
        ``depth`` in flight; each read's result (bytes, or -errno), in the same order."""
        n = len(offsets)
        cbs = np.zeros(n, IOCB)
        cbs["data"] = np.arange(n)
        cbs["opcode"] = _IOCB_CMD_PREAD
        cbs["fildes"] = fd
        cbs["buf"], cbs["nbytes"], cbs["offset"] = addresses, lengths, offsets
        ptrs = _address(cbs) + IOCB.itemsize * np.arange(n, dtype=np.uint64)
        events = np.zeros(self.depth, EVENT)
        res = np.zeros(n, np.int64)
        sent = done = 0
        call = libc().syscall
        try:
            while done < n:
                room = min(self.depth - (sent - done), n - sent)
                if room > 0:
                    got = call(ctypes.c_long(self._submit), self._ctx, ctypes.c_long(room),
                               ctypes.c_void_p(_address(ptrs) + 8 * sent))
                    if got < 0:
                        code = ctypes.get_errno()
                        if code != errno.EAGAIN or sent == done:
                            raise OSError(code, f"io_submit: {os.strerror(code)}")
                    else:
                        sent += got
                if sent > done:
                    # wait for a quarter of the slots, not one: a refill per completion costs Python per request
                    least = max(1, min(sent - done, self.depth // 4))
                    k = call(ctypes.c_long(self._getevents), self._ctx, ctypes.c_long(least), ctypes.c_long(self.depth),
                             ctypes.c_void_p(_address(events)), None)
                    if k < 0:
                        code = ctypes.get_errno()
                        if code == errno.EINTR:
                            continue
                        raise OSError(code, f"io_getevents: {os.strerror(code)}")
                    got_events = events[:k]
                    res[got_events["data"].astype(np.int64)] = got_events["res"]
                    done += k
        except BaseException:
            self.close()  # io_destroy waits for the requests in flight, which write into the caller's memory
            raise
        return res


_local = threading.local()


def thread_context(depth: int) -> Context:
    """This thread's context of ``depth`` slots, made on first use and kept: ``io_destroy`` waits
    for an RCU grace period (36 ms measured here, as long as the reads of a whole tensor). Checked
    against the process id, since a forked child does not inherit its parent's contexts."""
    mine = getattr(_local, "ctx", None)
    if mine is None or mine[0] != os.getpid() or mine[1].depth < depth or not mine[1].open:
        if mine is not None and mine[0] == os.getpid():
            mine[1].close()
        mine = (os.getpid(), Context(depth))
        _local.ctx = mine
    return mine[1]


__all__ = ["EVENT", "IOCB", "Context", "available", "thread_context"]
