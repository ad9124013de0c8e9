"""Host staging buffers (tier 1): page-aligned, pre-faulted once, reused.

First-touch page faults are the hidden cost of host staging: on a fresh allocation every 4 KiB page
faults once, which on virtual machines runs at well under 1 GB/s. A HostBuffer pays that once at
creation and is then reused for every save or load, so steady-state copies run at memcpy speed.
Where CUDA exists the memory is page-locked so device copies can run asynchronously.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from tierio.errors import ConfigError

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
ALIGN = 4096  # O_DIRECT alignment that every Linux block device accepts


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int = ALIGN) -> int:
    return n // a * a


def address_of(buf: memoryview | bytearray | bytes | np.ndarray) -> int:
    """Memory address of a buffer's first byte (read-only buffers included)."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return int(arr.__array_interface__["data"][0])


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch import problems must not break I/O
        return False


class HostBuffer:
    """A page-aligned, pre-faulted host buffer; pinned (page-locked) when CUDA is available.

    ``view`` is a writable memoryview over the whole capacity; ``array`` a uint8 numpy view;
    ``tensor()`` a torch uint8 view (no copy).
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None, prefault: bool = True) -> None:
        if nbytes < 0:
            raise ConfigError(f"HostBuffer size must be >= 0, got {nbytes}")
        self.capacity = align_up(max(nbytes, 1), PAGE)
        self.pinned = False
        self._torch = None
        want_pin = _cuda_available() if pin is None else pin
        if want_pin and _cuda_available():
            import torch

            # cudaHostAlloc returns page-aligned memory; keep the tensor alive as the owner.
            self._torch = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
            self.array = self._torch.numpy()
            self.pinned = True
            self._mmap = None
        else:
            # MAP_POPULATE faults every page in at creation, in the kernel, faster than touching.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self._mmap = mmap.mmap(-1, self.capacity, flags=flags)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        if prefault and not self.pinned:
            self.array[::PAGE] = 0  # no-op cost when MAP_POPULATE already faulted them
        self.view = memoryview(self.array).cast("B")
        assert address_of(self.array) % ALIGN == 0

    def __len__(self) -> int:
        return self.capacity

    def tensor(self):
        """The buffer as a torch.uint8 tensor sharing memory (no copy)."""
        import torch

        if self._torch is None:
            self._torch = torch.from_numpy(self.array)
        return self._torch

    def __repr__(self) -> str:
        return f"HostBuffer({self.capacity} bytes, pinned={self.pinned})"


@dataclass
class BufferPool:
    """Reusable HostBuffers under a memory budget.

    ``acquire`` hands out the smallest free buffer that fits, allocating a new one only while the
    budget allows; otherwise it waits for a ``release``. Buffers are never freed while the pool lives,
    so their pages stay faulted in (and pinned) across operations.
    """

    budget_bytes: int
    pin: bool | None = None
    _free: list[HostBuffer] = field(default_factory=list)
    _allocated: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        need = align_up(max(nbytes, 1), PAGE)
        if need > self.budget_bytes:
            raise ConfigError(
                f"a {need}-byte staging buffer exceeds the pool budget of {self.budget_bytes} bytes; "
                "raise the memory budget or write smaller shards"
            )
        with self._cond:
            while True:
                fits = [b for b in self._free if b.capacity >= need]
                if fits:
                    buf = min(fits, key=lambda b: b.capacity)
                    self._free.remove(buf)
                    return buf
                if self._allocated + need <= self.budget_bytes:
                    self._allocated += need
                    break
                if self._free:  # budget is held by free buffers that are too small: replace one
                    small = self._free.pop(0)
                    self._allocated -= small.capacity
                    continue
                if not self._cond.wait(timeout):
                    raise TimeoutError(f"no staging buffer of {need} bytes became free in {timeout}s")
        try:
            return HostBuffer(need, pin=self.pin)
        except BaseException:
            with self._cond:
                self._allocated -= need
            raise

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()


_shared: dict[str, BufferPool] = {}
_shared_lock = threading.Lock()


def shared_pool(name: str, budget_bytes: int) -> BufferPool:
    """The process-wide pool ``name`` (made on first use with ``budget_bytes``), so its buffers are
    faulted in once per process whatever uses them."""
    with _shared_lock:
        pool = _shared.get(name)
        if pool is None:
            pool = _shared[name] = BufferPool(budget_bytes=budget_bytes)
        return pool


def _forget_pools_after_fork() -> None:
    """A forked child (a DataLoader worker) inherits the pools but not the threads that hold their
    buffers or locks: it starts with none, so its first I/O cannot wait on a parent's thread."""
    global _shared_lock
    _shared.clear()
    _shared_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)
