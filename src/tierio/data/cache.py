"""The shard cache: verified local copies of a dataset's shards on the node-local cache.

A thin user of :class:`tierio.storage.cache.NodeCache`, which owns pins, eviction, reservations,
atomic fills and fork safety (see there), shared by every process of a node:

* **Verified, read once.** A shard is downloaded into the fill's scratch directory and only then
  renamed into place. A columns shard comes in windows of the dataset's checksum window, a few
  in parallel, each compared with its xxh3 from the manifest while it is in memory and then
  written at its offset, so nothing is read back to verify it and its pages stay in the page cache
  for the reader that maps it next; a tar shard is checked against its whole-file xxh3. Its cache key holds the store, the shard key,
  the xxh3 and the size, so a changed object never matches an old copy; the file name is derived
  from that key by the cache, never taken from the manifest.
* **Bounded.** ``limit`` bytes of shards, downloads in flight included; least recently used shards
  are evicted first, never one a reader holds (``open_locked``). A shard larger than the limit is
  refused up front, and sizes that are not integers (NaN, negative, fractional) are a FormatError
  before any fit check.
* **Indexes beside the shards.** The small per-shard index files are cached too, outside the
  limit, so they are never evicted to make room for data.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierio.errors import CacheLimitError, ConfigError, DiskFullError, NotFoundError
from tierio.io.buffers import BufferPool
from tierio.io.untrusted import check_int
from tierio.storage.base import Store
from tierio.storage.download import download_verified
from tierio.storage.cache import CacheOptions, FillPlan, NodeCache, Pin, entry_name, release_fd
from tierio.data.shards import ShardInfo, verify_file

WINDOWS_IN_FLIGHT = 4  # ranged GETs per shard download: enough to hide a request's latency


def shard_size(info: ShardInfo, of: str = "") -> int:
    """The shard's size, checked: an integer >= 0 (FormatError naming the shard otherwise)."""
    return check_int(info.size, f"shard {info.key}{' of ' + of if of else ''}: size")


def largest_shard(shards: list[ShardInfo], of: str = "") -> int:
    """The largest shard size of a dataset, every size checked (0 for no shards)."""
    return max((shard_size(s, of) for s in shards), default=0)


def check_fits(info: ShardInfo, limit: int, of: str = "") -> None:
    """A cache of ``limit`` bytes must hold at least this shard (``of``: the dataset, for the message)."""
    size = shard_size(info, of)
    if size > limit:
        raise CacheLimitError(
            f"the cache limit of {limit} bytes is smaller than shard {info.key} ({size} bytes)"
            f"{' of ' + of if of else ''}: raise {{setting}} to at least a few shards (e.g. {4 * size} bytes)",
            "cache_limit_bytes",
        )


class ShardCache:
    def __init__(self, store: Store, cache_dir: str | Path, limit: int, *, wait_timeout: float = 60.0) -> None:
        self.store = store
        self.limit = int(limit)
        if self.limit <= 0:
            raise ConfigError(f"cache_limit must be positive, got {limit}")
        self.node = NodeCache(cache_dir, CacheOptions(limit=self.limit, wait_timeout=wait_timeout, name="shards",
                                                      limit_setting="cache_limit_bytes"))
        self.dir = self.node.root
        self.downloaded_bytes = 0
        self.hits = 0
        self.misses = 0
        # window buffers, reused: two downloads (a read and a prefetch) of WINDOWS_IN_FLIGHT each
        self._buffers = BufferPool(budget_bytes=None, pin=False, max_buffers=2 * WINDOWS_IN_FLIGHT)

    # -- names -------------------------------------------------------------------------------
    def key(self, info: ShardInfo) -> str:
        """The cache key of a shard version (its readable part is the shard key, before the '?')."""
        return f"{info.key}?xxh3={info.xxh3}&size={info.size}&store={self.store.url}"

    def name(self, info: ShardInfo) -> str:
        return entry_name(self.key(info))

    def path(self, info: ShardInfo) -> Path:
        return self.node.entry_path(self.name(info))

    def check_fits(self, info: ShardInfo) -> None:
        check_fits(info, self.limit, of=self.store.url)

    # -- shards ------------------------------------------------------------------------------
    def pin(self, info: ShardInfo) -> Pin:
        """A verified local copy of ``info``, downloaded if needed, held until ``Pin.release()``."""
        self.check_fits(info)
        where = f"shard {info.key} of {self.store.url}"

        def plan() -> FillPlan:
            if info.windows:  # verified window by window as it arrives, flushed to the disk behind the reader
                return FillPlan(info.size, lambda target: self._download_windows(info, target, where), where,
                                durable=False)
            return FillPlan(info.size, lambda target: self._download(info, target, where), where,
                            verify=lambda target: verify_file(target, info.xxh3, info.size, where))

        pin = self.node.get(self.key(info), "file", plan, usable=lambda p: p.stat().st_size == info.size)
        if pin.hit:
            self.hits += 1
        else:
            self.misses += 1
            self.downloaded_bytes += info.size
        return pin

    def ensure(self, info: ShardInfo) -> Path:
        """Path of a verified local copy of ``info``, downloading it if needed (not held)."""
        pin = self.pin(info)
        pin.release()
        return pin.path

    def open_locked(self, info: ShardInfo) -> tuple[Path, int]:
        """Ensure the shard is cached; returns (path, registered fd holding a shared lock on it).

        Release with ``release_fd(fd)``: while it is held, no process evicts the shard."""
        pin = self.pin(info)
        return pin.path, pin.fd

    def _download_windows(self, info: ShardInfo, target: Path, where: str) -> None:
        """Ranged reads of ``info.window`` bytes, each checked against its xxh3 and written at its
        offset, buffered: the pages stay in the page cache for the reader that maps the shard next,
        and the cache flushes them to the disk after the commit, off the reader's path."""
        with self._store_errors(where):
            download_verified(self.store, info.key, target, info.size, info.window, info.windows,
                              buffers=self._buffers, depth=WINDOWS_IN_FLIGHT, where=where)

    def _download(self, info: ShardInfo, target: Path, where: str) -> None:
        with self._store_errors(where):
            self.store.get_file(info.key, target)

    @contextmanager
    def _store_errors(self, where: str) -> Iterator[None]:
        try:
            yield
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

    # -- indexes -----------------------------------------------------------------------------
    def _index_key(self, info: ShardInfo) -> str:
        return f"{info.index_key}?xxh3={info.index_xxh3}&size={info.index_size}&store={self.store.url}"

    def read_index(self, info: ShardInfo) -> bytes | None:
        """The cached bytes of the shard's index, or None; unverified (parse_index checks them)."""
        size = check_int(info.index_size, f"shard {info.key} of {self.store.url}: index_size")
        return self.node.read_index(self._index_key(info), max_bytes=size)

    def put_index(self, info: ShardInfo, raw: bytes) -> None:
        self.node.put_index(self._index_key(info), raw)

    def usage(self) -> tuple[int, int]:
        """(bytes of complete shards, bytes reserved by downloads in flight)."""
        u = self.node.usage()
        return u.present, u.reserved


__all__ = ["ShardCache", "check_fits", "largest_shard", "release_fd", "shard_size"]
