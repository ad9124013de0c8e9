"""The node-local cache's own files: its layout, entry names, and files reached without following links.

Nothing read from data is ever joined into a path here: ``entry_name`` derives every name from the
caller's key, and a link or FIFO planted where the cache keeps its own file is removed, never followed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
from functools import lru_cache, partial
from pathlib import Path
from typing import Literal

from tierio.errors import ConfigError, FormatError, NotFoundError, StorageError
from tierio.io.locks import flock_registered
from tierio.io.paths import key_parts, open_beneath, open_dir_beneath

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
def remove_at(dfd: int, name: str) -> bool:
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


def open_own(root: Path, rel: str, flags: int) -> int:
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
            remove_at(dfd, parts[-1])
        finally:
            os.close(dfd)
        if not flags & os.O_CREAT:
            raise NotFoundError(f"{root}/{rel} does not exist")
    raise StorageError(f"{root}/{rel} keeps being replaced by something that is not a regular file; "
                       "check what else writes into the cache directory")


def flock_own(root: Path, rel: str, mode: int, *, create: bool = True) -> int | None:
    """Open and flock one of the cache's files; a registered descriptor, or None when ``mode``
    has LOCK_NB and another holder has a conflicting lock."""
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    return flock_registered(partial(open_own, root, rel, flags), mode, root / rel)


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



def tree_bytes(path: str) -> int:
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
