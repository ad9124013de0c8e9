"""Two small measurements the doctor makes in a directory: does O_DIRECT work, and does the device
need a deep queue (QD1 versus QD32 random-read bandwidth)?

Both write one scratch file of a few MiB, bypass the page cache with O_DIRECT (so the figures are
the device's, not RAM's), stay under about two seconds, and remove the file afterwards.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _aligned(size: int) -> mmap.mmap:
    """An anonymous mapping: page-aligned, as O_DIRECT wants, and pre-faulted by the first write."""
    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(min(size, 1 << 16)) * (size // min(size, 1 << 16)))
    return buf


def _scratch(directory: str) -> str:
    return os.path.join(directory, f".tierio-doctor-{uuid.uuid4().hex[:12]}")


@dataclass(frozen=True)
class DirectResult:
    supported: bool | None  # None: could not be tested (no O_DIRECT on this OS, or no write permission)
    reason: str = ""


def odirect_supported(directory: str) -> DirectResult:
    """Try one aligned 4 KiB O_DIRECT write in ``directory``; EINVAL means the filesystem refuses it."""
    if not _O_DIRECT:
        return DirectResult(None, "this operating system has no O_DIRECT")
    path = _scratch(directory)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL | _O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return DirectResult(False, "open(O_DIRECT) returned EINVAL")
        return DirectResult(None, f"cannot create a scratch file here ({exc.strerror})")
    try:
        buf = _aligned(ALIGN)
        try:
            os.pwrite(fd, buf, 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return DirectResult(False, "aligned O_DIRECT write returned EINVAL")
            return DirectResult(None, f"scratch write failed ({exc.strerror})")
        finally:
            buf.close()
        return DirectResult(True)
    finally:
        os.close(fd)
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass(frozen=True)
class QueueDepthResult:
    qd1_bps: float | None
    qd32_bps: float | None
    block: int
    file_bytes: int
    reason: str = ""


def queue_depth_probe(directory: str, file_bytes: int = 32 << 20, block: int = 64 << 10,
                      seconds_each: float = 0.4, depth: int = 32) -> QueueDepthResult:
    """Random O_DIRECT reads of ``block`` bytes from a ``file_bytes`` scratch file, first one at a
    time (QD1), then from ``depth`` threads at once (QD32); each phase runs ``seconds_each``.

    Threads stand in for an async queue: os.preadv releases the GIL, so ``depth`` requests are
    in flight in the kernel at once.
    """
    if not _O_DIRECT:
        return QueueDepthResult(None, None, block, file_bytes, "this operating system has no O_DIRECT")
    path = _scratch(directory)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL | _O_DIRECT, 0o600)
    except OSError as exc:
        reason = "filesystem refuses O_DIRECT" if exc.errno == errno.EINVAL else f"cannot create a scratch file ({exc.strerror})"
        return QueueDepthResult(None, None, block, file_bytes, reason)
    try:
        chunk = _aligned(1 << 20)
        try:
            for off in range(0, file_bytes, 1 << 20):
                os.pwrite(fd, chunk, off)
            os.fsync(fd)
        except OSError as exc:
            reason = "filesystem refuses O_DIRECT" if exc.errno == errno.EINVAL else f"scratch write failed ({exc.strerror})"
            return QueueDepthResult(None, None, block, file_bytes, reason)
        finally:
            chunk.close()
        blocks = file_bytes // block
        qd1 = _read_phase(fd, blocks, block, 1, seconds_each)
        qdn = _read_phase(fd, blocks, block, depth, seconds_each)
        return QueueDepthResult(qd1, qdn, block, file_bytes)
    except OSError as exc:
        return QueueDepthResult(None, None, block, file_bytes, f"read probe failed ({exc.strerror})")
    finally:
        os.close(fd)
        _unlink(path)


def _read_phase(fd: int, blocks: int, block: int, threads: int, seconds: float) -> float:
    done = [0] * threads
    errors: list[OSError] = []
    deadline = time.perf_counter() + seconds

    def reader(i: int) -> None:
        rng = random.Random(i)
        buf = mmap.mmap(-1, block)
        try:
            while time.perf_counter() < deadline:
                n = os.preadv(fd, [buf], rng.randrange(blocks) * block)
                if n <= 0:
                    break
                done[i] += n
        except OSError as exc:
            errors.append(exc)
        finally:
            buf.close()

    start = time.perf_counter()
    workers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return sum(done) / max(time.perf_counter() - start, 1e-9)
