"""The records of the node-local cache: its options, a fill's plan, entry facts, and a pin."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierio.errors import StorageError
from tierio.io.locks import release_fd


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
    limit_setting: str = "limit"  # the owner's name for ``limit`` (max_bytes), which a too-small cache's error names

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
