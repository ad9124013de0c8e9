"""StreamingDataset: samples, or whole batches, from shards in any store, through a local cache.

The order of an epoch is a pure function of (seed, epoch) and the manifest:

1. shards are permuted (shard-level shuffle) and each shard's samples are permuted;
2. the resulting sequence is cut into blocks of ``shuffle_buffer`` samples and each block is
   permuted (a deterministic, resumable form of the buffered shuffle: samples mix across
   shard boundaries without an unbounded reservoir);
3. rank ``r`` of ``W`` takes the contiguous slice ``[r*n, (r+1)*n)`` with ``n = N // W`` (every
   rank the same count, so steps stay in lock-step; at most W-1 samples are skipped per epoch);
   after a resume, the ``r``-th of ``W`` equal runs of what the epoch has left
   (``tierio.data.position.EpochSplit``, contiguous layout);
4. inside a rank, DataLoader worker ``w`` of ``k`` produces the batches ``w, w+k, w+2k, ...``.
   The DataLoader collects batches from workers round-robin, so the stream the training
   loop sees is the rank's slice in order, whatever the number of workers.

Because ranks move in lock-step, "every rank consumed c samples" names one set of positions of
the epoch's order: ``state_dict()`` records those (a few intervals), and resuming, with another
number of workers or of ranks, continues with the exact next samples: nothing repeated, nothing
skipped.

Batches are taken whole from the shards (``iter_batches``): a batch's ids are found with a few
vectorised steps and each fixed-size field is gathered from the shard mapping in one copy, with
no per-sample work. Iterating the dataset itself yields the rows of those batches one by one;
``build_loader`` and ``StatefulLoader`` hand the DataLoader whole batches.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tierio.data.cache import ShardCache
from tierio.data.reader import ReaderBudget, ReaderOptions, ShardReader
from tierio.data.ring import FieldRing, RingBatch
from tierio.data.options import StreamingOptions
from tierio.data.position import STATE_FORMAT, STATE_VERSION, EpochSplit, Positioned, check_state, runs_of
from tierio.data.shards import ShardManifest, load_manifest
from tierio.data.wire import columns, take_rows
from tierio.data.workers import current_worker
from tierio.dist import rank_world
from tierio.errors import ConfigError, FormatError
from tierio.storage.base import Store
from tierio.storage.url import as_store

log = logging.getLogger(__name__)

OLD_STATE_FORMAT = "tierio-stream-state"  # per-rank positions (world size fixed); still loaded

# Iterating samples (a plain DataLoader's way), samples are taken from the shards this many at a
# time instead of one by one: a take costs ~10 us whatever its size, a sample's share of a gather
# well under one. A sample kept alive holds its gather's rows, so a gather stays under the bytes.
SAMPLE_GATHER = 64
SAMPLE_GATHER_BYTES = 1 << 20

try:  # an IterableDataset when torch is present, a plain iterable otherwise
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover
    _Base = object  # type: ignore[assignment,misc]


def _worker() -> tuple[int, int]:
    return current_worker() or (0, 1)


class EpochOrder:
    """The sample order of one epoch: ``positions(a, b)`` -> global sample ids at [a, b).

    ``before_permuting(shard)`` is called before a shard's samples are permuted (an array of its
    declared sample count is made then): the dataset checks there that the shard's real size is
    its declared size, which bounds that count."""

    def __init__(self, counts: np.ndarray, seed: int, epoch: int, shuffle: bool, buffer: int,
                 before_permuting: Callable[[int], None] | None = None) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.before_permuting = before_permuting
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
            if self.before_permuting is not None:
                self.before_permuting(shard)
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


class StreamingDataset(Positioned, _Base):  # type: ignore[misc,valid-type]
    """Iterate the samples of a shard dataset at ``url`` through a local cache.

    url: any store URL holding ``index.json`` + shards (``s3://...``, ``file:///...``, a path).
    options: a StreamingOptions; keyword ``overrides`` (any of its fields) apply on top, and
    ``cache_dir`` and ``cache_limit_bytes`` may also come as the second and third argument:

    cache_dir: local directory for verified shard copies (shared by all workers and ranks of a
        node). ``None`` reads a local store's shards in place (no copy, no cache).
    cache_limit_bytes: bytes the cache may hold ("64GiB"); must exceed the largest shard. A reader
        never waits on its own pins: the shards it holds open (at most ``max_open_shards``) and
        prefetches are sized so that, with one more download, they fit its share of the limit (the
        limit divided among the DataLoader workers and the node's ranks, ``LOCAL_WORLD_SIZE``).
    batch_size: the batch size; ``iter_batches`` yields batches of it, and DataLoader workers
        interleave whole batches (see module doc).
    transform: applied to each sample (a dict of field -> numpy array) when iterating samples.
    copy: hand out writable copies (default) instead of read-only views of the shard mapping
        (a batch of a fixed-size field is then one gather; without it, a run of consecutive
        samples is a view).
    """

    def __init__(self, url: str | Path | Store, cache_dir: str | Path | None = None,
                 cache_limit_bytes: int | str | None = None, *, options: StreamingOptions | None = None,
                 **overrides: Any) -> None:
        given = {k: v for k, v in (("cache_dir", cache_dir), ("cache_limit_bytes", cache_limit_bytes)) if v is not None}
        opts = StreamingOptions.resolve(options, {**given, **overrides})
        self.options = opts
        self.store = as_store(url)
        self.url = self.store.url
        self.manifest: ShardManifest = load_manifest(self.store, self.url)
        rank, world_size = rank_world(opts.rank, opts.world_size)
        if opts.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {opts.batch_size}")
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.shuffle_buffer = opts.shuffle, int(opts.seed), int(opts.shuffle_buffer)
        self.batch_size = opts.batch_size
        self.transform = opts.transform
        self.copy = opts.copy
        self.reader_options = ReaderOptions(None if opts.cache_dir is None else Path(opts.cache_dir),
                                            int(opts.cache_limit_bytes), opts.wait_timeout,
                                            max(1, opts.max_open_shards), max(0, opts.prefetch))
        self._counts = np.asarray([s.samples for s in self.manifest.shards], dtype=np.int64)
        # position bookkeeping: where the next __iter__ starts (_next_split), and the split being
        # consumed with the samples this process took of it (split, _cur_pos)
        self.split = self._next_split = EpochSplit(self.manifest.num_samples, rank, world_size, "contiguous")
        self._cur_pos = 0
        self._init_runtime()

    # -- per-process state (rebuilt after pickling into a worker) ---------------------------
    def _init_runtime(self) -> None:
        # with the fork start method workers inherit this object without pickling: the pid
        # tells a worker to start its own runtime instead of using the parent's threads/files
        self._pid = os.getpid()
        self._reader = ShardReader(self.store, self.manifest, self.reader_options)
        self._order: EpochOrder | None = None  # the last epoch order take_positions used

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for k in ("store", "_reader", "_order"):
            state.pop(k, None)  # clients, threads and open files do not cross processes
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.store = self._open_store(self.url)
        self._init_runtime()

    @staticmethod
    def _open_store(url: str) -> Store:
        return as_store(url)

    @property
    def samples_per_rank(self) -> int:
        return self.split.share

    @property
    def cache(self) -> ShardCache | None:
        self._check_process()
        return self._reader.cache

    @property
    def cache_dir(self) -> Path | None:
        return self.reader_options.cache_dir

    @property
    def cache_limit_bytes(self) -> int:
        return self.reader_options.cache_limit

    # the earlier name of cache_limit_bytes, kept for readers of the attribute
    cache_limit = cache_limit_bytes

    @property
    def _budget(self) -> ReaderBudget:
        return self._reader.budget

    def close(self) -> None:
        """Unpin every open shard and stop prefetching."""
        self._reader.close()

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            # inherited locks were closed at fork; drop the parent's objects (the store's
            # connection pool and threads belong to the parent) and open our own
            self.store = self._open_store(self.url)
            self._init_runtime()

    # -- order ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch``."""
        self.split = self._next_split = self._next_split.moved(epoch)
        self._cur_pos = 0

    def resume(self, epoch: int, count: int) -> None:
        """Start the next iteration in ``epoch`` after every rank took ``count`` samples of its share."""
        super().resume(epoch, count)
        self._next_split, self._cur_pos = self.split, 0

    def epoch_order(self, epoch: int) -> EpochOrder:
        self._check_process()
        return EpochOrder(self._counts, self.seed, epoch, self.shuffle, self.shuffle_buffer,
                          before_permuting=self._reader.check_size)

    def take_positions(self, epoch: int, positions: np.ndarray) -> dict[str, Any]:
        """The samples at ``positions`` of ``epoch``'s global order as one batch (random access,
        whatever the rank: what a blend of sources reads)."""
        order = self._order
        if order is None or order.epoch != epoch or self._pid != os.getpid():
            order = self._order = self.epoch_order(epoch)
        pos = np.asarray(positions, dtype=np.int64)
        uniq, back = np.unique(pos, return_inverse=True)
        gids = _take(order, runs_of(uniq))[back]
        shards = order.shard_of(gids)
        return self._reader.take(shards, gids - order.first_sample[shards], self.copy)

    def rank_sample_ids(self, epoch: int) -> np.ndarray:
        """Every global sample id this rank sees in ``epoch``, in order (for checks and tools)."""
        split = self.split.moved(epoch)
        order = self.epoch_order(epoch)
        return _take(order, split.runs(0, split.share))

    # -- iteration --------------------------------------------------------------------------
    def _my_chunks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """This process's part of the next epoch, chunk by chunk of the rank's order: (rank position
        where the chunk starts, shard of each sample, index of each sample in its shard, where this
        process's batches start in the chunk, their lengths, and the chunk indices of their samples).
        Starts where ``load_state_dict`` or ``set_epoch`` said, then moves the next iteration to the
        following epoch."""
        self._check_process()
        split = self._next_split
        self._next_split = split.moved(split.epoch + 1)
        self.split, self._cur_pos = split, 0
        w, nw = _worker()
        reader = self._reader
        reader.set_workers(nw)
        order = self.epoch_order(split.epoch)
        n = split.share
        B = self.batch_size
        step = B * nw  # one batch of every worker
        chunk = -(-max(self.shuffle_buffer, 256) // step) * step
        pos = 0
        try:
            while pos < n:
                end = min(pos + chunk, n)
                gids = _take(order, split.runs(pos, end))
                ahead = split.runs(end, n)[:1]  # the shards ahead in this rank's next run
                if ahead:
                    reader.prefetch(order.upcoming_shards(ahead[0][0], reader.budget.prefetch, ahead[0][1]))
                shards = order.shard_of(gids)
                local = gids - order.first_sample[shards]
                starts = np.arange(w * B, end - pos, step, dtype=np.int64)
                lens = np.minimum(starts + B, end - pos) - starts
                # the chunk indices of this process's batches, back to back (no loop per batch: a
                # plain DataLoader's dataset has batches of one)
                mine = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
                reader.keep_only(set(np.unique(shards[mine]).tolist()))
                yield pos, shards, local, starts, lens, mine
                pos = end
        finally:
            reader.close()

    def _my_batches(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """This process's batches of the next epoch: (rank position where the batch starts, shard
        of each sample, index of each sample in its shard)."""
        for pos, shards, local, starts, lens, _ in self._my_chunks():
            for a, n in zip(starts.tolist(), lens.tolist()):
                yield pos + a, shards[a : a + n], local[a : a + n]

    def _my_gathers(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """This process's samples of the next epoch in the order of ``_my_batches``, up to ``size`` at
        a time: (rank position of each sample, its shard, its index in the shard)."""
        for pos, shards, local, _, _, idx in self._my_chunks():
            for g in range(0, len(idx), size):
                sel = idx[g : g + size]
                yield pos + sel, shards[sel], local[sel]

    def _gather_size(self) -> int:
        """Samples to take from the shards at once when iterating samples: a batch, and at least
        SAMPLE_GATHER of them (a kept sample holds its gather's rows: at most SAMPLE_GATHER_BYTES)."""
        sample_bytes = sum(t.row_bytes for t in self.manifest.types if not t.variable)
        return max(self.batch_size, min(SAMPLE_GATHER, SAMPLE_GATHER_BYTES // max(1, sample_bytes)))

    def iter_batches(self) -> Iterator[dict[str, Any]]:
        """This process's batches of the next epoch (with DataLoader workers: this worker's): dicts of
        field -> array ``[batch, ...]`` for fixed-size fields (one gather from the shard each) and
        field -> list of arrays for variable-size fields. The last batch of an epoch may be short."""
        for at, shards, local in self._my_batches():
            self._cur_pos = at + len(local)
            yield self._reader.take(shards, local, self.copy)

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        plain_worker = get_worker_info() is not None and self.transform is None  # see tierio.data.wire
        fields = self.fixed_fields() if plain_worker else []
        for at, shards, local in self._my_gathers(self._gather_size()):
            if plain_worker:
                batch = take_rows(lambda out: self._reader.take(shards, local, True, out), fields, len(local))
            else:
                batch = self._reader.take(shards, local, self.copy)
            cols = columns(batch)
            for i, end in enumerate((at + 1).tolist()):
                self._cur_pos = end
                sample = {k: col[i] for k, col in cols}
                yield self.transform(sample) if self.transform is not None else sample

    def fixed_fields(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        """(name, dtype, row shape) of each fixed-size field: what a shared-memory slot can hold."""
        return [(t.name, t.dtype, t.shape) for t in self.manifest.types if not t.variable]

    def batched(self, drop_last: bool = False) -> BatchStream:
        """This dataset as an iterable of whole batches, for ``DataLoader(..., batch_size=None)``."""
        return BatchStream(self, drop_last)

    # -- resumption -------------------------------------------------------------------------
    def position_identity(self) -> dict[str, Any]:
        return {"kind": "stream", "dataset": self.manifest.fingerprint, "seed": self.seed, "shuffle": self.shuffle,
                "shuffle_buffer": self.shuffle_buffer}

    def state_dict(self, consumed: int | None = None, epoch: int | None = None) -> dict[str, Any]:
        """The global position (JSON): the samples of the epoch every rank consumed together. With
        workers, pass ``consumed`` (samples the loop received since the split began) and ``epoch``;
        ``tierio.data.loader.StatefulLoader`` does this for you."""
        split = self.split
        if epoch is not None and epoch != split.epoch:
            split = self._next_split if epoch == self._next_split.epoch else split.moved(epoch)
        count = self._cur_pos if consumed is None else consumed
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "url": self.url, **self.position_identity(),
                **split.state(count)}

    def check_state(self, state: dict[str, Any]) -> EpochSplit:
        if isinstance(state, dict) and state.get("format") == OLD_STATE_FORMAT:
            state = self._upgrade(state)
        return check_state(state, self.position_identity(), self.split, f"streaming dataset {self.url}")

    def _upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A per-rank state of the previous format as the global position it implies (ranks in lock-step)."""
        try:
            world, epoch, pos = int(state["world_size"]), int(state["epoch"]), int(state["position"])
            old = EpochSplit(self.manifest.num_samples, 0, world, "contiguous", epoch)
            return {**state, "format": STATE_FORMAT, "version": STATE_VERSION, "kind": "stream", **old.state(pos)}
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise FormatError(f"not a {OLD_STATE_FORMAT} state dict ({e}): {str(state)[:120]}") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position on the next ``iter()``, on any number of ranks and workers."""
        self.split = self._next_split = self.check_state(state)
        self._cur_pos = 0


def _take(order: EpochOrder, runs: list[tuple[int, int]]) -> np.ndarray:
    """Sample ids at the given runs of epoch positions, in order."""
    if len(runs) == 1:
        return order.positions(*runs[0])
    return np.concatenate([order.positions(a, b) for a, b in runs]) if runs else np.zeros(0, dtype=np.int64)


class BatchStream(_Base):  # type: ignore[misc,valid-type]
    """A StreamingDataset's whole batches as an iterable dataset (``StreamingDataset.batched``).

    ``drop_last`` drops a short last batch of an epoch (a DataLoader cannot, once it is handed
    whole batches). With a FieldRing (``use_ring``, before DataLoader workers start) a worker
    gathers the fixed-size fields of each batch straight into its next free slot of shared
    memory and sends only a ``RingBatch``; the loader turns that into tensors over the slot."""

    def __init__(self, dataset: StreamingDataset, drop_last: bool = False) -> None:
        self.dataset = dataset
        self.drop_last = drop_last
        self.batch_size = dataset.batch_size
        self.ring: FieldRing | None = None

    def ring_fields(self) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
        """The fixed-size fields of the dataset: what a FieldRing slot can hold."""
        return self.dataset.fixed_fields()

    def use_ring(self, ring: FieldRing | None) -> None:
        self.ring = ring

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        ring = self.ring
        worker = _worker_id() if ring is not None else None
        for at, shards, local in ds._my_batches():
            n = len(local)
            if self.drop_last and n < self.batch_size:
                return
            ds._cur_pos = at + n
            slot = ring.acquire(worker) if ring is not None and worker is not None else None
            if slot is None:
                yield ds._reader.take(shards, local, ds.copy)
                continue
            try:
                views = ring.views(slot, n)  # type: ignore[union-attr]
                got = ds._reader.take(shards, local, True, out=views)
            except BaseException:
                ring.release(slot)  # type: ignore[union-attr]
                raise
            yield RingBatch(slot, n, {k: v for k, v in got.items() if k not in views})

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def _worker_id() -> int | None:
    me = current_worker()
    return None if me is None else me[0]


def packed_transform(seq_len: int, pad_id: int = 0) -> Callable[[dict[str, np.ndarray]], dict[str, Any]]:
    """Turn a packed shard sample {tokens, seqlens} into input_ids/labels/position_ids/cu_seqlens."""
    from tierio.data.packing import pack_from_tokens

    def transform(sample: dict[str, np.ndarray]) -> dict[str, Any]:
        return pack_from_tokens(sample["tokens"], sample["seqlens"], seq_len, pad_id)

    return transform
