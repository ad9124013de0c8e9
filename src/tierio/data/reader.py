"""Shards of a dataset opened for one process: through the node cache or in place, prefetched,
pinned while read, and batches taken from them.

A columns shard is mapped read-only from its verified local copy with every page mapped at once
(its pages are in the page cache: the download just wrote them, or an earlier epoch read them),
and a batch is one gather per fixed-size field straight out of that mapping. Every DataLoader
worker and every rank of a node maps the same cached files, so their pages are in memory once.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tierio.data.cache import ShardCache, check_fits, largest_shard, release_fd
from tierio.data.columns import ColumnShard
from tierio.data.shards import ShardManifest, ShardFile, ShardInfo, parse_index
from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError
from tierio.io.files import map_readonly
from tierio.storage.base import Store, read_bytes
from tierio.storage.base import where as name_of  # locals here call the message text `where`


class Shard(Protocol):
    """An open shard: batches by sample ids inside it, held until ``close()``."""

    def __len__(self) -> int: ...

    def take(self, ids: np.ndarray, copy: bool = True, out: dict[str, np.ndarray] | None = None) -> dict[str, Any]: ...

    def close(self) -> None: ...


class MappedColumnShard:
    """A columns shard mapped from a local file; ``on_close`` releases its cache pin."""

    def __init__(self, path: Path, manifest: ShardManifest, shard: int, where: str,
                 on_close: Callable[[], None] | None = None) -> None:
        self._on_close = on_close
        try:
            self.columns = ColumnShard(map_readonly(path, populate=True), manifest.layout(shard), where)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.columns)

    def take(self, ids: np.ndarray, copy: bool = True, out: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        return self.columns.take(ids, copy, out)

    def close(self) -> None:
        # the mapping goes with the last view of it: batches handed out may still use it
        cb, self._on_close = self._on_close, None
        if cb is not None:
            cb()


@dataclass(frozen=True)
class ReaderBudget:
    """How many shards one reader holds open (pinned in the cache) and prefetches."""

    open_shards: int
    prefetch: int

    @classmethod
    def share(cls, slots: int, readers: int, max_open: int, prefetch: int) -> ReaderBudget:
        """A reader's share of a cache that holds ``slots`` of the largest shard, among ``readers``
        on the node: its pins, one download of its own and its prefetches fit that share, so it
        never waits on its own pins. With a share of one slot it holds one shard and closes it
        before downloading the next."""
        mine = max(1, slots // max(1, readers))
        open_shards = max(1, min(max_open, mine - 1))
        return cls(open_shards, max(0, min(prefetch, mine - open_shards - 1)))


@dataclass(frozen=True)
class ReaderOptions:
    """Where and how a process reads shards (see StreamingDataset for each)."""

    cache_dir: Path | None
    cache_limit: int
    wait_timeout: float = 60.0
    max_open_shards: int = 4
    prefetch: int = 2


def _local_world_size() -> int:
    """Ranks on this node (set by torchrun); they share the node's cache."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class ShardReader:
    """The shards of ``manifest`` at ``store``, for one process (not shared across a fork)."""

    def __init__(self, store: Store, manifest: ShardManifest, options: ReaderOptions) -> None:
        from tierio.storage import LocalStore

        self.store = store
        self.url = store.url
        self.manifest = manifest
        self.options = options
        if options.cache_dir is None and not isinstance(store, LocalStore):
            raise ConfigError(f"{self.url} is remote: pass cache_dir (a local NVMe directory) to stream it")
        self.largest = largest_shard(manifest.shards, of=self.url)  # every size checked
        if options.cache_dir is not None and manifest.shards:
            check_fits(max(manifest.shards, key=lambda s: s.size), options.cache_limit, of=self.url)
        self._cache: ShardCache | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._deferred: list[int] = []  # asked for before any shard was open: downloaded after the first
        self._indexes: dict[int, np.ndarray] = {}
        self._open: OrderedDict[int, Shard] = OrderedDict()
        self._sized: set[int] = set()
        self.budget = ReaderBudget(options.max_open_shards, options.prefetch)

    @property
    def cache(self) -> ShardCache | None:
        if self._cache is None and self.options.cache_dir is not None:
            self._cache = ShardCache(self.store, self.options.cache_dir, self.options.cache_limit,
                                     wait_timeout=self.options.wait_timeout)
        return self._cache

    def set_workers(self, workers: int) -> None:
        """Size this reader's pins and prefetch as its share of the cache among the node's readers."""
        o = self.options
        if o.cache_dir is None or not self.largest:
            self.budget = ReaderBudget(o.max_open_shards, o.prefetch)
        else:
            readers = workers * _local_world_size()
            self.budget = ReaderBudget.share(o.cache_limit // self.largest, readers, o.max_open_shards, o.prefetch)

    # -- sizes ------------------------------------------------------------------------------------
    def check_size(self, shard: int) -> None:
        """The shard's real size is its declared size. Called before anything is sized by the
        shard's declared sample count: that count is bounded by the declared size, and the
        declared size, now, by the bytes that exist."""
        if shard in self._sized or shard in self._open:
            return
        info = self.manifest.shards[shard]
        cache = self.cache
        if cache is None or not _is_size(cache.path(info), info.size):
            try:
                real = self.store.stat(info.key).size
            except NotFoundError:
                raise NotFoundError(f"{name_of(self.store, info.key)} is listed in the manifest but missing on the store; "
                                    "re-upload the dataset") from None
            if real != info.size:
                raise IntegrityError(f"{name_of(self.store, info.key)} is {real} bytes but the manifest says {info.size}; the "
                                     "dataset was changed after its manifest was written, or the manifest is forged")
        self._sized.add(shard)

    # -- shards -----------------------------------------------------------------------------------
    def _index(self, shard: int) -> np.ndarray:
        """The verified sidecar index of a tar shard (read exactly as long as the manifest says)."""
        idx = self._indexes.get(shard)
        if idx is None:
            info = self.manifest.shards[shard]
            where = name_of(self.store, info.index_key)
            nfields = len(self.manifest.fields)
            cache = self.cache
            raw = cache.read_index(info) if cache is not None else None
            if raw is not None:
                try:
                    idx = parse_index(raw, info, nfields, f"{where} (cached in {cache.dir})")  # type: ignore[union-attr]
                except (IntegrityError, FormatError):
                    idx = None  # a damaged cached copy: fetch it again
            if idx is None:
                try:
                    raw = read_bytes(self.store, info.index_key, 0, info.index_size)
                except NotFoundError:
                    raise NotFoundError(f"{where} is listed in the manifest but missing on the store; re-upload the dataset") from None
                idx = parse_index(raw, info, nfields, where)
                if cache is not None:
                    cache.put_index(info, raw)  # best effort: the index is small
            self._indexes[shard] = idx
        return idx

    def _fetch(self, shard: int) -> None:
        cache = self.cache
        if cache is not None:
            cache.ensure(self.manifest.shards[shard])

    def prefetch(self, shards: list[int]) -> None:
        """Download these shards into the cache in the background (the next ones in read order)."""
        if not shards or self.options.cache_dir is None:
            return
        if not self._open:
            # Nothing is being read yet: the first shard is downloaded on demand, and downloads
            # ahead would split the link with it (measured: the first batch came 1.5-2x later).
            self._deferred += [s for s in shards if s not in self._deferred]
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierio-prefetch")
        for s in shards:
            if s not in self._open and s not in self._pending:
                self._pending[s] = self._pool.submit(self._fetch, s)

    def shard(self, shard: int) -> Shard:
        """The open shard, opening (and downloading) it if needed; pinned until closed."""
        sf = self._open.get(shard)
        if sf is not None:
            self._open.move_to_end(shard)
            return sf
        fut = self._pending.pop(shard, None)
        if fut is not None:
            fut.result()  # re-raises a failed prefetch here, where the shard is needed
        # Unpin before pinning another: the download of this shard may need the room they hold.
        while len(self._open) >= self.budget.open_shards:
            _, old = self._open.popitem(last=False)
            old.close()  # releases its cache lock
        sf = self._open_shard(shard)
        self._open[shard] = sf
        self._sized.add(shard)
        if self._deferred:  # the first shard is in hand: the downloads ahead start now
            ahead, self._deferred = self._deferred, []
            self.prefetch(ahead)
        return sf

    def _open_shard(self, shard: int) -> Shard:
        info: ShardInfo = self.manifest.shards[shard]
        where = name_of(self.store, info.key)
        cache = self.cache
        if cache is None:
            path = self.store.path(info.key)  # type: ignore[attr-defined]
            if info.container == "columns":
                return MappedColumnShard(path, self.manifest, shard, where)
            return ShardFile(path, self._index(shard), self.manifest.fields)
        path, fd = cache.open_locked(info)  # the shard first: a tar index is cached only beside it
        where = f"{where} (cached in {cache.dir})"
        if info.container == "columns":
            return MappedColumnShard(path, self.manifest, shard, where, on_close=lambda: release_fd(fd))
        try:
            index = self._index(shard)
        except BaseException:
            release_fd(fd)
            raise
        return ShardFile(path, index, self.manifest.fields, on_close=lambda: release_fd(fd))

    def keep_only(self, needed: set[int]) -> None:
        """Unpin the open shards not in ``needed``."""
        for done in [k for k in self._open if k not in needed]:
            self._open.pop(done).close()

    def take(self, shards: np.ndarray, local: np.ndarray, copy: bool,
             out: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """The batch of samples ``local[k]`` of shard ``shards[k]``, in that order; fixed-size fields
        named in ``out`` are written into those arrays."""
        first = int(shards[0])
        if int(shards[-1]) == first and bool((shards == first).all()):
            return self.shard(first).take(local, copy, out)
        parts = []
        for s in dict.fromkeys(shards.tolist()):  # shards in order of first use
            where = np.flatnonzero(shards == s)
            parts.append((where, self.shard(s).take(local[where], copy)))
        return {name: _merge([(where, got[name]) for where, got in parts], len(shards),
                             None if out is None else out.get(name))
                for name in parts[0][1]}

    def close(self) -> None:
        for sf in self._open.values():
            sf.close()
        self._open.clear()
        self._deferred.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()


def _merge(pieces: list[tuple[np.ndarray, Any]], n: int, into: np.ndarray | None = None) -> Any:
    """One field of a batch from its parts: (positions in the batch, values there)."""
    arrays = [v for _, v in pieces]
    if all(isinstance(v, np.ndarray) for v in arrays) and len({(v.dtype, v.shape[1:]) for v in arrays}) == 1:
        out = into if into is not None else np.empty((n, *arrays[0].shape[1:]), arrays[0].dtype)
        for where, v in pieces:
            out[where] = v
        return out
    items: list[Any] = [None] * n
    for where, v in pieces:
        for k, x in zip(where.tolist(), v):
            items[k] = x
    return items


def _is_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


__all__ = ["MappedColumnShard", "ReaderBudget", "ReaderOptions", "Shard", "ShardReader"]
