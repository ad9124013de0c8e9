"""A store object downloaded into a local file window by window, each window's xxh3 computed
while its bytes are in memory (and compared with the expected one when it is known), so nothing
is read back to verify it. Atomic publication is the node cache's (the file lives in a fill's
scratch directory until then); used by the weight cache and the dataset shard cache."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from tierio.errors import IntegrityError, os_error
from tierio.io import pagecache
from tierio.io.buffers import ALIGN, BufferPool, align_up
from tierio.io.checksum import xxh3
from tierio.io.direct import open_file, pwrite_all
from tierio.io.engine import Window, Windowing, read_range
from tierio.storage.base import Store


class WindowWriter:
    """Writes windows of one file at their offsets, in any order, from any thread.

    ``direct``: O_DIRECT writes where the filesystem allows (windows must then be aligned; the
    padding of the last one is cut by ``close(size)``). ``prefetch``: each O_DIRECT window is read
    back into the page cache in the background, so the file is resident when the download ends.
    ``expected`` (one xxh3 per ``window`` bytes): a window that does not match is refused before
    it is written; ``where`` names the object in that error. ``sums`` keeps every window's xxh3."""

    def __init__(self, path: Path, *, direct: bool = False, prefetch: bool = False,
                 expected: Sequence[str] | None = None, window: int = 0, where: str = "") -> None:
        self.path, self.prefetch, self.expected, self.window, self.where = path, prefetch, expected, window, where
        if direct:
            self.fd, self.direct = open_file(path, write=True, direct=True)
        else:  # exclusive: a scratch file is never shared
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise os_error(exc, path, "creating") from exc
            self.direct = False
        self.sums: dict[int, str] = {}
        self.written = 0
        self._lock = threading.Lock()

    def write(self, offset: int, view: memoryview, n: int) -> None:
        digest = xxh3(view[:n])
        if self.expected is not None:
            want = self.expected[offset // self.window]
            if digest != want:
                raise IntegrityError(f"{self.where}: bytes {offset}..{offset + n} do not match their checksum (expected "
                                     f"xxh3 {want}, got {digest}); the copy on the store is corrupt")
        data = view[: align_up(n)] if self.direct and offset % ALIGN == 0 else view[:n]
        if self.direct and len(data) % ALIGN:  # cannot happen with aligned windows; stay safe
            raise IntegrityError(f"unaligned window at {offset} for {self.path}")
        pwrite_all(self.fd, data, offset, self.path)
        if self.prefetch and self.direct:  # buffered writes left the bytes in the page cache already
            try:
                pagecache.prefetch(self.fd, offset, n)
            except OSError as exc:
                raise os_error(exc, self.path, "reading back cache file") from exc
        with self._lock:
            self.sums[offset] = digest
            self.written += n

    def close(self, size: int | None = None, *, sync: bool = True) -> None:
        """Finish the file: cut it to ``size`` (the O_DIRECT padding), fsync it unless ``sync`` is
        False (the node cache then flushes it after the commit, off the reader's path)."""
        try:
            if size is not None:
                os.ftruncate(self.fd, size)
            if sync:
                os.fsync(self.fd)
        except OSError as exc:
            raise os_error(exc, self.path, "finishing cache file") from exc
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        """Close without finishing (the fill failed; its scratch directory is discarded)."""
        try:
            os.close(self.fd)
        except OSError:
            pass


def download_verified(store: Store, key: str, path: Path, size: int, window: int, expected: Sequence[str], *,
                      buffers: BufferPool, depth: int, where: str) -> None:
    """Ranged reads of ``window`` bytes of ``key`` (``depth`` in flight), each checked against
    ``expected`` and written at its offset into the new file ``path``, buffered and not fsynced:
    the pages stay in the page cache for the reader that maps the file next."""
    writer = WindowWriter(path, expected=expected, window=window, where=where)

    def one(w: Window) -> None:
        buf = buffers.acquire(w.length)
        try:
            view = buf.view[: w.length]
            store.read_into(key, w.offset, view)
            writer.write(w.offset, view, w.length)
        finally:
            buffers.release(buf)

    try:
        read_range(0, size, Windowing(window, depth, grid=window), one)
    except BaseException:
        writer.abort()
        raise
    writer.close(sync=False)


__all__ = ["WindowWriter", "download_verified"]
