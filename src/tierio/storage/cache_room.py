"""Room in the node-local cache: reservations of fills in flight, LRU eviction, index trimming.

A mixin of ``NodeCache`` (tierio.storage.cache), which holds the entries, pins and fills; this half
decides what fits and evicts what must go, always under the cache's lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tierio import events
from tierio.errors import CacheLimitError, DiskFullError, FormatError, NotFoundError
from tierio.io.locks import release_fd
from tierio.io.paths import open_beneath
from tierio.io.space import disk_space
from tierio.storage.cache_files import _POLL, _STALE_TEMP_S, INDEXES, PARTIAL, RESERVE, flock_own
from tierio.storage.cache_records import EntryInfo

log = logging.getLogger(__name__)


class RoomKeeping:
    """Making room for fills; the cache's root, options, lock and entries come from ``NodeCache``."""

    @contextmanager
    def _reservation(self, name: str, size: int, where: str) -> Iterator[None]:
        """Claim ``size`` bytes for a fill, making room first; waits while pins keep it from fitting."""
        deadline = time.monotonic() + self.options.wait_timeout
        while True:
            with self._cache_lock():
                if self._make_room(size, exclude=name):
                    self._check_free(size, where)
                    fd = self._claim(name, size)
                    break
            if time.monotonic() >= deadline:
                raise CacheLimitError(
                    f"the cache at {self.root} cannot make room for {where} ({size} bytes) within its limit of "
                    f"{self.limit} bytes: every entry that could be evicted is in use; raise {{setting}}, or run "
                    "fewer readers (or less prefetch) at once", self.options.limit_setting
                )
            time.sleep(_POLL)
        try:
            yield
        finally:
            self._remove(RESERVE, name)
            release_fd(fd)

    def _claim(self, name: str, size: int) -> int:
        fd = flock_own(self.root, f"{RESERVE}/{name}", fcntl.LOCK_EX)
        assert fd is not None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(size).encode(), 0)
        except BaseException:
            release_fd(fd)
            raise
        return fd

    def _check_free(self, size: int, where: str) -> None:
        space = disk_space(self.root)
        if space is not None and space[1] < size:
            raise DiskFullError(
                f"cache directory {self.root} has {space[1]} bytes free but {where} needs {size}: free space there, "
                "lower the cache limit below the free space, or use another cache directory"
            )

    def _reserved(self) -> int:
        """Bytes claimed by live fills; the claims of fills that died are removed with their scratch."""
        total = 0
        for e in os.scandir(self.root / RESERVE):
            try:
                fd = flock_own(self.root, f"{RESERVE}/{e.name}", fcntl.LOCK_SH | fcntl.LOCK_NB, create=False)
            except NotFoundError:
                continue
            if fd is None:  # a live fill holds it
                total += self._claimed(e.name)
                continue
            try:
                self._remove(RESERVE, e.name)
                self._remove(PARTIAL, e.name)
            finally:
                release_fd(fd)
        return total

    def _claimed(self, name: str) -> int:
        try:
            fd = open_beneath(self.root, f"{RESERVE}/{name}", os.O_RDONLY)
        except (NotFoundError, FormatError, OSError):
            return 0
        try:
            text = os.read(fd, 32)
        finally:
            os.close(fd)
        return int(text) if text.isdigit() else 0

    def _make_room(self, need: int, exclude: str) -> bool:
        """Evict least recently used entries until ``need`` more bytes fit. Evicts nothing when the
        entries it can take (none pinned) would not free enough: then the caller waits."""
        self._trim_indexes()
        entries = [e for e in self.entries() if e.name != exclude]
        excess = sum(e.bytes for e in entries) + self._reserved() + need - self.limit
        if excess <= 0:
            return True
        held: list[tuple[EntryInfo, int]] = []
        try:
            for e in entries:
                if excess <= 0:
                    break
                fd = self._entry_lock(e.name, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if fd is not None:  # None: in use right now
                    held.append((e, fd))
                    excess -= e.bytes
            if excess > 0:
                return False
            for e, _ in held:
                self._drop(e.name)
                log.debug("evicted %s (%d bytes) from the cache at %s", e.name, e.bytes, self.root)
                events.emit(events.CacheEviction(self.options.name, e.bytes))
            return True
        finally:
            for _, fd in held:
                release_fd(fd)

    def _trim_indexes(self) -> None:
        limit = self.options.indexes
        files = []
        now = time.time()
        for e in os.scandir(self.root / INDEXES):
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if e.name.startswith("."):
                if now - st.st_mtime > _STALE_TEMP_S:
                    self._remove(INDEXES, e.name)
                continue
            files.append((st.st_mtime_ns, e.name, st.st_size))
        total = sum(size for _, _, size in files)
        for _, name, size in sorted(files):
            if total <= limit:
                break
            self._remove(INDEXES, name)
            total -= size
