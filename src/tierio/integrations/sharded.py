"""Sharded (FSDP2) training state for the framework adapters: what every rank saves, and the
targets a resume fills.

Under FSDP2 (Accelerate's FSDP2 plugin, Lightning's ``ModelParallelStrategy``) each parameter and
optimizer moment is a DTensor holding this rank's shard. The adapters take the model and optimizer
state through ``torch.distributed.checkpoint.state_dict`` (keyed by parameter names, the same on
any world size), so each rank writes its own shards at their global offsets; the plain tensors
left (step counters) are spread over the ranks (``ckpt.replicated``). A resume builds the same
state dicts on the new mesh and passes them as ``into=``: each rank reads only the chunks that
overlap its shards (resharded when the world size changed), and ``set_*_state_dict`` applies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierio.format.slices import is_dtensor


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    # Accelerate's AcceleratedOptimizer and Lightning's LightningOptimizer wrap the torch one.
    while not type(optimizer).__module__.startswith("torch.") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2 ``fully_shard``, tensor parallelism)."""
    return any(is_dtensor(p) for p in model.parameters())


def state_dicts(model: torch.nn.Module, optimizers: Sequence[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The model's state and each optimizer's, as DCP's state_dict API gives them: DTensor shards
    keyed by parameter name. Saved as is; on a resume, the targets to restore into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(model), [get_optimizer_state_dict(model, _inner(o)) for o in optimizers]


def apply(model: torch.nn.Module, optimizers: Sequence[Any], model_state: dict[str, Any],
          optimizer_states: Sequence[dict[str, Any]], strict: bool = True) -> None:
    """Put restored state dicts (from :func:`state_dicts` targets) into the model and optimizers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, model_state, options=StateDictOptions(strict=strict))
    for optimizer, state in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(model, _inner(optimizer), state)


__all__ = ["apply", "is_sharded", "state_dicts"]
