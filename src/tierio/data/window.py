"""Fixed token windows over an indexed dataset: the classic GPT pre-training sample.

The ``.bin`` is read as one continuous stream of tokens (documents back to back, as Megatron's
GPT dataset does). Window ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``: its first
``seq_len`` tokens are the input and its last ``seq_len`` the target. Items are zero-copy views
of the mapping; conversion to int64 happens once per batch in ``__getitems__``/``collate``.

Ranks take windows ``rank, rank + world, rank + 2*world, ...`` and every rank gets the same
count (the remainder is dropped), so no window is seen twice and steps stay in lock-step. The
position is global (``tierio.data.position``): a state saved on one world size resumes on another.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

from tierio.errors import ConfigError
from tierio.data.indexed import IndexedDataset
from tierio.data.position import EpochSplit, Positioned
from tierio.data.ring import BatchRing, RingRef


class TokenWindowDataset(Positioned):
    """``ds[i] -> (input, target)`` numpy views of ``seq_len`` tokens each."""

    def __init__(
        self, dataset: IndexedDataset | str | Path, seq_len: int, *, rank: int = 0, world_size: int = 1,
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        self.dataset = dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        total_windows = max(0, (self.dataset.num_tokens - 1) // seq_len)
        self.split = EpochSplit(total_windows, rank, world_size, "strided")
        self._tokens = self._plain(self.dataset.flat_tokens())
        self._run_view: tuple[EpochSplit, np.ndarray | None] | None = None
        self._ring: BatchRing | None = None

    @property
    def num_windows(self) -> int:
        """Windows of this rank (equal on every rank)."""
        return self.split.share

    def position_identity(self) -> dict[str, Any]:
        return {"kind": "windows", "dataset": self.dataset.fingerprint(), "seq_len": self.seq_len}

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start = self.global_index(i) * self.seq_len
        w = self._tokens[start : start + self.seq_len + 1]
        return w[:-1], w[1:]

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        """A whole batch in one gather (the DataLoader calls this when it exists)."""
        p0 = self.split.run_start(indices)
        view = self.run_view() if p0 is not None else None
        if view is not None:  # a sequential batch: one converting copy of a slice
            n = len(indices)

            def fill(rows: np.ndarray) -> None:
                rows[:n] = view[p0 : p0 + n]
            return window_output(self._ring, n, self.seq_len, fill)
        idx = np.asarray(indices, dtype=np.int64)
        starts = self.split.positions_of(idx) * self.seq_len
        return window_output(self._ring, len(idx), self.seq_len, lambda rows: self._fill(rows, starts))

    def copy_windows(self, out: np.ndarray, rows: np.ndarray, samples: np.ndarray) -> None:
        """Copy this rank's windows ``samples`` into ``out[rows]`` (rows of ``seq_len + 1`` tokens)."""
        positions = self.split.positions_of(samples)
        starts = positions * self.seq_len
        view = self._run(starts)
        if view is not None:
            out[rows] = view
            return
        every = self.run_view()
        if every is not None:  # scattered windows (a blend on many ranks): one gather, not a loop
            out[rows] = every[positions]
            return
        for r, s in zip(rows.tolist(), starts.tolist()):
            out[r] = self._tokens[s : s + self.seq_len + 1]

    def copy_run(self, out: np.ndarray, rows: np.ndarray, first: int, count: int) -> None:
        """Copy this rank's windows ``first .. first + count - 1`` into ``out[rows]``: a blend's
        sequential batch takes a run of consecutive windows from each source."""
        view = self.run_view() if count > 1 else None
        if view is None:
            self.copy_windows(out, rows, np.arange(first, first + count, dtype=np.int64))
            return
        if not 0 <= first <= first + count <= len(view):
            raise IndexError(f"windows [{first}, {first + count}) outside this rank's {len(view)}")
        out[rows] = view[first : first + count]

    def run_view(self) -> np.ndarray | None:
        """Every window as one strided ``[windows, seq_len + 1]`` view of the tokens when sample ``i``
        is window ``i`` (one rank, nothing consumed, a mapped ``.bin``), else None. A run of samples
        is then a slice of it: no per-window lookups."""
        split = self.split
        cached = self._run_view  # kept per split (a frozen object): a blend asks each source every batch
        if cached is not None and cached[0] is split:
            return cached[1]
        view = None
        if split.world_size == 1 and split.fresh and isinstance(self._tokens, np.ndarray):
            tokens, step = self._tokens, self.seq_len * self._tokens.itemsize
            # window i starts at token i * seq_len; the last one ends at token total * seq_len + 1 <= num_tokens
            view = np.ndarray((split.total, self.seq_len + 1), tokens.dtype, tokens, 0, (step, tokens.itemsize))
        self._run_view = (split, view)
        return view

    def _run(self, starts: np.ndarray) -> np.ndarray | None:
        """Evenly spaced windows (sequential batches) as one strided view of the tokens, else None."""
        n = len(starts)
        if n < 2 or not isinstance(self._tokens, np.ndarray):  # not a .bin read by ranges (data.remote_pair)
            return None
        step = int(starts[1] - starts[0])
        if step <= 0 or not bool(np.all(np.diff(starts) == step)):
            return None
        tokens = self._tokens
        itemsize = tokens.itemsize
        if int(starts[-1]) + self.seq_len + 1 > len(tokens):
            raise IndexError(f"window at token {int(starts[-1])} runs past the {len(tokens)} tokens")
        # the ndarray constructor: a few times cheaper per call than as_strided, which counts here
        return np.ndarray((n, self.seq_len + 1), tokens.dtype, tokens, int(starts[0]) * itemsize,
                          (step * itemsize, itemsize))

    def _fill(self, rows: np.ndarray, starts: np.ndarray) -> None:
        view = self._run(starts)
        if view is not None:  # one converting copy
            rows[: len(starts)] = view
            return
        L = self.seq_len + 1
        if not isinstance(self._tokens, np.ndarray):  # a .bin read by ranges: the rows' requests overlap
            self._tokens.rows(starts.tolist(), L, rows)
            return
        for r, s in enumerate(starts.tolist()):  # contiguous row copies
            rows[r] = self._tokens[s : s + L]

    def use_ring(self, ring: BatchRing | None) -> None:
        """Let DataLoader workers fill batches into ``ring`` (set before the workers start)."""
        self._ring = ring

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_tokens")
        state["_run_view"] = None  # a view of this process's mapping
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = self._plain(self.dataset.flat_tokens())

    @staticmethod
    def _plain(tokens: np.ndarray) -> np.ndarray:
        # a plain ndarray view of the mapping: slicing np.memmap builds a subclass object each time
        return tokens.view(np.ndarray) if isinstance(tokens, np.ndarray) else tokens


def window_output(ring: BatchRing | None, n: int, seq_len: int, fill: Callable[[np.ndarray], None]) -> Any:
    """A batch of ``n`` windows written by ``fill(rows)``: inside a DataLoader worker, straight into a
    free slot of pre-faulted shared memory (only the slot number travels); else into a new tensor."""
    if ring is not None and n <= ring.data.shape[1]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        slot = ring.acquire(info.id) if info is not None else None
        if slot is not None:
            fill(ring.data[slot].numpy())
            return RingRef(slot, n)
    t = batch_tensor((n, seq_len + 1))
    fill(t.numpy())
    return window_batch(t)


def window_batch(t) -> dict[str, Any]:
    """The training view of a [B, seq_len + 1] token tensor."""
    return {"input_ids": t[:, :-1], "labels": t[:, 1:]}


def batch_tensor(shape: tuple[int, ...]):
    """An int64 tensor for a batch; inside a DataLoader worker it is born in shared memory,
    so handing it to the main process costs no extra copy (what default_collate does too)."""
    import torch
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        numel = int(np.prod(shape))
        try:
            storage = torch.UntypedStorage._new_shared(numel * 8)
            return torch.empty(0, dtype=torch.int64).set_(storage, 0, shape)
        except (AttributeError, RuntimeError):
            pass  # older torch: fall back to an ordinary tensor (one extra copy on transfer)
    return torch.empty(shape, dtype=torch.int64)


def collate_windows(batch: Any) -> Any:
    """Collate for TokenWindowDataset: passes ``__getitems__`` batches (and ring slots) through,
    stacks (input, target) pairs otherwise."""
    import torch

    if isinstance(batch, (dict, RingRef)):
        return batch
    rows = np.stack([np.concatenate([x, y[-1:]]) for x, y in batch]).astype(np.int64)
    return window_batch(torch.from_numpy(rows))
