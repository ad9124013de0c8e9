"""StreamingDataset: samples from tar shards in any store, through a local NVMe cache.

The order of an epoch is a pure function of (seed, epoch) and the manifest:

1. shards are permuted (shard-level shuffle) and each shard's samples are permuted;
2. the resulting sequence is cut into blocks of ``shuffle_buffer`` samples and each block is
   permuted (a deterministic, resumable form of the buffered shuffle: samples mix across
   shard boundaries without an unbounded reservoir);
3. rank ``r`` of ``W`` takes the contiguous slice ``[r*n, (r+1)*n)`` with ``n = N // W`` (every
   rank the same count, so steps stay in lock-step; at most W-1 samples are skipped per epoch);
4. inside a rank, DataLoader worker ``w`` of ``k`` produces the batches ``w, w+k, w+2k, ...``.
   The DataLoader collects batches from workers round-robin, so the stream the training
   loop sees is the rank's slice in order, whatever the number of workers.

Because the position in an epoch is just "samples consumed by this rank", ``state_dict()``
is a few integers, and resuming, even with another number of workers, continues with the
exact next sample: nothing repeated, nothing skipped.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierio.dist import rank_world
from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError
from tierio.storage.base import Store, read_bytes
from tierio.units import parse_size
from tierio.data.cache import ShardCache, check_fits, largest_shard, release_fd
from tierio.data.shards import Manifest, ShardFile, ShardInfo, load_manifest, parse_index

log = logging.getLogger(__name__)

STATE_FORMAT = "tierio-stream-state"
STATE_VERSION = 1

try:  # an IterableDataset when torch is present, a plain iterable otherwise
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover
    _Base = object  # type: ignore[assignment,misc]


def _worker() -> tuple[int, int]:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return 0, 1
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class EpochOrder:
    """The sample order of one epoch: ``positions(a, b)`` -> global sample ids at [a, b)."""

    def __init__(self, counts: np.ndarray, seed: int, epoch: int, shuffle: bool, buffer: int) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.buffer = max(1, buffer) if shuffle else 1
        n = len(self.counts)
        self.shard_order = self._rng(0).permutation(n) if shuffle else np.arange(n)
        ordered = self.counts[self.shard_order]
        self.seq_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(ordered, out=self.seq_starts[1:])
        first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.counts, out=first[1:])
        self.first_sample = first
        self.total = int(self.seq_starts[-1])
        self._perm_cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch, *keys]))

    def _within(self, shard: int) -> np.ndarray:
        perm = self._perm_cache.get(shard)
        if perm is None:
            perm = self._rng(1, shard).permutation(int(self.counts[shard])) if self.shuffle else np.arange(self.counts[shard])
            self._perm_cache[shard] = perm
            if len(self._perm_cache) > 8:
                self._perm_cache.popitem(last=False)
        return perm

    def _base(self, a: int, b: int) -> np.ndarray:
        """Sequence before the block shuffle (shards in shuffled order, each internally shuffled)."""
        out = np.empty(b - a, dtype=np.int64)
        j = int(np.searchsorted(self.seq_starts, a, side="right")) - 1
        pos = a
        while pos < b:
            shard = int(self.shard_order[j])
            lo = pos - int(self.seq_starts[j])
            hi = min(int(self.seq_starts[j + 1]), b) - int(self.seq_starts[j])
            out[pos - a : pos - a + hi - lo] = self.first_sample[shard] + self._within(shard)[lo:hi]
            pos += hi - lo
            j += 1
        return out

    def positions(self, a: int, b: int) -> np.ndarray:
        if not 0 <= a <= b <= self.total:
            raise ConfigError(f"epoch positions [{a}, {b}) outside [0, {self.total})")
        if self.buffer <= 1 or a == b:
            return self._base(a, b)
        K = self.buffer
        parts = []
        for q in range(a // K, (b - 1) // K + 1):
            lo, hi = q * K, min((q + 1) * K, self.total)
            block = self._base(lo, hi)[self._rng(2, q).permutation(hi - lo)]
            parts.append(block[max(a, lo) - lo : min(b, hi) - lo])
        return np.concatenate(parts)

    def shard_of(self, gids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.first_sample, gids, side="right") - 1

    def upcoming_shards(self, pos: int, count: int, stop: int) -> list[int]:
        """The next ``count`` shards (by id) the base sequence reaches from ``pos`` (before ``stop``)."""
        j = int(np.searchsorted(self.seq_starts, min(pos, self.total), side="right")) - 1
        out = []
        while len(out) < count and j < len(self.shard_order) and self.seq_starts[j] < stop:
            out.append(int(self.shard_order[j]))
            j += 1
        return out


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


def _local_world_size() -> int:
    """Ranks on this node (set by torchrun); they share the node's cache."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class StreamingDataset(_Base):  # type: ignore[misc,valid-type]
    """Iterate the samples of a shard dataset at ``url`` through a local cache.

    url: any store URL holding ``index.json`` + shards (``s3://...``, ``file:///...``, a path).
    cache_dir: local directory for verified shard copies (shared by all workers and ranks of a
        node). ``None`` reads a local store's shards in place (no copy, no cache).
    cache_limit: bytes the cache may hold ("64GiB"); must exceed the largest shard. A reader never
        waits on its own pins: the shards it holds open (at most ``max_open_shards``) and prefetches
        are sized so that, with one more download, they fit its share of the limit (the limit
        divided among the DataLoader workers and the node's ranks, ``LOCAL_WORLD_SIZE``).
    batch_size: the DataLoader batch size; workers interleave whole batches (see module doc).
    transform: applied to each sample (a dict of field -> numpy array) before it is yielded.
    copy: hand out writable copies (default) instead of read-only views of the shard mapping.
    """

    def __init__(
        self,
        url: str | Path | Store,
        cache_dir: str | Path | None = None,
        cache_limit: int | str = "64GiB",
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 4096,
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int = 1,
        prefetch: int = 2,
        transform: Callable[[dict[str, np.ndarray]], Any] | None = None,
        wait_timeout: float = 60.0,
        max_open_shards: int = 4,
        copy: bool = True,
    ) -> None:
        from tierio.storage import LocalStore, open_store

        self.store = url if not isinstance(url, (str, Path)) else open_store(url)
        self.url = self.store.url
        self.manifest: Manifest = load_manifest(self.store, self.url)
        rank, world_size = rank_world(rank, world_size)
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, int(seed), int(shuffle_buffer)
        self.batch_size = batch_size
        self.prefetch = max(0, prefetch)
        self.transform = transform
        self.max_open_shards = max(1, max_open_shards)
        self.copy = copy
        self.cache_limit = parse_size(cache_limit)
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.wait_timeout = wait_timeout
        if self.cache_dir is None:
            if not isinstance(self.store, LocalStore):
                raise ConfigError(f"{self.url} is remote: pass cache_dir (a local NVMe directory) to stream it")
        self._largest = largest_shard(self.manifest.shards, of=self.url)  # every size checked
        if self.cache_dir is not None and self.manifest.shards:
            check_fits(max(self.manifest.shards, key=lambda s: s.size), self.cache_limit, of=self.url)
        self.samples_per_rank = self.manifest.num_samples // world_size
        self._counts = np.asarray([s.samples for s in self.manifest.shards], dtype=np.int64)
        # position bookkeeping: what the next __iter__ will produce, and what this process consumed
        self._next_epoch = 0
        self._next_start = 0
        self._cur_epoch = 0
        self._cur_pos = 0
        self._init_runtime()

    # -- per-process state (rebuilt after pickling into a worker) ---------------------------
    def _init_runtime(self) -> None:
        # with the fork start method workers inherit this object without pickling: the pid
        # tells a worker to start its own runtime instead of using the parent's threads/files
        self._pid = os.getpid()
        self._cache: ShardCache | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._indexes: dict[int, np.ndarray] = {}
        self._open: OrderedDict[int, ShardFile] = OrderedDict()
        self._budget = ReaderBudget(self.max_open_shards, self.prefetch)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for k in ("store", "_cache", "_pool", "_pending", "_indexes", "_open"):
            state.pop(k, None)  # clients, threads and open files do not cross processes
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.store = self._open_store(self.url)
        self._init_runtime()

    @staticmethod
    def _open_store(url: str) -> Store:
        from tierio.storage import open_store

        return open_store(url)

    def __len__(self) -> int:
        return self.samples_per_rank

    @property
    def cache(self) -> ShardCache | None:
        self._check_process()
        if self._cache is None and self.cache_dir is not None:
            self._cache = ShardCache(self.store, self.cache_dir, self.cache_limit, wait_timeout=self.wait_timeout)
        return self._cache

    # -- order ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch``."""
        self._next_epoch, self._next_start = int(epoch), 0

    def epoch_order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self._counts, self.seed, epoch, self.shuffle, self.shuffle_buffer)

    def rank_sample_ids(self, epoch: int) -> np.ndarray:
        """Every global sample id this rank sees in ``epoch``, in order (for checks and tools)."""
        base = self.rank * self.samples_per_rank
        return self.epoch_order(epoch).positions(base, base + self.samples_per_rank)

    # -- shards -----------------------------------------------------------------------------
    def _index(self, shard: int) -> np.ndarray:
        idx = self._indexes.get(shard)
        if idx is None:
            info = self.manifest.shards[shard]
            where = f"{self.url}/{info.index_key}"
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
                    raw = read_bytes(self.store, info.index_key)
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

    def _prefetch(self, shards: list[int]) -> None:
        if not shards or self.cache_dir is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(2, len(shards)), thread_name_prefix="tierio-prefetch")
        for s in shards:
            if s not in self._open and s not in self._pending:
                self._pending[s] = self._pool.submit(self._fetch, s)

    def _shard(self, shard: int) -> ShardFile:
        sf = self._open.get(shard)
        if sf is not None:
            self._open.move_to_end(shard)
            return sf
        fut = self._pending.pop(shard, None)
        if fut is not None:
            fut.result()  # re-raises a failed prefetch here, where the shard is needed
        info: ShardInfo = self.manifest.shards[shard]
        # Unpin before pinning another: the download of this shard may need the room they hold.
        while len(self._open) >= self._budget.open_shards:
            _, old = self._open.popitem(last=False)
            old.close()  # releases its cache lock
        if self.cache is None:
            sf = ShardFile(self.store.path(info.key), self._index(shard), self.manifest.fields)  # type: ignore[attr-defined]
        else:
            path, fd = self.cache.open_locked(info)  # the shard first: its index is cached only beside it
            try:
                index = self._index(shard)
            except BaseException:
                release_fd(fd)
                raise
            sf = ShardFile(path, index, self.manifest.fields, on_close=lambda: release_fd(fd))
        self._open[shard] = sf
        return sf

    def close(self) -> None:
        for sf in self._open.values():
            sf.close()
        self._open.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()

    # -- iteration --------------------------------------------------------------------------
    def _reader_budget(self, workers: int) -> ReaderBudget:
        if self.cache_dir is None or not self._largest:
            return ReaderBudget(self.max_open_shards, self.prefetch)
        readers = workers * max(1, _local_world_size())
        return ReaderBudget.share(self.cache_limit // self._largest, readers, self.max_open_shards, self.prefetch)

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            # inherited locks were closed at fork; drop the parent's objects (the store's
            # connection pool and threads belong to the parent) and open our own
            self.store = self._open_store(self.url)
            self._init_runtime()

    def __iter__(self) -> Iterator[Any]:
        self._check_process()
        epoch, start = self._next_epoch, self._next_start
        self._next_epoch, self._next_start = epoch + 1, 0
        self._cur_epoch, self._cur_pos = epoch, start
        w, nw = _worker()
        self._budget = self._reader_budget(nw)
        order = self.epoch_order(epoch)
        n = self.samples_per_rank
        base = self.rank * n
        B = self.batch_size
        chunk = max(self.shuffle_buffer, B * nw, 256)
        pos = start
        try:
            while pos < n:
                end = min(pos + chunk, n)
                local = np.arange(pos, end, dtype=np.int64)
                mine = ((local - start) // B) % nw == w
                gids = order.positions(base + pos, base + end)
                self._prefetch(order.upcoming_shards(base + end, self._budget.prefetch, base + n))
                shards = order.shard_of(gids)
                first = order.first_sample
                needed = set(shards[mine].tolist())
                for done in [k for k in self._open if k not in needed]:
                    self._open.pop(done).close()  # unpin shards this chunk does not read
                for g, s, keep in zip(gids.tolist(), shards.tolist(), mine.tolist()):
                    self._cur_pos += 1
                    if not keep:
                        continue
                    sample = self._shard(s).sample(g - int(first[s]))
                    if self.copy:  # writable arrays that outlive the shard's mapping
                        sample = {k: v.copy() for k, v in sample.items()}
                    yield self.transform(sample) if self.transform is not None else sample
                pos = end
        finally:
            self.close()

    # -- resumption -------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None, epoch: int | None = None) -> dict[str, Any]:
        """Where this rank is. With workers, pass ``consumed`` (samples the loop received this
        epoch) and ``epoch``; ``tierio.data.loader.StatefulLoader`` does this for you."""
        e = self._cur_epoch if epoch is None else epoch
        pos = self._cur_pos if consumed is None else consumed
        if pos >= self.samples_per_rank:
            e, pos = e + 1, 0
        return {
            "format": STATE_FORMAT, "version": STATE_VERSION,
            "dataset": self.manifest.fingerprint, "url": self.url,
            "seed": self.seed, "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer,
            "rank": self.rank, "world_size": self.world_size,
            "epoch": int(e), "position": int(pos),
        }

    def check_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise FormatError(f"not a {STATE_FORMAT} v{STATE_VERSION} state dict: {str(state)[:120]}")
        if state["dataset"] != self.manifest.fingerprint:
            raise ConfigError(
                f"state dict belongs to another dataset (manifest {state['dataset']} at {state.get('url')}), "
                f"not {self.manifest.fingerprint} at {self.url}: resuming would repeat or skip samples"
            )
        for key in ("seed", "shuffle", "shuffle_buffer", "world_size", "rank"):
            mine = getattr(self, key)
            if state[key] != mine:
                raise ConfigError(
                    f"state dict was saved with {key}={state[key]!r} but this dataset has {key}={mine!r}: "
                    "the sample order would differ; construct the dataset with the saved value"
                )
        if not 0 <= int(state["position"]) <= self.samples_per_rank or int(state["epoch"]) < 0:
            raise FormatError(f"state dict position {state['position']} / epoch {state['epoch']} is out of range")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved (epoch, position) on the next ``iter()``."""
        self.check_state(state)
        self._next_epoch, self._next_start = int(state["epoch"]), int(state["position"])
        self._cur_epoch, self._cur_pos = self._next_epoch, self._next_start


def packed_transform(seq_len: int, pad_id: int = 0) -> Callable[[dict[str, np.ndarray]], dict[str, Any]]:
    """Turn a packed shard sample {tokens, seqlens} into input_ids/labels/position_ids/cu_seqlens."""
    from tierio.data.packing import pack_from_tokens

    def transform(sample: dict[str, np.ndarray]) -> dict[str, Any]:
        return pack_from_tokens(sample["tokens"], sample["seqlens"], seq_len, pad_id)

    return transform
