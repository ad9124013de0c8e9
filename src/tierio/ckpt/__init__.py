"""Asynchronous, tiered, verified checkpoints (see docs/checkpoints.md)."""

from tierio.ckpt.steps.gc import delete_step
from tierio.ckpt.manager import CheckpointManager, SaveHandle
from tierio.ckpt.options import CheckpointOptions
from tierio.ckpt.ops import CheckpointInfo, gc, inspect, list_checkpoints, promote, unlock, verify
from tierio.ckpt.steps.reader import Problem, VerifyReport
from tierio.ckpt.steps.retention import AllOf, AnyOf, KeepAll, KeepEvery, KeepLast, KeepWithin, Retention, gc_plan, parse_retention
from tierio.ckpt.rng import rng_state, set_rng_state
from tierio.ckpt.tier import Tier
from tierio.format.slices import TensorSlice

__all__ = [
    "CheckpointManager", "CheckpointOptions", "SaveHandle", "Tier", "TensorSlice", "delete_step",
    "Retention", "KeepLast", "KeepEvery", "KeepWithin", "KeepAll", "AnyOf", "AllOf", "parse_retention", "gc_plan",
    "VerifyReport", "Problem", "CheckpointInfo",
    "list_checkpoints", "inspect", "verify", "promote", "gc", "unlock",
    "rng_state", "set_rng_state",
]
