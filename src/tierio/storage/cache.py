"""The node-local cache: keyed entries on a local disk, shared by every process of a node.

The shard cache of ``tierio.data`` and the weight cache of ``tierio.weights`` are thin users of
this one. Layout under ``root``::

    entries/<name>        committed entries: one file (a shard) or a directory of files (a model)
    indexes/<name>        small metadata cached beside the data (shard indexes): not counted
                          against the limit, never pinned, trimmed oldest first past index_limit
    locks/<name>.lock     one per entry: shared while the entry is in use (a pin), exclusive
                          while it is filled, replaced or evicted
    .partial/<name>/      the scratch directory of a fill in progress
    .reserve/<name>       the bytes a fill in flight has claimed (locked by the filler while alive)
    unsynced/<name>       an entry committed before its bytes reached the disk (see below)
    .lock                 held while counting and evicting

* **Safe names by construction.** ``entry_name(key)`` derives every file name from the caller's
  key (a readable tail and 128 bits of its SHA-256): nothing read from data is ever joined into a
  path here. The cache's own files are opened without following links (``io.paths``); a link or a
  FIFO planted where a lock or an index should be is removed (never followed) and the file made
  afresh, and removals go through directory descriptors, so nothing outside ``root`` is touched.
* **Pins, never evicted.** A user holds a shared ``flock`` on the entry's lock file for as long as
  it reads the entry; eviction takes only entries whose exclusive lock it gets without waiting.
  The kernel drops the locks of a process that dies, so a crashed reader pins nothing.
* **Bounded, fills in flight included.** Before a fill the cache makes room: the bytes present
  plus the reservations of fills in flight plus the new entry must fit ``limit``. It evicts least
  recently used entries, and only when evicting the free ones is enough: a cache full of pinned
  entries evicts nothing and waits (``wait_timeout``) for pins to go. The use clock is a
  nanosecond ``time_ns`` stamp on the entry (the kernel's file times are a few ms coarse).
* **Atomic and verified.** A fill writes into ``.partial/<name>/``, the caller's verify hook may
  refuse the copy, and only then is it renamed into ``entries/``. A fill that dies leaves a
  reservation nobody holds; the next accounting pass removes it and its scratch directory.
* **Committed at once, synced behind.** A fill that says so (``FillPlan.durable=False``) is
  committed as soon as it is written and verified, and its bytes are flushed to the disk in the
  background afterwards: readers use it from the page cache meanwhile. Until the flush is done a
  marker ``unsynced/<name>`` says so; an entry whose marker is older than the running system (a
  crash or a power loss came between commit and flush, so the file may hold zeros) is not used
  but filled again.
* **Fork-safe.** Every locked descriptor is registered and closed in a forked child (a DataLoader
  worker), which would otherwise hold its parent's pins for as long as it lives.

Coordination is through the filesystem only, so DataLoader workers and ranks of a node share one
cache without a server process.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Literal

from tierio import events
from tierio.errors import ConfigError, DiskFullError, FormatError, NotFoundError, StorageError, TierioError
from tierio.io.engine import submit
from tierio.io.files import os_error
from tierio.io.paths import key_parts, open_beneath, open_dir_beneath
from tierio.io.space import disk_space
from tierio.io.untrusted import check_int

log = logging.getLogger(__name__)

ENTRIES = "entries"
INDEXES = "indexes"
LOCKS = "locks"
PARTIAL = ".partial"
RESERVE = ".reserve"
CACHE_LOCK = ".lock"
UNSYNCED = "unsynced"  # made on first use: only fills that flush behind need it
LAYOUT = (ENTRIES, INDEXES, LOCKS, PARTIAL, RESERVE)

Kind = Literal["file", "dir"]
_POLL = 0.05  # seconds between attempts to make room while every evictable entry is pinned
_ATTEMPTS = 20  # an entry evicted this many times between filling and pinning it: give up
_STALE_TEMP_S = 3600.0  # an index temp file this old belongs to a writer that died

# -- locked descriptors, closed in forked children ------------------------------------------------
# flock() locks belong to an open file description, which a forked child shares: a child that kept
# the parent's descriptor open would hold the parent's lock for as long as it lives. Every locked
# descriptor is registered here and closed in the child right after fork (closing the child's copy
# releases nothing: the parent keeps its lock until it closes its own descriptor).
_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.Lock()


def _hold_guard_for_fork() -> None:
    # No fork between another thread's open of a lock file and its registration: the child would
    # keep that descriptor, unregistered, and with it whatever lock the parent takes on it later.
    _LOCK_FDS_GUARD.acquire()


def _release_guard_after_fork() -> None:
    _LOCK_FDS_GUARD.release()


def _close_inherited_locks() -> None:
    global _LOCK_FDS_GUARD
    _LOCK_FDS_GUARD = threading.Lock()  # the parent's is held across the fork
    for fd in _LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_hold_guard_for_fork, after_in_parent=_release_guard_after_fork,
                        after_in_child=_close_inherited_locks)


def release_fd(fd: int) -> None:
    """Close a registered lock descriptor, releasing its lock (a no-op for one not registered)."""
    with _LOCK_FDS_GUARD:
        if fd not in _LOCK_FDS:
            return
        _LOCK_FDS.discard(fd)
        os.close(fd)


def entry_name(key: str) -> str:
    """The file name of ``key``'s entry: a readable tail of the key and 128 bits of its SHA-256.

    Only letters, digits, '.', '_' and '-', never a leading '.', so it is one plain name inside
    the cache whatever the key holds (keys come from manifests, indexes and URLs)."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"a cache key must be a non-empty string, got {key!r}")
    tail = key.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:48].lstrip(".") or "entry"
    return f"{tail}-{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


# -- the cache's own files, reached without following links ---------------------------------------
def _remove_at(dfd: int, name: str) -> bool:
    """Remove ``name`` in the directory ``dfd`` (a file, a link, or a whole tree); links are
    removed, never followed."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        return False
    return True


def _open_own(root: Path, rel: str, flags: int) -> int:
    """Open one of the cache's files, following no link. Anything else planted at that name (a
    link, a FIFO, a directory) is removed and, when ``flags`` create, the file is made afresh."""
    parts = rel.split("/")
    for _ in range(3):
        try:
            fd = open_beneath(root, rel, flags)
        except (FormatError, IsADirectoryError):  # a link, or not a regular file: not ours
            fd = -1
        if fd >= 0:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
        log.warning("removing %s/%s: not a regular file where the cache keeps its own", root, rel)
        dfd = open_dir_beneath(root, parts[:-1])
        try:
            _remove_at(dfd, parts[-1])
        finally:
            os.close(dfd)
        if not flags & os.O_CREAT:
            raise NotFoundError(f"{root}/{rel} does not exist")
    raise StorageError(f"{root}/{rel} keeps being replaced by something that is not a regular file; "
                       "check what else writes into the cache directory")


def _flock_own(root: Path, rel: str, mode: int, *, create: bool = True) -> int | None:
    """Open and flock one of the cache's files; a registered descriptor, or None when ``mode``
    has LOCK_NB and another holder has a conflicting lock."""
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    with _LOCK_FDS_GUARD:  # no fork between the open and the registration
        fd = _open_own(root, rel, flags)
        _LOCK_FDS.add(fd)
    try:
        fcntl.flock(fd, mode)
    except OSError as exc:
        release_fd(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise os_error(exc, root / rel, "locking") from exc
    except BaseException:
        release_fd(fd)
        raise
    return fd


# -- records --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheOptions:
    """How big a cache may grow, how long a fill waits for room, and how long a reader waits for
    another process's fill of the same entry."""

    limit: int  # bytes of entries, fills in flight included
    wait_timeout: float = 60.0  # seconds a fill waits while every evictable entry is pinned
    # A fill of a large model from remote storage takes minutes: a reader waits for it (bounded)
    # rather than failing, whatever ``wait_timeout`` allows for room. Every wait on an entry's lock
    # (a pin behind a fill, an eviction behind a pin) ends after it, with an EntryBusyError.
    fill_wait: float = 3600.0
    index_limit: int | None = None  # bytes of cached indexes; None: limit // 16, at least 16 MiB
    name: str = "cache"  # what the cache holds ("shards", "weights"), as reported to tierio.events

    @property
    def indexes(self) -> int:
        return self.index_limit if self.index_limit is not None else max(self.limit // 16, 16 << 20)


@dataclass(frozen=True)
class FillPlan:
    """How to make an entry on a miss; asked for only under the entry's exclusive lock.

    ``write(target)`` creates the entry at ``target`` (a file path, or an empty directory for a
    directory entry); ``verify(target)`` may refuse what was written by raising. Nothing is kept
    unless both return."""

    size: int  # bytes the entry will take, claimed against the limit before anything is written
    write: Callable[[Path], None]
    where: str  # what is being cached, for messages ("shard x.tar of s3://bucket/data")
    verify: Callable[[Path], None] | None = None
    durable: bool = True  # False: write() did not flush; the cache commits now and flushes behind


@dataclass(frozen=True)
class EntryInfo:
    name: str
    path: Path
    bytes: int
    used_ns: int  # the use clock: time_ns of the last fill or pin

    @property
    def last_used(self) -> float:
        return self.used_ns / 1e9


@dataclass(frozen=True)
class Usage:
    present: int  # bytes of committed entries
    reserved: int  # bytes claimed by fills in flight


class EntryBusyError(StorageError):
    """Another process held a cache entry's lock for longer than a reader waits (``fill_wait``)."""


class Pin:
    """A pinned entry: until ``release()``, no process evicts or replaces it.

    ``hit`` tells whether it was already cached; ``fd`` is the registered descriptor holding the
    shared lock (``release_fd(fd)`` releases it too)."""

    def __init__(self, name: str, path: Path, fd: int, hit: bool) -> None:
        self.name, self.path, self.fd, self.hit = name, path, fd, hit

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:  # once only: the number may belong to another lock later
            release_fd(fd)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- the cache ------------------------------------------------------------------------------------
class NodeCache:
    """Entries keyed by any string, on a local disk, shared by the processes of a node."""

    def __init__(self, root: str | Path, options: CacheOptions) -> None:
        if isinstance(options.limit, bool) or not isinstance(options.limit, int) or options.limit <= 0:
            raise ConfigError(f"a cache limit must be a positive number of bytes, got {options.limit!r}")
        self.root = Path(root).expanduser().absolute()
        self.options = options
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for sub in LAYOUT:  # real directories: a planted link here is refused, not followed
                os.close(open_dir_beneath(self.root, [sub], create=True))
        except OSError as exc:
            raise os_error(exc, self.root, "creating the cache in") from exc

    @property
    def limit(self) -> int:
        return self.options.limit

    def entry_path(self, name: str) -> Path:
        return self.root / ENTRIES / name

    # -- using entries ----------------------------------------------------------------------------
    def get(self, key: str, kind: Kind, plan: Callable[[], FillPlan],
            usable: Callable[[Path], bool] | None = None) -> Pin:
        """Pin ``key``'s entry, filling it first on a miss.

        ``usable(path)`` may reject a present entry (stale or damaged): it is then filled again.
        ``plan()`` is called only on a miss, under the entry's exclusive lock, so of several
        processes asking at once one fills and the others wait and then hit."""
        name = entry_name(key)
        evicted = 0
        deadline = time.monotonic() + self.options.fill_wait
        while evicted < _ATTEMPTS:
            pin = self._pin_if_usable(name, kind, usable, key, deadline)
            if pin is not None:
                events.emit(events.CacheLookup(self.options.name, True))
                return pin
            # Never wait for the exclusive lock: the process that got it first fills the entry and
            # then keeps a shared pin on it for as long as it reads, so a blocked waiter would wait
            # on that reader (and a reader waiting on this process, as DataLoader workers that
            # deliver in turn do, would wait forever). Go back to the shared wait instead, which
            # ends as soon as the fill does.
            fd = self._entry_lock(name, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                if time.monotonic() > deadline:
                    raise StorageError(f"{key} is held in the cache at {self.root} by another process but is not "
                                       f"usable here after {self.options.fill_wait:g} s; check what else uses "
                                       "that cache directory")
                time.sleep(_POLL / 10)
                continue
            try:
                hit = self._usable(name, kind, usable)  # another process filled it while we waited
                flush = False if hit else self._fill(name, kind, plan())
                # Keep it pinned. flock converts a lock by dropping and re-taking it, so an evictor
                # may slip in between (and then fill it, or hang doing so): make sure the entry
                # is still there, and wait for it no longer than the reader's wait.
                self._lock_until(name, key, fcntl.LOCK_SH, deadline, fd)
            except BaseException:
                release_fd(fd)
                raise
            if flush:
                submit(partial(self._flush_behind, name))
            if os.fstat(fd).st_nlink and self._present(name, kind):
                if hit:
                    self._touch(name)
                events.emit(events.CacheLookup(self.options.name, hit))
                return Pin(name, self.entry_path(name), fd, hit)
            release_fd(fd)
            evicted += 1
        raise StorageError(f"{key} keeps being evicted from the cache at {self.root} before it can be used; "
                           "raise the cache limit or run fewer readers at once")

    def _pin_if_usable(self, name: str, kind: Kind, usable: Callable[[Path], bool] | None, key: str,
                       until: float) -> Pin | None:
        fd = self._lock_until(name, key, fcntl.LOCK_SH, until)  # waits while another process fills or replaces it
        try:
            ok = self._usable(name, kind, usable)
        except BaseException:
            release_fd(fd)
            raise
        if not ok:
            release_fd(fd)
            return None
        self._touch(name)
        return Pin(name, self.entry_path(name), fd, True)

    def evict(self, key: str) -> bool:
        """Remove ``key``'s entry, waiting until no process uses it (at most ``fill_wait``); False if
        it was not cached."""
        name = entry_name(key)
        fd = self._lock_until(name, key, fcntl.LOCK_EX, time.monotonic() + self.options.fill_wait)
        try:
            return self._drop(name)
        finally:
            release_fd(fd)

    def entries(self) -> list[EntryInfo]:
        """Committed entries, least recently used first."""
        out = []
        for e in os.scandir(self.root / ENTRIES):
            if e.name.startswith("."):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                size = st.st_size
            elif stat.S_ISDIR(st.st_mode):
                size = _tree_bytes(e.path)
            else:
                size = 0  # not an entry (a planted link): removed by the next fill of that name
            out.append(EntryInfo(e.name, Path(e.path), size, st.st_mtime_ns))
        return sorted(out, key=lambda x: x.used_ns)

    def usage(self) -> Usage:
        with self._cache_lock():
            return Usage(sum(e.bytes for e in self.entries()), self._reserved())

    # -- cached indexes ---------------------------------------------------------------------------
    def read_index(self, key: str, max_bytes: int) -> bytes | None:
        """The cached copy of a small index, or None (absent, too big, or not a regular file).
        The caller verifies it: the bytes are as untrusted as any other file."""
        rel = f"{INDEXES}/{entry_name(key)}"
        try:
            fd = open_beneath(self.root, rel, os.O_RDONLY)
        except (NotFoundError, FormatError, OSError):
            return None
        with os.fdopen(fd, "rb") as f:
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            return None
        self._stamp(self.root / rel)
        return raw

    def put_index(self, key: str, raw: bytes) -> bool:
        """Cache a small index beside the data (best effort: False when it could not be written).
        Indexes do not count against the limit and are never pinned; past ``index_limit`` bytes
        the oldest are removed when the cache next makes room."""
        name = entry_name(key)
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            dfd = open_dir_beneath(self.root, [INDEXES])
        except (NotFoundError, FormatError, OSError):
            return False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(raw)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                _remove_at(dfd, tmp)
                raise
            return True
        except OSError as exc:
            log.debug("could not cache index %s in %s: %s", key, self.root, exc)
            return False
        finally:
            os.close(dfd)

    # -- locks --------------------------------------------------------------------------------------
    def _entry_lock(self, name: str, mode: int) -> int | None:
        """flock the entry's lock file; None when LOCK_NB and held. An evictor removes the lock file
        of what it evicts, so a lock taken on a removed file is dropped and taken again."""
        for _ in range(_ATTEMPTS):
            fd = _flock_own(self.root, f"{LOCKS}/{name}.lock", mode)
            if fd is None or os.fstat(fd).st_nlink:
                return fd
            release_fd(fd)
        raise StorageError(f"the lock of {name} in {self.root} keeps being removed; check what else writes there")

    def _lock_until(self, name: str, key: str, mode: int, until: float, fd: int | None = None) -> int:
        """The entry's lock in ``mode`` (LOCK_SH or LOCK_EX), or on ``fd`` (held: converted), polled
        with LOCK_NB until ``until`` (monotonic). flock itself waits for ever, and a holder that hangs
        (a stalled download, NFS in uninterruptible I/O, a stopped process) would hold up every
        process of the node that wants this entry; EntryBusyError instead, naming the holder."""
        pause = 0.001
        while True:
            if fd is None:
                got = self._entry_lock(name, mode | fcntl.LOCK_NB)
            else:
                try:  # a failed conversion holds no lock at all: the next try takes it afresh
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    got = fd
                except BlockingIOError:
                    got = None
            if got is not None:
                return got
            if time.monotonic() >= until:
                raise self._busy(name, key, mode)
            time.sleep(pause)
            pause = min(2 * pause, _POLL)  # quick for the usual short fill, cheap for a long one

    def _busy(self, name: str, key: str, mode: int) -> EntryBusyError:
        lock = self.root / LOCKS / f"{name}.lock"
        holders = ", ".join(f"pid {pid} ({how}, {_command(pid)})" for pid, how in lock_holders(lock)) or "another process"
        try:
            fill = f"; it claimed room for a fill {time.time() - os.stat(self.root / RESERVE / name).st_mtime:.0f} s ago"
        except OSError:
            fill = ""
        want = "use" if mode == fcntl.LOCK_SH else "evict"
        return EntryBusyError(
            f"gave up waiting {self.options.fill_wait:g} s (CacheOptions.fill_wait) to {want} the cache entry of {key} "
            f"at {self.entry_path(name)}: {holders} holds its lock {lock}{fill}. A fill or eviction that does not end "
            "is stuck (a stalled download, a hung mount, a stopped process): end that process (the kernel then drops "
            "its lock) or, for a fill that is only slow, raise fill_wait")

    @contextmanager
    def _cache_lock(self) -> Iterator[None]:
        fd = _flock_own(self.root, CACHE_LOCK, fcntl.LOCK_EX)
        assert fd is not None
        try:
            yield
        finally:
            release_fd(fd)

    # -- entries on disk ----------------------------------------------------------------------------
    def _present(self, name: str, kind: Kind) -> bool:
        try:
            mode = os.lstat(self.entry_path(name)).st_mode
        except FileNotFoundError:
            return False
        return stat.S_ISDIR(mode) if kind == "dir" else stat.S_ISREG(mode)

    def _usable(self, name: str, kind: Kind, usable: Callable[[Path], bool] | None) -> bool:
        return self._present(name, kind) and not self._lost_flush(name) and (
            usable is None or usable(self.entry_path(name)))

    def _lost_flush(self, name: str) -> bool:
        """True when the entry was committed unflushed before the system last started: a crash may
        have left zeros where its bytes were."""
        try:
            marked = os.stat(self.root / UNSYNCED / name, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return False
        boot = boot_time()
        return boot is None or marked < boot

    def _touch(self, name: str) -> None:
        self._stamp(self.entry_path(name))

    @staticmethod
    def _stamp(path: Path) -> None:
        now = time.time_ns()  # explicit: the kernel's own stamp is a few ms coarse, uses would tie
        try:
            os.utime(path, ns=(now, now), follow_symlinks=False)
        except OSError:
            pass

    def _remove(self, sub: str, name: str) -> bool:
        try:
            dfd = open_dir_beneath(self.root, [sub])
        except NotFoundError:
            if sub == UNSYNCED:  # never made: nothing to remove
                return False
            raise
        try:
            return _remove_at(dfd, name)
        finally:
            os.close(dfd)

    def _drop(self, name: str) -> bool:
        """Remove an entry and then its lock file; the caller holds the exclusive lock."""
        removed = self._remove(ENTRIES, name)
        self._remove(UNSYNCED, name)
        self._remove(LOCKS, f"{name}.lock")
        return removed

    # -- filling ------------------------------------------------------------------------------------
    def _fill(self, name: str, kind: Kind, plan: FillPlan) -> bool:
        """Make the entry; True when its bytes are still to be flushed to the disk."""
        size = check_int(plan.size, f"{plan.where}: size")  # NaN, negative, float: never fit-checked
        if size > self.limit:
            raise ConfigError(f"{plan.where} needs {size} bytes but the cache at {self.root} holds at most "
                              f"{self.limit}: raise the cache limit")
        self._remove(ENTRIES, name)  # a stale or damaged copy (we hold the exclusive lock)
        self._remove(UNSYNCED, name)
        with self._reservation(name, size, plan.where):
            self._remove(PARTIAL, name)  # left by a fill that died
            try:
                os.close(open_dir_beneath(self.root, [PARTIAL, name], create=True))
                scratch = self.root / PARTIAL / name
                target = scratch if kind == "dir" else scratch / "data"
                plan.write(target)
                if plan.verify is not None:
                    plan.verify(target)
                if not plan.durable:
                    self._mark_unsynced(name)
                self._commit(name, kind)
            except TierioError:
                raise
            except OSError as exc:
                raise os_error(exc, self.root / PARTIAL / name, "filling the cache entry") from exc
            finally:
                self._remove(PARTIAL, name)
        self._touch(name)
        return not plan.durable

    def _flush_behind(self, name: str) -> None:
        """Flush a committed entry's bytes to the disk, then drop its unsynced marker. Skipped while
        another process evicts or refills it (the marker then stays; harmless until a reboot)."""
        fd = self._entry_lock(name, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if fd is None:
            return
        try:
            path = self.entry_path(name)
            files = [path] if not path.is_dir() else [Path(d) / f for d, _, fs in os.walk(path) for f in fs]
            for f in files:
                ffd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fdatasync(ffd)
                finally:
                    os.close(ffd)
            self._remove(UNSYNCED, name)
        except OSError as exc:  # evicted meanwhile, or a disk error the next reader will meet
            log.debug("could not flush cache entry %s in %s: %s", name, self.root, exc)
        finally:
            release_fd(fd)

    def _mark_unsynced(self, name: str) -> None:
        """Make ``unsynced/<name>`` durable before the commit rename: after a crash the entry may
        be on the disk without its bytes, and only a marker that survived says so."""
        dfd = open_dir_beneath(self.root, [UNSYNCED], create=True)
        try:
            os.close(_open_own(self.root, f"{UNSYNCED}/{name}", os.O_WRONLY | os.O_CREAT))
            os.fsync(dfd)  # the marker's name
        finally:
            os.close(dfd)
        rfd = open_dir_beneath(self.root, [])
        try:
            os.fsync(rfd)  # unsynced/ itself, made on first use
        finally:
            os.close(rfd)

    def _commit(self, name: str, kind: Kind) -> None:
        """Rename the scratch copy into ``entries/`` through directory descriptors (no link followed)."""
        src_dir = open_dir_beneath(self.root, [PARTIAL] if kind == "dir" else [PARTIAL, name])
        try:
            dst_dir = open_dir_beneath(self.root, [ENTRIES])
            try:
                os.rename(name if kind == "dir" else "data", name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
                os.fsync(dst_dir)
            finally:
                os.close(dst_dir)
        finally:
            os.close(src_dir)

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
                raise ConfigError(
                    f"the cache at {self.root} cannot make room for {where} ({size} bytes) within its limit of "
                    f"{self.limit} bytes: every entry that could be evicted is in use; raise the limit, or run "
                    "fewer readers (or less prefetch) at once"
                )
            time.sleep(_POLL)
        try:
            yield
        finally:
            self._remove(RESERVE, name)
            release_fd(fd)

    def _claim(self, name: str, size: int) -> int:
        fd = _flock_own(self.root, f"{RESERVE}/{name}", fcntl.LOCK_EX)
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
                fd = _flock_own(self.root, f"{RESERVE}/{e.name}", fcntl.LOCK_SH | fcntl.LOCK_NB, create=False)
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


@lru_cache(maxsize=1)
def boot_time() -> float | None:
    """When the running system started (seconds since the epoch), from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def lock_holders(path: Path) -> list[tuple[int, str]]:
    """(pid, "exclusive" or "shared") of every flock held on ``path``'s file, from /proc/locks
    (Linux; empty elsewhere or when it cannot be read). Waiters are left out."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    for line in lines:  # "3: FLOCK  ADVISORY  WRITE 4242 00:2e:913 0 EOF"; a waiter has "->" after "3:"
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == inode and f[4].isdigit():
            out.append((int(f[4]), "exclusive" if f[3] == "WRITE" else "shared"))
    return out


def _command(pid: int) -> str:
    """The process's name (not its command line, which may hold secrets), for messages."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).decode(errors="replace").strip() or "?"
    except OSError:
        return "not visible here"


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under a directory (links are not followed, nor counted)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def make_parents(root: Path, key: str, where: str) -> Path:
    """``root/key`` for a file a fill is about to write, with its parent directories made beneath
    ``root`` without following links. ``key`` is checked first (a FormatError naming ``where``
    when it could leave ``root``), so no directory is ever made outside it."""
    parts = key_parts(key, where)
    if len(parts) > 1:
        os.close(open_dir_beneath(root, parts[:-1], create=True))
    return root.joinpath(*parts)


__all__ = [
    "CacheOptions", "EntryBusyError", "EntryInfo", "FillPlan", "Kind", "NodeCache", "Pin", "Usage", "entry_name",
    "lock_holders", "make_parents", "release_fd",
]
