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

import fcntl
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from tierio import events
from tierio.errors import CacheLimitError, ConfigError, FormatError, NotFoundError, StorageError, TierioError, os_error
from tierio.io.engine import submit
from tierio.io.locks import lock_holders, process_name, release_fd
from tierio.io.paths import open_beneath, open_dir_beneath
from tierio.io.untrusted import check_int
from tierio.storage.cache_files import (
    _ATTEMPTS,
    _POLL,
    CACHE_LOCK,
    ENTRIES,
    INDEXES,
    LAYOUT,
    LOCKS,
    PARTIAL,
    RESERVE,
    UNSYNCED,
    Kind,
    boot_time,
    entry_name,
    flock_own,
    make_parents,
    open_own,
    remove_at,
    tree_bytes,
)
from tierio.storage.cache_records import CacheOptions, EntryBusyError, EntryInfo, FillPlan, Pin, Usage
from tierio.storage.cache_room import RoomKeeping

log = logging.getLogger(__name__)


# -- the cache ------------------------------------------------------------------------------------
def poll_pause(waited: float, left: float) -> float:
    """Seconds to sleep before the next try for a lock held by another process, ``waited`` seconds
    into the wait with ``left`` to go: late by at most a tenth of the wait so far (and 1 ms), so the
    readers of a node that wait on one download (DataLoader workers in lock-step) get it within a
    few ms of its end, and a long fill costs a poll every _POLL (a poll is an open and a flock, ~20 us)."""
    return max(0.0, min(_POLL, max(0.001, waited / 10), left))


class NodeCache(RoomKeeping):
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
        raise CacheLimitError(f"{key} keeps being evicted from the cache at {self.root} ({self.limit} bytes) "
                              "before it can be used: raise {setting} or run fewer readers at once",
                              self.options.limit_setting)

    def lookup(self, key: str, kind: Kind, usable: Callable[[Path], bool] | None = None) -> Pin | None:
        """Pin ``key``'s entry if it is present and usable; None on a miss (nothing is filled).
        Waits, as ``get`` does, while another process fills or replaces it."""
        pin = self._pin_if_usable(entry_name(key), kind, usable, key, time.monotonic() + self.options.fill_wait)
        if pin is not None:
            events.emit(events.CacheLookup(self.options.name, True))
        return pin

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
                size = tree_bytes(e.path)
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
                remove_at(dfd, tmp)
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
            fd = flock_own(self.root, f"{LOCKS}/{name}.lock", mode)
            if fd is None or os.fstat(fd).st_nlink:
                return fd
            release_fd(fd)
        raise StorageError(f"the lock of {name} in {self.root} keeps being removed; check what else writes there")

    def _lock_until(self, name: str, key: str, mode: int, until: float, fd: int | None = None) -> int:
        """The entry's lock in ``mode`` (LOCK_SH or LOCK_EX), or on ``fd`` (held: converted), polled
        with LOCK_NB until ``until`` (monotonic). flock itself waits for ever, and a holder that hangs
        (a stalled download, NFS in uninterruptible I/O, a stopped process) would hold up every
        process of the node that wants this entry; EntryBusyError instead, naming the holder."""
        started = time.monotonic()
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
            now = time.monotonic()
            if now >= until:
                raise self._busy(name, key, mode)
            time.sleep(poll_pause(now - started, until - now))

    def _busy(self, name: str, key: str, mode: int) -> EntryBusyError:
        lock = self.root / LOCKS / f"{name}.lock"
        holders = ", ".join(f"pid {pid} ({how}, {process_name(pid)})" for pid, how in lock_holders(lock)) or "another process"
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
        fd = flock_own(self.root, CACHE_LOCK, fcntl.LOCK_EX)
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
            return remove_at(dfd, name)
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
            raise CacheLimitError(f"{plan.where} needs {size} bytes but the cache at {self.root} holds at most "
                                  f"{self.limit}: raise {{setting}} to at least {size} bytes", self.options.limit_setting)
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
            os.close(open_own(self.root, f"{UNSYNCED}/{name}", os.O_WRONLY | os.O_CREAT))
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


__all__ = [
    "CacheOptions", "EntryBusyError", "EntryInfo", "FillPlan", "Kind", "NodeCache", "Pin", "Usage", "entry_name",
    "lock_holders", "make_parents", "release_fd",
]
