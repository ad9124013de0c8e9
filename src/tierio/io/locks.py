"""File locks that say a live process owns a file, and the fork-safe registry of locked descriptors.

flock() locks belong to an open file description, which dies with the process that holds it, so a
lock is proof of a live owner: temp files being written (``hold_write_lock`` / ``writer_gone``) and
the node-local cache's pins and fills (``flock_registered`` / ``release_fd``) rely on it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from tierio.errors import os_error

__all__ = ["flock_registered", "hold_write_lock", "lock_holders", "process_name", "release_fd", "writer_gone"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def hold_write_lock(fd: int) -> None:
    """Mark a file being written as owned by a live process: an exclusive flock, held until the
    descriptor closes (the kernel drops it when the process dies). Cleanup of temp files
    (Store.cleanup) removes only files whose lock it can take. Filesystems without flock
    support are left unmarked; cleanup then goes by age alone."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def writer_gone(path: str | Path, *, dir_fd: int | None = None) -> bool:
    """True for a regular file (not a link) whose writer's lock (``hold_write_lock``) nobody holds:
    the process that wrote it died or finished, so a temp file under that name is garbage.
    ``dir_fd``: ``path`` is a name in that directory (a walk through directory descriptors)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the lock


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

def flock_registered(open_fd: Callable[[], int], mode: int, path: str | Path) -> int | None:
    """Open a file with ``open_fd()`` and flock it in ``mode``: a registered descriptor (closed in
    forked children; release it with ``release_fd``), or None when ``mode`` has LOCK_NB and another
    holder has a conflicting lock."""
    with _LOCK_FDS_GUARD:  # no fork between the open and the registration
        fd = open_fd()
        _LOCK_FDS.add(fd)
    try:
        fcntl.flock(fd, mode)
    except OSError as exc:
        release_fd(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise os_error(exc, path, "locking") from exc
    except BaseException:
        release_fd(fd)
        raise
    return fd



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


def process_name(pid: int) -> str:
    """The process's name (not its command line, which may hold secrets), for messages."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).decode(errors="replace").strip() or "?"
    except OSError:
        return "not visible here"
