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
        idx = np.asarray(indices, dtype=np.int64)
        starts = self.split.positions_of(idx) * self.seq_len
        ring = self._ring
        if ring is not None and len(idx) <= ring.data.shape[1]:
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            slot = ring.acquire(info.id) if info is not None else None
            if slot is not None:  # write straight into pre-faulted shared memory, send the slot number
                self._fill(ring.data[slot].numpy(), starts)
                return RingRef(slot, len(idx))
        t = batch_tensor((len(idx), self.seq_len + 1))
        self._fill(t.numpy(), starts)
        return window_batch(t)

    def _fill(self, rows: np.ndarray, starts: np.ndarray) -> None:
        L = self.seq_len + 1
        tokens = self._tokens
        n = len(starts)
        if n > 1:
            step = int(starts[1] - starts[0])
            if step > 0 and bool(np.all(np.diff(starts) == step)):
                # evenly spaced windows (sequential batches): one strided view, one converting copy
                itemsize = tokens.itemsize
                view = np.lib.stride_tricks.as_strided(
                    tokens[int(starts[0]) :], shape=(n, L), strides=(step * itemsize, itemsize), writeable=False
                )
                rows[:n] = view
                return
        for r, s in enumerate(starts.tolist()):  # contiguous row copies
            rows[r] = tokens[s : s + L]

    def use_ring(self, ring: BatchRing | None) -> None:
        """Let DataLoader workers fill batches into ``ring`` (set before the workers start)."""
        self._ring = ring

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_tokens")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokens = self._plain(self.dataset.flat_tokens())

    @staticmethod
    def _plain(tokens: np.ndarray) -> np.ndarray:
        # a plain ndarray view of the mapping: slicing np.memmap builds a subclass object each time
        return tokens.view(np.ndarray)


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
