"""Synthetic token data with learnable structure, and a loader whose position is checkpoint state.

The stream comes from a sparse random Markov chain (each token has a few likely successors), so
the loss falls visibly within a minute of CPU training. The loader's state is two integers
(epoch, position); the order of windows is a pure function of (seed, epoch), so restoring those
two integers resumes the data stream exactly where it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def markov_tokens(vocab: int, n_tokens: int, seed: int, fanout: int = 4) -> np.ndarray:
    """A token stream where each token is followed by one of ``fanout`` successors."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, fanout))
    choice = rng.integers(0, fanout, size=n_tokens)
    out = np.empty(n_tokens, dtype=np.int64)
    tok = int(rng.integers(0, vocab))
    for i in range(n_tokens):  # a few hundred thousand steps at most: fast enough in Python
        out[i] = tok
        tok = int(successors[tok, choice[i]])
    return out


@dataclass
class TokenLoader:
    """Batches of (input, target) windows in a seeded shuffled order, resumable from (epoch, pos)."""

    tokens: np.ndarray
    seq_len: int
    batch: int
    seed: int
    epoch: int = 0
    pos: int = 0

    def __post_init__(self) -> None:
        self.n_windows = (len(self.tokens) - 1) // self.seq_len
        if self.n_windows < self.batch:
            raise ValueError("token stream too short for one batch")
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > self.n_windows:
            self.epoch, self.pos = self.epoch + 1, 0
        starts = self._order_for(self.epoch)[self.pos : self.pos + self.batch] * self.seq_len
        self.pos += self.batch
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        window = torch.from_numpy(self.tokens[idx])
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"data seed mismatch: checkpoint {state['seed']}, loader {self.seed}")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
