"""The framework models the integration benchmarks train, each sized to a byte target of weights
plus Adam's two moments: one home for `bench integrations` (one process) and `bench ddp` (torchrun)."""

from __future__ import annotations

from typing import Any

WIDE = 1024  # the Lightning model's layer width


def gpt2(nbytes: int, n_embd: int, vocab: int, n_head: int, n_positions: int) -> Any:
    """A GPT-2 (transformers) of about ``nbytes`` of state, built from its config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    per_layer = 12 * n_embd * n_embd * 4 * 3  # a GPT-2 block's weights + Adam's two moments
    layers = max(1, (nbytes - vocab * n_embd * 12) // per_layer)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=n_embd, n_layer=layers,
                                      n_head=n_head, bos_token_id=0, eos_token_id=0))


def wide(nbytes: int) -> Any:
    """A LightningModule of ``Linear(WIDE, WIDE)`` layers, about ``nbytes`` of state, trained with Adam."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    layers = max(1, nbytes // 3 // (WIDE * WIDE * 4))  # weights + Adam's two moments

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(WIDE, WIDE) for _ in range(layers)])

        def training_step(self, batch: Any, i: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return Wide()
