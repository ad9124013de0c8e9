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
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tierio.errors import ConfigError
from tierio.io.numa import first_touch_on

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


def _memfd_available() -> bool:
    return hasattr(os, "memfd_create")


def _register(address: int, size: int) -> bool:
    """Page-lock host memory for CUDA copies; False (logged) where CUDA refuses."""
    import torch

    err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(err) != 0:
        log.warning("could not page-lock a %d-byte staging buffer (cudaHostRegister: %s); device copies from it "
                    "will be synchronous", size, err)
        return False
    return True


def _unregister(address: int) -> None:
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - at exit the CUDA context may be gone already
        pass


def _cuda_available() -> bool:
    """Whether CUDA can use host memory here: never in a process that has not loaded torch (the
    persist process, ``io.offload``; the CLI), which would otherwise load it for its first buffer."""
    if "torch" not in sys.modules:
        return False
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

    def __init__(self, nbytes: int, *, pin: bool | None = None, prefault: bool = True,
                 numa_node: int | None = None, offload: bool = False) -> None:
        if nbytes < 0:
            raise ConfigError(f"HostBuffer size must be >= 0, got {nbytes}")
        self.capacity = align_up(max(nbytes, 1), PAGE)
        self.pinned = False
        self._torch = None
        self.numa_node = numa_node  # its pages were first touched from this node's CPUs (io.numa)
        self.offload = offload and _memfd_available()
        with first_touch_on(numa_node):
            if self.offload:
                self._allocate_offload(prefault, _cuda_available() if pin is None else pin)
            else:
                self._allocate(pin, prefault)
        self.view = memoryview(self.array).cast("B")
        assert address_of(self.array) % ALIGN == 0

    def _allocate(self, pin: bool | None, prefault: bool) -> None:
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

    def _allocate_offload(self, prefault: bool, pin: bool) -> None:
        """Memory the persist process maps too (``io.offload``): a memfd, mapped shared here, and
        page-locked for CUDA (cudaHostRegister) where asked and possible."""
        from tierio.io import offload

        fd = os.memfd_create("tierio-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.capacity)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self._mmap = mmap.mmap(fd, self.capacity, flags=flags)
        except BaseException:
            os.close(fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        if prefault:
            self.array[::PAGE] = 0
        serial = offload.share(address_of(self.array), self.capacity, fd)
        weakref.finalize(self, offload.retire, serial)
        if pin and _cuda_available():
            self.pinned = _register(address_of(self.array), self.capacity)
            if self.pinned:  # weakref callbacks run before the mapping goes
                weakref.finalize(self, _unregister, address_of(self.array))

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
    """Reusable HostBuffers under a memory budget and, optionally, a cap on how many exist.

    ``acquire`` hands out the smallest free buffer that fits. Otherwise it allocates a new one
    while the budget (``budget_bytes``; None: no byte limit) and the cap (``max_buffers``; None:
    no cap) allow, letting go of a free buffer that is too small when either does not; else it
    waits for a ``release``. Buffers are kept while the pool lives, so their pages stay faulted in
    (and pinned) across operations. A waiter also wakes on ``wake()``, when its ``abort`` callback
    may raise (a background failure it must report instead of waiting on), and on ``close()``.
    """

    budget_bytes: int | None
    pin: bool | None = None
    max_buffers: int | None = None
    numa_node: int | None = None   # new buffers are placed on this NUMA node (io.numa); None: where they fall
    offload: bool = False  # new buffers are memory the persist process maps too (io.offload)
    _free: list[HostBuffer] = field(default_factory=list)
    _allocated: int = 0
    _busy: int = 0  # buffers handed out and not released yet
    _allocations: int = 0
    _closed: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def allocations(self) -> int:
        """Buffers created so far (in a steady state this stops growing)."""
        return self._allocations

    def acquire(self, nbytes: int, timeout: float | None = None,
                abort: Callable[[], None] | None = None) -> HostBuffer:
        need = align_up(max(nbytes, 1), PAGE)
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise ConfigError(
                f"a {need}-byte staging buffer exceeds the pool budget of {self.budget_bytes} bytes; "
                "raise the memory budget or write smaller shards"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise ConfigError("this buffer pool is closed; no buffer can be taken from it")
                if self.max_buffers is None or self._busy < self.max_buffers:
                    fits = [b for b in self._free if b.capacity >= need]
                    if fits:
                        buf = min(fits, key=lambda b: b.capacity)
                        self._free.remove(buf)
                        self._busy += 1
                        return buf
                    at_cap = self.max_buffers is not None and len(self._free) + self._busy >= self.max_buffers
                    room = self.budget_bytes is None or self._allocated + need <= self.budget_bytes
                    if self._free and (at_cap or not room):
                        small = self._free.pop(0)  # too small for this request: make room for one that fits
                        self._allocated -= small.capacity
                        continue
                    if room:
                        self._allocated += need
                        self._busy += 1
                        self._allocations += 1
                        break
                if abort is not None:
                    abort()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no staging buffer of {need} bytes became free in {timeout}s")
                self._cond.wait(left)
        try:
            return HostBuffer(need, pin=self.pin, numa_node=self.numa_node, offload=self.offload)
        except BaseException:
            with self._cond:
                self._allocated -= need
                self._busy -= 1
                self._cond.notify_all()
            raise

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            self._busy -= 1
            if self._closed:
                self._allocated -= buf.capacity
            else:
                self._free.append(buf)
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter so that it re-checks its ``abort`` callback."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Drop the free buffers and refuse further acquires; waiters raise."""
        with self._cond:
            self._closed = True
            for buf in self._free:
                self._allocated -= buf.capacity
            self._free.clear()
            self._cond.notify_all()


_shared: dict[str, BufferPool] = {}
_shared_lock = threading.Lock()


def shared_pool(name: str, budget_bytes: int, numa_node: int | None = None) -> BufferPool:
    """The process-wide pool ``name`` (made on first use with ``budget_bytes``), so its buffers are
    faulted in once per process whatever uses them; one per NUMA node asked for."""
    key = name if numa_node is None else f"{name}@node{numa_node}"
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None:
            pool = _shared[key] = BufferPool(budget_bytes=budget_bytes, numa_node=numa_node)
        return pool


def _forget_pools_after_fork() -> None:
    """A forked child (a DataLoader worker) inherits the pools but not the threads that hold their
    buffers or locks: it starts with none, so its first I/O cannot wait on a parent's thread."""
    global _shared_lock
    _shared.clear()
    _shared_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)
