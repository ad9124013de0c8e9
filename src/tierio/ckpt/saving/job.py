"""The parts of a save: its completion handles, what a rank writes, the staged shard, the checks
before it (tier layout, free space) and the copy into staging memory."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tierio.errors import ConfigError, DiskFullError
from tierio.format.shard import Placement, ShardBytes, ShardLayout
from tierio.format.statetree import FlatState
from tierio.io.buffers import HostBuffer
from tierio.units import human_bytes
from tierio.handle import Handle

from tierio.ckpt.steps.lineage import Rollback
from tierio.ckpt.tier import Tier, TierState

if TYPE_CHECKING:
    from tierio.ckpt.saving.overlap import Snapshot

CAPACITY_WARN = 0.80


@dataclass
class SaveHandle(Handle[None]):
    """Completion handles of one save: ``staged`` (state copied, the caller may go on),
    ``persisted`` (this rank's shard durable on tier 0, and the step committed there when tier 0
    is shared), ``committed`` (the step's manifest on its first shared tier: globally committed),
    ``promoted`` (every slower tier committed); ``buddied`` (with ``buddy=True``: this rank's part
    sent to its partner node and its source's copy kept; with nothing to send, done at once).

    An overlapped save (``overlap=True``) commits only after its snapshot's verdict: its
    ``persisted`` and what follows complete after the next update begins (``before_update``, the
    attached optimizer's step), the next ``save`` or a wait (``wait()`` here gives the verdict)."""

    step: int
    staged: Future = field(default_factory=Future)
    persisted: Future = field(default_factory=Future)
    committed: Future = field(default_factory=Future)
    promoted: Future = field(default_factory=Future)
    buddied: Future = field(default_factory=Future)  # buddy=True: the exchange with the partner node done
    blocking_seconds: float = 0.0  # time save() held the caller, waiting included
    wait_seconds: float = 0.0  # part of it spent waiting for the previous persist
    bytes: int = 0
    # An overlapped save's: gives the open snapshots their verdict (in the caller's thread) before a wait.
    settle: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every stage; raises the first failure (of an overlapped save: a changed
        snapshot of any save not judged yet)."""
        if self.settle is not None:
            self.settle()
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in (self.staged, self.persisted, self.committed, self.promoted):
            f.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def done(self) -> bool:
        return self.promoted.done() and self.persisted.done() and self.committed.done()

    def fail(self, exc: BaseException) -> None:
        for f in (self.persisted, self.committed, self.promoted):
            if not f.done():
                f.set_exception(exc)


@dataclass
class Staged:
    """A shard on its way to tier 0: staged in ``buf`` (a save), or written straight from the
    tensors in ``direct`` (a synchronous DCP save, whose tensors do not change meanwhile)."""

    layout: ShardLayout
    tree: Any
    places: dict[str, Placement]
    buf: HostBuffer | None
    rollback: Rollback | None
    direct: ShardBytes | None = None
    snapshot: Snapshot | None = None  # an overlapped save: its tensors still being copied
    reason: str | None = None  # why it was saved, recorded in the manifest (an emergency save's signal)

    def parts(self) -> tuple[list[memoryview], memoryview | ShardBytes]:
        """What to write, and the bytes to checksum."""
        if self.direct is not None:
            return self.direct.parts, self.direct
        assert self.buf is not None
        view = self.buf.view[: self.layout.total_bytes]
        return [view], view


def check_tiers(tiers: list[Tier]) -> None:
    """Node-local tiers come first, and a shared tier after them (where steps are committed)."""
    if any(t.node_local for t in tiers):
        first_shared = next((i for i, t in enumerate(tiers) if not t.node_local), None)
        if first_shared is None:
            raise ConfigError("a node-local tier needs a shared tier after it (a shared filesystem or an object "
                              "store): a step is committed there once every node's ranks have written their shards")
        if any(t.node_local for t in tiers[first_shared:]):
            raise ConfigError("node-local tiers must come before every shared tier (fastest first)")


def to_write(flat: FlatState) -> tuple[dict[str, torch.Tensor], dict[str, Placement]]:
    """The tensors this rank writes (its own, and the slices of global tensors it owns) and where
    each global slice lies."""
    tensors = dict(flat.tensors)
    places: dict[str, Placement] = {}
    for name, leaf in flat.globals.items():
        if leaf.write:
            tensors[name] = leaf.local
            places[name] = Placement(leaf.box.offsets, leaf.shape)
    return tensors, places


def check_space(ts: TierState, need: int, step: int, rank: int) -> None:
    """Refuse a save tier 0 cannot hold (DiskFullError, nothing written); warn past 80 % full."""
    cap = ts.store.capacity()
    if cap is None:
        return
    total, free = cap
    if free < need + (1 << 20):
        raise DiskFullError(
            f"tier 0 ({ts.url}) has {human_bytes(free)} free but step {step} needs {human_bytes(need)} on rank "
            f"{rank}: free space, keep fewer checkpoints there (retention) or point the tier elsewhere; "
            "earlier checkpoints are intact"
        )
    used = (total - free + need) / total if total else 0.0
    if used >= CAPACITY_WARN and not ts.warned_capacity:
        ts.warned_capacity = True
        warnings.warn(f"{ts.url} will be {used:.0%} full after step {step}; tighten retention or add space", stacklevel=4)
    elif used < CAPACITY_WARN:
        ts.warned_capacity = False
