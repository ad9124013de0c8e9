"""A small GPT-style language model for the demo: pre-norm transformer blocks, tied embeddings.

Small on purpose (it trains on CPU), but a real model with a real optimizer state: the checkpoint
holds parameters, AdamW moments, a learning-rate schedule, RNG state and a data position, which is
what a production training checkpoint holds too. Dropout is on so that a resumed run only matches
an uninterrupted one if the RNG state was restored as well.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    seq_len: int = 64
    d_model: int = 512
    n_layer: int = 6
    n_head: int = 8
    dropout: float = 0.1

    def num_params(self) -> int:
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # qkv+proj (4d^2+4d), mlp (8d^2+5d), two layernorms (4d)
        return self.vocab * d + self.seq_len * d + self.n_layer * per_block + 2 * d

    def state_bytes(self) -> int:
        """fp32 parameters plus the two AdamW moments, about what a checkpoint holds."""
        return 12 * self.num_params()

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = lambda y: y.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)  # noqa: E731
        # Explicit attention rather than scaled_dot_product_attention: its CPU kernels are not all
        # covered by torch.use_deterministic_algorithms, and the demo must be bit-exact.
        att = heads(q) @ heads(k).transpose(-2, -1) / math.sqrt(d // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ heads(v)).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: the checkpoint must store it once and restore it shared
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
