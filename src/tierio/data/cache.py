"""A node-local shard cache (tier 2 NVMe) shared by every process of a node.

* Atomic and verified: a shard is downloaded under ``.partial/``, its xxh3 checked against the
  manifest, then renamed into place. The cached name embeds the checksum, so a file under a
  final name is always a complete, verified copy of that exact shard version.
* Bounded: before a download the cache makes room, evicting least-recently-used shards (the
  mtime is bumped on every use) until the bytes present plus the downloads in flight fit
  ``limit``. A shard larger than the limit is refused up front.
* Never evicts a shard in use: readers hold a shared ``flock`` on the shard file for as long as
  they read it; eviction only removes a file whose exclusive lock it can take without waiting.
  Locks are released by the kernel when a process dies, so a crashed worker pins nothing.
* Only copies are cached: every file here has its original in the remote store.

Coordination is through the filesystem (flock), so DataLoader workers and ranks on one node
share one cache without a server process.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tierio.errors import ConfigError, DiskFullError, NotFoundError, StorageError
from tierio.io.files import os_error
from tierio.storage.base import Store
from tierio.data.shards import ShardInfo, verify_file

log = logging.getLogger(__name__)

_PARTIAL = ".partial"
_RESERVE = ".reserve"
_LOCKS = ".locks"


# flock() locks belong to an open file description, which a forked child (a DataLoader worker)
# shares: a child that kept the parent's descriptor open would hold the parent's lock forever.
# Every lock descriptor is registered here and closed in the child right after fork (closing a
# copy releases nothing; the parent still holds its lock until it closes its own descriptor).
_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.Lock()


def _close_inherited_locks() -> None:
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def lock_fd(path: str | Path, mode: int, *, create: bool = True) -> int:
    """Open ``path`` and flock it (``mode`` may include LOCK_NB); a registered descriptor."""
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    with _LOCK_FDS_GUARD:  # no fork between open and registration
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        _LOCK_FDS.add(fd)
    try:
        fcntl.flock(fd, mode)
    except BaseException:
        release_fd(fd)
        raise
    return fd


def release_fd(fd: int) -> None:
    """Close a registered lock descriptor (a no-op for one this process did not open)."""
    with _LOCK_FDS_GUARD:
        if fd not in _LOCK_FDS:
            return
        _LOCK_FDS.discard(fd)
        os.close(fd)


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    fd = lock_fd(path, mode)
    try:
        yield fd
    finally:
        release_fd(fd)  # closing releases the lock


def local_name(xxh3: str, key: str) -> str:
    """A cached copy's file name: content hash first, so a changed object never matches."""
    return f"{xxh3}-{key.replace('/', '__')}"


def check_fits(info: ShardInfo, limit: int, of: str = "") -> None:
    """A cache of ``limit`` bytes must hold at least this shard (``of``: the dataset, for the message)."""
    if info.size > limit:
        raise ConfigError(
            f"cache_limit {limit} bytes is smaller than shard {info.key} ({info.size} bytes){' of ' + of if of else ''}: "
            f"raise cache_limit to at least a few shards (e.g. {4 * info.size} bytes)"
        )


class ShardCache:
    def __init__(self, store: Store, cache_dir: str | Path, limit: int, *, wait_timeout: float = 60.0) -> None:
        self.store = store
        self.dir = Path(cache_dir).expanduser().absolute()
        self.limit = int(limit)
        self.wait_timeout = wait_timeout
        if self.limit <= 0:
            raise ConfigError(f"cache_limit must be positive, got {limit}")
        try:
            for sub in ("", _PARTIAL, _RESERVE, _LOCKS):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, self.dir, "creating cache directory") from exc
        self.downloaded_bytes = 0
        self.hits = 0
        self.misses = 0

    def name(self, info: ShardInfo) -> str:
        return local_name(info.xxh3, info.key)

    def path(self, info: ShardInfo) -> Path:
        return self.dir / self.name(info)

    def check_fits(self, info: ShardInfo) -> None:
        check_fits(info, self.limit)

    # -- the public operation ------------------------------------------------------------
    def ensure(self, info: ShardInfo) -> Path:
        """Path of a verified local copy of ``info``, downloading it if needed."""
        p = self.path(info)
        if self._present(p, info):
            self.hits += 1
            return p
        self.check_fits(info)
        with _flock(self.dir / _LOCKS / (self.name(info) + ".lock"), fcntl.LOCK_EX):
            if self._present(p, info):  # another process fetched it while we waited
                self.hits += 1
                return p
            self.misses += 1
            with self._reservation(info):
                self._download(info, p)
        return p

    def _present(self, p: Path, info: ShardInfo) -> bool:
        try:
            st = p.stat()
        except FileNotFoundError:
            return False
        if st.st_size != info.size:  # cannot happen through this class; be safe anyway
            p.unlink(missing_ok=True)
            return False
        return True

    def touch(self, p: Path) -> None:
        try:
            os.utime(p)
        except OSError:
            pass

    def _download(self, info: ShardInfo, final: Path) -> None:
        part = self.dir / _PARTIAL / self.name(info)
        where = f"shard {info.key} of {self.store.url}"
        try:
            self.store.get_file(info.key, part)
        except NotFoundError:
            raise NotFoundError(
                f"{where} is listed in the manifest but missing on the store; the dataset is incomplete there: "
                "re-upload it or point the URL at a complete copy"
            ) from None
        except DiskFullError as exc:
            raise DiskFullError(
                f"cache directory {self.dir} ran out of space while downloading {where} ({exc}); "
                "free space there, lower cache_limit below the free space, or use another cache_dir"
            ) from None
        try:
            verify_file(part, info.xxh3, info.size, where)
            os.replace(part, final)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        self.downloaded_bytes += info.size

    # -- space accounting and eviction --------------------------------------------------------
    @contextmanager
    def _reservation(self, info: ShardInfo) -> Iterator[None]:
        rpath = self.dir / _RESERVE / self.name(info)
        deadline = time.monotonic() + self.wait_timeout
        while True:
            with _flock(self.dir / ".cache.lock", fcntl.LOCK_EX):
                if self._make_room(info.size):
                    fd = lock_fd(rpath, fcntl.LOCK_EX)
                    os.ftruncate(fd, 0)
                    os.write(fd, str(info.size).encode())
                    break
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"cache {self.dir} cannot make room for {info.key} ({info.size} bytes) within cache_limit "
                    f"{self.limit}: every cached shard is in use; raise cache_limit or lower prefetch/workers"
                )
            time.sleep(0.05)
        try:
            yield
        finally:
            rpath.unlink(missing_ok=True)
            release_fd(fd)

    def usage(self) -> tuple[int, int]:
        """(bytes of complete shards, bytes reserved by downloads in flight)."""
        present = 0
        for e in os.scandir(self.dir):
            if e.is_file() and not e.name.startswith("."):
                present += e.stat().st_size
        return present, self._reserved()

    def _reserved(self) -> int:
        total = 0
        for e in os.scandir(self.dir / _RESERVE):
            try:
                fd = lock_fd(e.path, fcntl.LOCK_SH | fcntl.LOCK_NB, create=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                try:  # an active download holds it
                    total += int(Path(e.path).read_text() or "0")
                except (OSError, ValueError):
                    pass
                continue
            try:  # nobody holds it: a download that died; drop its leftovers
                os.unlink(e.path)
                (self.dir / _PARTIAL / e.name).unlink(missing_ok=True)
            finally:
                release_fd(fd)
        return total

    def _make_room(self, need: int) -> bool:
        entries = []
        for e in os.scandir(self.dir):
            if e.is_file() and not e.name.startswith("."):
                st = e.stat()
                entries.append((st.st_mtime, e.path, st.st_size))
        used = sum(size for _, _, size in entries) + self._reserved()
        excess = used + need - self.limit
        if excess <= 0:
            return True
        for _, path, size in sorted(entries):
            if excess <= 0:
                break
            if self._evict(path):
                excess -= size
        return excess <= 0

    def _evict(self, path: str) -> bool:
        try:
            fd = lock_fd(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # in use by a reader
            raise
        try:
            os.unlink(path)
            log.debug("evicted %s from shard cache", path)
            return True
        finally:
            release_fd(fd)

    # -- reading ---------------------------------------------------------------------------
    def open_locked(self, info: ShardInfo) -> tuple[Path, int]:
        """Ensure the shard is cached; returns (path, registered fd holding a shared lock on it).

        Release with ``release_fd(fd)``: while it is held, no process evicts the shard."""
        for _ in range(20):
            p = self.ensure(info)
            try:
                fd = lock_fd(p, fcntl.LOCK_SH, create=False)
            except FileNotFoundError:
                continue  # evicted between ensure() and open(): fetch again
            if os.fstat(fd).st_nlink == 0:  # evicted before we locked it
                release_fd(fd)
                continue
            self.touch(p)
            return p, fd
        raise StorageError(f"shard {info.key} keeps being evicted from {self.dir} before it can be read; raise cache_limit")
