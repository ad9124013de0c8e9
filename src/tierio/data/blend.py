"""Mixtures: one dataset that is a weighted blend of datasets, with Megatron's blending rule.

Sample ``i`` of the blend comes from the source whose count lags its share most: the source ``d``
with the largest ``weight[d] * max(i, 1) - drawn[d]`` (the first such source on a tie), and it is
that source's next sample. This is megatron-core's ``build_blending_indices`` (the C++ helper
behind ``BlendedDataset``), so a blend of the same sources with the same weights and size names the
same (source, sample) pairs; a test compares the two arrays when megatron-core is installed. The
choice has no randomness: the order inside each source is the source's own (a StreamingDataset
shuffles from its seed, an IndexedDataset or token windows are in file order).

The blend's size (``samples``) defaults to the largest for which no source is drawn past its end; a larger
size reads a source again from its start (a StreamingDataset: its next epoch, in a new order).
``sources_info()`` says for each source whether it is used in part, exactly once (``exhausted``)
or more than once (``upsampled``). Megatron's own datasets differ there: a GPTDataset built for
more samples than one epoch shuffles each further epoch itself.

A blend is a map-style dataset with a global position (``tierio.data.position``): ranks take
samples ``r, r + W, ...`` and ``state_dict()`` resumes on any world size. It blends whatever the
sources return: blend ``PackedDataset``s to train on packed rows (collate with ``collate_packed``),
``TokenWindowDataset``s for fixed windows, or ``StreamingDataset``s of shards from a store.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierio.data.position import EpochSplit, Positioned
from tierio.data.ring import BatchRing
from tierio.data.window import TokenWindowDataset, window_output
from tierio.errors import ConfigError, TierioError
from tierio.stats import Stats


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each sample int16, index of the sample in its source int64) for ``size`` samples,
    megatron-core's ``build_blending_indices`` on the normalised ``weights``."""
    w = normalized_weights(weights)
    n = len(w)
    source = np.empty(size, dtype=np.int16)
    sample = np.empty(size, dtype=np.int64)
    drawn = [0] * n
    ws = w.tolist()
    for i in range(size):
        x = float(max(i, 1))
        best, err = 0, ws[0] * x - drawn[0]
        for d in range(1, n):
            e = ws[d] * x - drawn[d]
            if e > err:
                best, err = d, e
        source[i] = best
        sample[i] = drawn[best]
        drawn[best] += 1
    return source, sample


def normalized_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights divided by their sum (float64, as megatron-core normalises them); ConfigError for
    weights that are negative, not finite, or all zero."""
    try:
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"blend weights must be numbers, got {list(weights)!r}") from None
    if not len(w):
        raise ConfigError("a blend needs at least one source and its weight")
    bad = [(i, float(x)) for i, x in enumerate(w) if not math.isfinite(x) or x < 0]
    if bad:
        raise ConfigError(f"blend weights must be finite and >= 0; source {bad[0][0]} has {bad[0][1]}")
    if w.sum() <= 0:
        raise ConfigError(f"blend weights {w.tolist()} are all zero: give at least one source a weight > 0")
    return w / w.sum()


@dataclass
class SourceUse(Stats):
    """How a blend of ``size`` samples uses one source."""

    name: str
    weight: float  # normalised
    length: int  # samples the source has
    drawn: int  # samples the blend takes from it
    passes: float  # drawn / length
    state: str  # "partial", "exhausted" (every sample once) or "upsampled" (some more than once)


class BlendedDataset(Positioned):
    """``ds[i]`` is this rank's ``i``-th sample of the blend of ``sources`` by ``weights``.

    sources: a list, or a dict of name -> source (the names are what messages and ``sources_info()``
        call them; a list's are their paths or ``source i``). Each is a dataset with ``len()`` and ``[k]`` (IndexedDataset, TokenWindowDataset, PackedDataset,
        a BlendedDataset), StreamingDatasets, or Megatron prefixes / shard dataset URLs as text
        (``"/data/web"`` with ``web.idx``/``web.bin`` beside it; ``"s3://bucket/code"`` holding an
        ``index.json``, read through ``cache_dir``). Each is opened and checked now: a missing or
        damaged source fails here, with its name.
    weights: one per source; normalised. Negative, NaN or all-zero weights are a ConfigError.
    samples: the blend's size (megatron-core's ``size``, kept as ``self.size``); by default the most
        for which no source is read twice.
    """

    def __init__(self, sources: Sequence[Any] | Mapping[str, Any], weights: Sequence[float], samples: int | None = None,
                 *, rank: int = 0, world_size: int = 1, cache_dir: str | Path | None = None) -> None:
        if len(sources) != len(weights):
            raise ConfigError(f"a blend takes one weight per source: {len(sources)} source(s), {len(weights)} weight(s)")
        self.weights = normalized_weights(weights)
        if isinstance(sources, Mapping):
            self.names, given = [str(k) for k in sources], list(sources.values())
        else:
            self.names, given = [_name(s, i) for i, s in enumerate(sources)], list(sources)
        self.sources = [_open(s, n, cache_dir) for s, n in zip(given, self.names)]
        self.lengths = np.asarray([_length(s, n) for s, n in zip(self.sources, self.names)], dtype=np.int64)
        for name, n, w in zip(self.names, self.lengths.tolist(), self.weights.tolist()):
            if n == 0 and w > 0:
                raise ConfigError(f"blend source {name!r} has no samples but weight {w:.4g}: drop it or give it data")
        self.size = self._default_size() if samples is None else int(samples)
        if self.size < 0:
            raise ConfigError(f"a blend's samples must be >= 0, got {samples}")
        self.source_index, self.sample_index = blending_indices(self.weights, self.size)
        if samples is None:  # cut where a source would first be read past its end
            over = self.sample_index >= self.lengths[self.source_index]
            if over.any():
                self.size = int(np.argmax(over))
                self.source_index, self.sample_index = self.source_index[: self.size], self.sample_index[: self.size]
        self.split = EpochSplit(self.size, rank, world_size, "strided")
        lens = {getattr(s, "seq_len", None) for s in self.sources}
        windows = all(isinstance(s, TokenWindowDataset) for s in self.sources) and len(lens) == 1
        self.seq_len: int | None = lens.pop() if windows else None  # token windows: batches as one gather
        self._ring: BatchRing | None = None
        self._plan: _Plan | None = None  # the batches being read (sequential batches of token windows)

    def use_ring(self, ring: BatchRing | None) -> None:
        """Let DataLoader workers write window batches into ``ring`` (blends of token windows)."""
        self._ring = ring

    def _default_size(self) -> int:
        live = self.weights > 0
        # a little past where the scarcest source runs out (the rule keeps every count within about
        # one sample of its share); the caller cuts at the first sample past a source's end
        return int(np.floor(np.min((self.lengths[live] + 2) / self.weights[live]))) + 1 if live.any() else 0

    def position_identity(self) -> dict[str, Any]:
        return {"kind": "blend", "weights": [round(w, 12) for w in self.weights.tolist()], "size": self.size,
                "sources": [_fingerprint(s) for s in self.sources]}

    def sources_info(self) -> list[SourceUse]:
        drawn = np.bincount(self.source_index, minlength=len(self.sources))
        out = []
        for name, w, n, k in zip(self.names, self.weights.tolist(), self.lengths.tolist(), drawn.tolist()):
            state = "upsampled" if k > n else "exhausted" if k == n else "partial"
            out.append(SourceUse(name, w, n, k, k / n if n else 0.0, state))
        return out

    def __getitem__(self, i: int) -> Any:
        p = self.global_index(i)
        return self._read(int(self.source_index[p]), np.asarray([self.sample_index[p]]), single=True)

    def __getitems__(self, indices: list[int]) -> Any:
        """A batch: each source read once for its samples, then put back in the blend's order."""
        if self.seq_len is not None:
            n, p0 = len(indices), self.split.run_start(indices)
            pos = None if p0 is not None else self.split.positions_of(np.asarray(indices, dtype=np.int64))
            return window_output(self._ring, n, self.seq_len, lambda rows: self._copy_windows(rows, n, p0, pos))
        pos = self.split.positions_of(np.asarray(indices, dtype=np.int64))
        src, k = self.source_index[pos], self.sample_index[pos]
        order = np.argsort(src, kind="stable")
        parts = [self._read(int(d), k[order][src[order] == d]) for d in np.unique(src).tolist()]
        back = np.argsort(order, kind="stable")
        if parts and all(isinstance(p, dict) for p in parts):
            return {key: _pick(_concat([p[key] for p in parts]), back) for key in parts[0]}
        flat = [x for p in parts for x in (_rows(p) if isinstance(p, dict) else p)]
        return [flat[j] for j in back.tolist()]

    def _copy_windows(self, out: np.ndarray, n: int, p0: int | None, pos: np.ndarray | None) -> None:
        """The batch's windows into ``out`` (positions ``p0 .. p0 + n - 1``, or ``pos``): one copy
        per source into its rows."""
        if p0 is not None and p0 % n == 0:  # a sequential sampler's batch: its rows per source are planned
            plan = self._plan_of(p0, n)
            j = p0 // n - plan.start // n
            for d, source in enumerate(self.sources):
                a, b = plan.bounds[d][j], plan.bounds[d][j + 1]
                if b > a:
                    first = plan.first[d][j]
                    view = source.run_view() if first >= 0 else None
                    if view is not None:  # the common case, kept to one slice and one copy
                        out[plan.rows[d][a:b]] = view[first : first + b - a]
                    else:
                        self._copy_source(out, d, plan.rows[d][a:b], plan.k[d][a:b], True)
            return
        run = p0 is not None
        src, k = (self.source_index[p0 : p0 + n], self.sample_index[p0 : p0 + n]) if run else \
            (self.source_index[pos], self.sample_index[pos])
        order = np.argsort(src, kind="stable")  # the rows of each source, in blend order
        ends = np.cumsum(np.bincount(src, minlength=len(self.sources))).tolist()
        a = 0
        for d, b in enumerate(ends):
            if b > a:
                rows = order[a:b]
                self._copy_source(out, d, rows, k[rows], run)
            a = b

    def _copy_source(self, out: np.ndarray, d: int, rows: np.ndarray, k: np.ndarray, run: bool) -> None:
        """Source ``d``'s samples ``k`` (in blend order) into ``out[rows]``."""
        length = int(self.lengths[d])
        first = int(k[0]) % length
        # consecutive blend positions take consecutive samples of each source (the rule hands a
        # source its next sample): a run is one slice per source unless it wraps into its next pass
        if run and first + len(rows) <= length:
            self.sources[d].copy_run(out, rows, first, len(rows))
        else:
            self.sources[d].copy_windows(out, rows, k % length)

    def _plan_of(self, p0: int, n: int) -> _Plan:
        """The plan of the PLAN_BATCHES batches of ``n`` positions that hold position ``p0``."""
        start = p0 - p0 % (n * PLAN_BATCHES)
        plan = self._plan
        if plan is None or plan.n != n or plan.start != start:
            end = min(start + n * PLAN_BATCHES, self.size)
            plan = self._plan = _Plan.of(self.source_index[start:end], self.sample_index[start:end], start, n,
                                         self.lengths)
        return plan

    def _read(self, d: int, k: np.ndarray, single: bool = False) -> Any:
        """Samples ``k`` of source ``d`` (``k`` past its end: its next pass)."""
        source, n = self.sources[d], int(self.lengths[d])
        take = getattr(source, "take_positions", None)
        if take is not None:  # a stream: sample k is position k % n of its epoch k // n
            got = _split_epochs(take, k, n)
            return {key: v[0] for key, v in got.items()} if single else got
        if single:
            return source[int(k[0]) % n]
        many = getattr(source, "__getitems__", None)
        return many((k % n).tolist()) if many is not None else [source[j] for j in (k % n).tolist()]


PLAN_BATCHES = 256  # consecutive batches whose rows per source are worked out in one pass


@dataclass(frozen=True)
class _Plan:
    """Which rows of each batch each source fills, for consecutive batches of ``n`` positions from
    ``start``. Per source ``d``: batch ``j``'s rows of it are ``rows[d][a:b]`` (in blend order), with
    ``a, b = bounds[d][j], bounds[d][j + 1]``, taking its samples ``k[d][a:b]``, which are the run of
    windows from ``first[d][j]`` (-1: they wrap into the source's next pass). Worked out for many
    batches at once, so that a batch costs little more than its copies."""

    start: int
    n: int
    rows: list[np.ndarray]
    k: list[np.ndarray]
    bounds: list[list[int]]
    first: list[list[int]]

    @classmethod
    def of(cls, src: np.ndarray, k: np.ndarray, start: int, n: int, lengths: np.ndarray) -> _Plan:
        edges = np.arange(-(-len(src) // n) + 1) * n
        rows, ks, bounds, first = [], [], [], []
        for d, length in enumerate(lengths.tolist()):
            pos = np.flatnonzero(src == d)  # this source's positions, in blend order
            b = np.searchsorted(pos, edges)
            kd = k[pos]
            # consecutive blend positions take consecutive samples of each source (the rule hands a
            # source its next sample): a batch's are one run of windows unless they wrap
            f = kd[np.minimum(b[:-1], max(len(kd) - 1, 0))] % length if len(kd) else np.zeros(len(edges) - 1, np.int64)
            rows.append(pos % n)
            ks.append(kd)
            bounds.append(b.tolist())
            first.append(np.where(f + np.diff(b) <= length, f, -1).tolist())
        return cls(start, n, rows, ks, bounds, first)


def _split_epochs(take: Any, k: np.ndarray, n: int) -> dict[str, Any]:
    epochs = k // n
    if len(k) == 0 or epochs[0] == epochs[-1]:
        return take(int(epochs[0]) if len(k) else 0, k % n)
    parts = [take(int(e), k[epochs == e] % n) for e in np.unique(epochs).tolist()]  # k grows: parts stay in order
    return {key: _concat([p[key] for p in parts]) for key in parts[0]}


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch of fields as one dict per sample."""
    n = len(next(iter(batch.values()))) if batch else 0
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _concat(values: list[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    first = values[0]
    if isinstance(first, list):
        return [x for v in values for x in v]
    if isinstance(first, np.ndarray):
        return np.concatenate(values)
    import torch

    return torch.cat(values)


def _pick(value: Any, back: np.ndarray) -> Any:
    if isinstance(value, list):
        return [value[j] for j in back.tolist()]
    if isinstance(value, np.ndarray):
        return value[back]
    import torch

    return value[torch.from_numpy(back)]


def _name(source: Any, i: int) -> str:
    if isinstance(source, (str, Path)):
        return str(source)
    return str(getattr(source, "url", None) or getattr(source, "prefix", None) or f"source {i}")


def _open(source: Any, name: str, cache_dir: str | Path | None) -> Any:
    """A source object; text is a Megatron prefix (a local ``.idx`` beside it) or a shard dataset URL."""
    if not isinstance(source, (str, Path)):
        if not hasattr(source, "__len__"):
            raise ConfigError(f"blend source {name!r} is a {type(source).__name__}, which has no length: "
                              "pass datasets with len() and [i], StreamingDatasets, prefixes or URLs")
        if getattr(source, "use_ring", None) is not None:  # its own loader's ring slots are not the blend's
            source = copy.copy(source)
            source.use_ring(None)
        return source
    from tierio.data.indexed import IndexedDataset
    from tierio.data.streaming import StreamingDataset

    try:
        if Path(f"{source}.idx").exists():
            return IndexedDataset(source)
        return StreamingDataset(source, cache_dir, shuffle=False)
    except TierioError as e:
        raise type(e)(f"blend source {name!r}: {e}") from e


def _length(source: Any, name: str) -> int:
    """Samples of a source; a stream's whole epoch, whatever its rank (the blend splits the ranks)."""
    split = getattr(source, "split", None)
    if isinstance(split, EpochSplit):
        if hasattr(source, "take_positions"):
            return split.total
        if split.world_size != 1:
            raise ConfigError(f"blend source {name!r} was made for rank {split.rank} of {split.world_size}: construct "
                              "the sources with world_size=1 and give the blend the rank and world size")
    return len(source)


def _fingerprint(source: Any) -> Any:
    for attr in ("position_identity", "fingerprint"):
        got = getattr(source, attr, None)
        if callable(got):
            return got()
    manifest = getattr(source, "manifest", None)
    return getattr(manifest, "fingerprint", None) or len(source)


__all__ = ["BlendedDataset", "SourceUse", "blending_indices", "normalized_weights"]
