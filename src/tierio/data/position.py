"""A data position that survives a change of world size: the samples of the epoch consumed so far.

An epoch is an order of ``total`` samples (positions ``0 .. total - 1`` of the epoch's order,
whatever that order is). The position is the set of positions already consumed, kept as sorted,
disjoint intervals, so it names the same samples on any number of ranks and workers. Ranks share
what is left (the positions not consumed, in order) in one of two layouts:

* ``contiguous``: rank ``r`` of ``W`` takes the ``r``-th of ``W`` equal runs of what is left (a
  rank reads few shards of a streaming dataset, so a node's cache holds few);
* ``strided``: rank ``r`` takes what is left at ``r, r + W, r + 2W, ...`` (token windows).

Every rank gets ``len(left) // W`` samples (lock-step: the same number of steps everywhere); at
most ``W - 1`` positions at the end of the epoch are left out. Because ranks move in lock-step,
the ranks that each consumed ``c`` samples of their share have together consumed one known set
of positions (``consumed_after(c)``), the same on every rank: that is the state a checkpoint
records, and any world size resumes from it with every sample of the epoch seen exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tierio.errors import ConfigError, FormatError

Layout = Literal["contiguous", "strided"]
Intervals = list[tuple[int, int]]


def merge(intervals: Intervals) -> Intervals:
    """Sorted, disjoint, non-empty intervals covering the same positions."""
    out: Intervals = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def parse_intervals(doc: Any, total: int, where: str) -> Intervals:
    """Consumed intervals from a state dict, checked: pairs of integers inside ``[0, total]``."""
    if not isinstance(doc, list):
        raise FormatError(f"{where}: 'consumed' must be a list of [start, end] pairs, got {type(doc).__name__}")
    out: Intervals = []
    for pair in doc:
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(type(v) is int for v in pair)
        if not ok or not 0 <= pair[0] <= pair[1] <= total:
            raise FormatError(f"{where}: consumed interval {pair!r} is not [start, end] with 0 <= start <= end <= {total}")
        out.append((pair[0], pair[1]))
    return merge(out)


@dataclass(frozen=True)
class EpochSplit:
    """This rank's share of what is left of one epoch (see the module doc)."""

    total: int
    rank: int = 0
    world_size: int = 1
    layout: Layout = "contiguous"
    epoch: int = 0
    consumed: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in a world of {self.world_size}")
        if self.layout not in ("contiguous", "strided"):
            raise ConfigError(f"unknown layout {self.layout!r}: use 'contiguous' or 'strided'")
        left = _complement(list(self.consumed), self.total)
        starts = np.asarray([a for a, _ in left], dtype=np.int64)
        lens = np.asarray([b - a for a, b in left], dtype=np.int64)
        cum = np.zeros(len(left) + 1, dtype=np.int64)
        np.cumsum(lens, out=cum[1:])
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_cum", cum)

    @property
    def left(self) -> int:
        """Positions of the epoch not consumed yet."""
        return int(self._cum[-1])  # type: ignore[attr-defined]

    @property
    def share(self) -> int:
        """Samples this rank takes (the same on every rank)."""
        return self.left // self.world_size

    @property
    def fresh(self) -> bool:
        return not self.consumed

    def _left_index(self, i: np.ndarray) -> np.ndarray:
        """Index into what is left of this rank's ``i``-th sample."""
        if self.layout == "contiguous":
            return self.rank * self.share + i
        return i * self.world_size + self.rank

    def _at(self, q: np.ndarray) -> np.ndarray:
        """Epoch positions of indices ``q`` into what is left."""
        cum, starts = self._cum, self._starts  # type: ignore[attr-defined]
        j = np.searchsorted(cum, q, side="right") - 1
        return starts[j] + (q - cum[j])

    def _span(self, qa: int, qb: int) -> Intervals:
        """Epoch positions of indices ``qa .. qb - 1`` into what is left, as intervals."""
        cum, starts = self._cum, self._starts  # type: ignore[attr-defined]
        out: Intervals = []
        j = int(np.searchsorted(cum, qa, side="right")) - 1
        while qa < qb and j < len(starts):
            lo, hi = max(qa, int(cum[j])), min(qb, int(cum[j + 1]))
            if hi > lo:
                out.append((int(starts[j]) + lo - int(cum[j]), int(starts[j]) + hi - int(cum[j])))
            j += 1
        return out

    def positions(self, a: int, b: int) -> np.ndarray:
        """Epoch positions of this rank's samples ``a .. b - 1``."""
        if not 0 <= a <= b <= self.share:
            raise IndexError(f"samples [{a}, {b}) outside this rank's {self.share}")
        return self._at(self._left_index(np.arange(a, b, dtype=np.int64)))

    def positions_of(self, idx: np.ndarray) -> np.ndarray:
        """Epoch positions of this rank's samples ``idx`` (an int64 array)."""
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.share):
            raise IndexError(f"sample index out of range for {self.share} on rank {self.rank}")
        if self.world_size == 1 and not self.consumed:
            return idx  # a whole epoch on one rank: sample i is position i
        return self._at(self._left_index(idx))

    def run_start(self, indices: list[int]) -> int | None:
        """The first position of a batch whose positions are consecutive, on one rank with nothing
        consumed (sample i is position i there: a sequential sampler's batches), else None. Checked
        on the list: the array calls it saves are a fifth of a window batch's cost."""
        n = len(indices)
        if n < 2 or self.world_size != 1 or self.consumed or indices != list(range(indices[0], indices[0] + n)):
            return None
        if indices[0] < 0 or indices[-1] >= self.share:
            raise IndexError(f"samples [{indices[0]}, {indices[-1]}] outside this rank's {self.share}")
        return int(indices[0])

    def position(self, i: int) -> int:
        return int(self.positions(i, i + 1)[0])

    def runs(self, a: int, b: int) -> Intervals:
        """This rank's samples ``a .. b - 1`` as intervals of epoch positions (contiguous layout:
        at most a few; strided: one per sample)."""
        if self.layout == "contiguous":
            if not 0 <= a <= b <= self.share:
                raise IndexError(f"samples [{a}, {b}) outside this rank's {self.share}")
            return self._span(self.rank * self.share + a, self.rank * self.share + b)
        return runs_of(self.positions(a, b))

    def consumed_after(self, count: int) -> Intervals:
        """The positions consumed once every rank has taken ``count`` samples of its share."""
        if not 0 <= count <= self.share:
            raise ConfigError(f"{count} samples consumed but a rank's share of epoch {self.epoch} is {self.share}")
        if self.layout == "strided":
            taken = [(0, count * self.world_size)]
        else:
            taken = [(r * self.share, r * self.share + count) for r in range(self.world_size)]
        got: Intervals = list(self.consumed)
        for qa, qb in taken:
            got += self._span(qa, qb)
        return merge(got)

    def advanced(self, count: int) -> EpochSplit:
        """The same split once every rank took ``count`` samples: this rank's share starts after them."""
        if count == 0:
            return self
        return self.moved(self.epoch, self.consumed_after(count))

    def moved(self, epoch: int, consumed: Intervals = ()) -> EpochSplit:  # type: ignore[assignment]
        return EpochSplit(self.total, self.rank, self.world_size, self.layout, int(epoch), tuple(merge(list(consumed))))

    def state(self, count: int) -> dict[str, Any]:
        """JSON position after ``count`` samples of this rank's share (an epoch finished is the next one, fresh)."""
        if count >= self.share:
            return {"epoch": self.epoch + 1, "total": self.total, "consumed": []}
        return {"epoch": self.epoch, "total": self.total, "consumed": [list(p) for p in self.consumed_after(count)]}

    def from_state(self, state: dict[str, Any], where: str) -> EpochSplit:
        """This rank's split at a saved position (any world size saved it)."""
        epoch, total = state.get("epoch"), state.get("total")
        if type(epoch) is not int or epoch < 0:
            raise FormatError(f"{where}: epoch {epoch!r} is not an integer >= 0")
        if total != self.total:
            raise ConfigError(f"{where}: the state covers an epoch of {total} samples but this dataset has {self.total}: "
                              "it belongs to another dataset or settings; construct it as when it was saved")
        return self.moved(epoch, parse_intervals(state.get("consumed"), self.total, where))


def runs_of(p: np.ndarray) -> Intervals:
    """Runs of consecutive positions in ``p`` as intervals."""
    if not len(p):
        return []
    cut = np.flatnonzero(np.diff(p) != 1) + 1
    bounds = np.concatenate([[0], cut, [len(p)]])
    return [(int(p[s]), int(p[e - 1]) + 1) for s, e in zip(bounds[:-1], bounds[1:])]


def _complement(consumed: Intervals, total: int) -> Intervals:
    out: Intervals = []
    at = 0
    for a, b in merge(consumed):
        if a > at:
            out.append((at, min(a, total)))
        at = max(at, b)
    if at < total:
        out.append((at, total))
    return out


STATE_FORMAT = "tierio-data-position"
STATE_VERSION = 1


class Positioned:
    """What map-style datasets share when their rank's samples follow an ``EpochSplit``: the length,
    rank index to epoch position, and a state dict that any world size resumes from.

    A subclass sets ``self.split`` and says in ``position_identity()`` what a state must match
    (the dataset's fingerprint and the settings that change the order)."""

    split: EpochSplit

    def position_identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.split.share

    def global_index(self, i: int) -> int:
        """Position in the epoch of this rank's ``i``-th sample."""
        if not 0 <= i < self.split.share:
            raise IndexError(f"sample {i} out of range for {self.split.share} on rank {self.split.rank}")
        return self.split.position(i)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.split = self.split.moved(epoch)

    def resume(self, epoch: int, count: int) -> None:
        """Continue in ``epoch`` after every rank took ``count`` samples of its share."""
        split = self.split if epoch == self.split.epoch else self.split.moved(epoch)
        self.split = split.advanced(count)

    def state_dict(self, consumed: int = 0, epoch: int | None = None) -> dict[str, Any]:
        """The global position once every rank took ``consumed`` samples of its share (JSON)."""
        split = self.split if epoch is None or epoch == self.split.epoch else self.split.moved(epoch)
        return {"format": STATE_FORMAT, "version": STATE_VERSION, **self.position_identity(), **split.state(consumed)}

    def check_state(self, state: dict[str, Any]) -> EpochSplit:
        """This rank's split at ``state``; a state of another dataset or order is a ConfigError."""
        return check_state(state, self.position_identity(), self.split, type(self).__name__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.split = self.check_state(state)


def check_state(state: Any, identity: dict[str, Any], split: EpochSplit, what: str) -> EpochSplit:
    """``split`` moved to the position of ``state`` once its identity matches ``identity``."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise FormatError(f"not a {STATE_FORMAT} v{STATE_VERSION} state dict: {str(state)[:120]}")
    for key, mine in identity.items():
        if state.get(key) == mine:
            continue
        if key == "dataset":
            raise ConfigError(f"state dict belongs to another dataset ({state.get(key)!r}), not {what} ({mine!r}): "
                              "resuming would repeat or skip samples; load the state saved for this dataset")
        raise ConfigError(
            f"state dict was saved with {key}={state.get(key)!r} but {what} has {key}={mine!r}: the sample "
            "order would differ; construct the dataset with the saved value")
    return split.from_state(state, what)


__all__ = ["EpochSplit", "Positioned", "check_state", "runs_of", "Intervals", "Layout", "merge", "parse_intervals"]
