"""Asynchronous, tiered, verified checkpoints (see docs/checkpoints.md).

The names below load on first use: the manager pulls in torch, and a torch-free part of this
package (``tierio.ckpt.saving.interval``, which ``tierio plan`` uses) must not pay for it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_WHERE = {
    "delete_step": "tierio.ckpt.steps.gc",
    "CheckpointManager": "tierio.ckpt.manager", "SaveHandle": "tierio.ckpt.manager",
    "CheckpointOptions": "tierio.ckpt.options",
    **dict.fromkeys(["CheckpointInfo", "gc", "inspect", "list_checkpoints", "promote", "unlock", "verify"],
                    "tierio.ckpt.ops"),
    "Problem": "tierio.ckpt.steps.reader", "VerifyReport": "tierio.ckpt.steps.reader",
    **dict.fromkeys(["AllOf", "AnyOf", "KeepAll", "KeepEvery", "KeepLast", "KeepWithin", "Retention", "gc_plan",
                     "parse_retention"], "tierio.ckpt.steps.retention"),
    "rng_state": "tierio.ckpt.rng", "set_rng_state": "tierio.ckpt.rng",
    "Tier": "tierio.ckpt.tier", "StripeOptions": "tierio.io.lustre",
    "Preemption": "tierio.ckpt.preempt", "PreemptOptions": "tierio.ckpt.preempt",
    "spread": "tierio.ckpt.replicated",
    "TensorSlice": "tierio.format.slices",
}

__all__ = [
    "CheckpointManager", "CheckpointOptions", "SaveHandle", "Tier", "StripeOptions", "TensorSlice", "delete_step",
    "Retention", "KeepLast", "KeepEvery", "KeepWithin", "KeepAll", "AnyOf", "AllOf", "parse_retention", "gc_plan",
    "VerifyReport", "Problem", "CheckpointInfo",
    "list_checkpoints", "inspect", "verify", "promote", "gc", "unlock",
    "rng_state", "set_rng_state",
    "Preemption", "PreemptOptions", "spread",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from tierio.ckpt.manager import CheckpointManager, SaveHandle
    from tierio.ckpt.ops import CheckpointInfo, gc, inspect, list_checkpoints, promote, unlock, verify
    from tierio.ckpt.options import CheckpointOptions
    from tierio.ckpt.preempt import PreemptOptions, Preemption
    from tierio.ckpt.replicated import spread
    from tierio.ckpt.rng import rng_state, set_rng_state
    from tierio.ckpt.steps.gc import delete_step
    from tierio.ckpt.steps.reader import Problem, VerifyReport
    from tierio.ckpt.steps.retention import (
        AllOf, AnyOf, KeepAll, KeepEvery, KeepLast, KeepWithin, Retention, gc_plan, parse_retention,
    )
    from tierio.ckpt.tier import Tier
    from tierio.io.lustre import StripeOptions
    from tierio.format.slices import TensorSlice
