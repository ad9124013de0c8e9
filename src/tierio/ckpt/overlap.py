"""Zero-stall snapshots (``CheckpointOptions(overlap=True)``): ``save`` returns before the staging
copy of the large tensors is done; a copy thread takes it (device tensors on the side CUDA stream)
while the forward and backward passes run, and the next update waits only for what is not copied.

Why it is sound: parameters and optimizer state change only in the optimizer step; forward and
backward only read them. The promise the caller makes is therefore: *a tensor handed to an
overlapped save is not changed in place before the next update begins*, where the update begins
at the optimizer step pre-hook (``CheckpointManager.attach(optimizer)``) or an explicit
``before_update()``, which wait for the copies.

How a broken promise is caught: every in-place torch operation bumps a tensor's version counter.
The counters of the tensors copied behind are read in ``save`` and again after their copy; a change
means the copy may mix two states, so that save fails with ``SnapshotChangedError`` and is never
written (the previous checkpoint stays the latest). A change seen only at the update (after the
copy ended) left the checkpoint consistent, but would not have with a slower copy: a warning.
Writes that bypass torch (through ``.data`` or a numpy view) do not bump the counter and are not
seen: they break the promise silently.

Small tensors (step counters, RNG states, scheduler values) and every non-tensor value are
captured in ``save`` itself.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio.ckpt.saving import Stager
from tierio.errors import SnapshotChangedError
from tierio.format.shard import ShardLayout
from tierio.io.buffers import HostBuffer

SYNC_BYTES = 64 << 10  # host tensors up to this size are copied in save() itself


@dataclass
class Snapshot:
    """The part of one overlapped save still being copied: its tensors (held until the update),
    their version counters when ``save`` returned, and the copy's completion."""

    step: int
    tensors: dict[str, torch.Tensor]
    versions: dict[str, int]
    copied: Future = field(default_factory=Future)
    reported: bool = False  # its failure reached the caller through before_update()


def changed(snap: Snapshot) -> list[str]:
    """The tensors of ``snap`` changed in place since ``save`` (their version counter moved)."""
    return sorted(n for n, t in snap.tensors.items() if t._version != snap.versions[n])


def copy_behind(stager: Stager, layout: ShardLayout, snap: Snapshot, buf: HostBuffer, after: Any) -> None:
    """The copy thread's work for one save: stage the large tensors, then check none moved."""
    stager.stage(layout, snap.tensors, buf, names=set(snap.tensors), header=False, after=after)
    moved = changed(snap)
    if moved:
        raise SnapshotChangedError(
            f"step {snap.step}: {_names(moved)} changed in place before the checkpoint's copy of it was taken; with "
            "overlap=True, saved tensors must not change until the next update (attach the optimizer with "
            "mgr.attach(optimizer), or call mgr.before_update() before changing them). This step is not written; "
            "the previous checkpoint is intact", moved)


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return f"tensor{'s' if len(names) > 1 else ''} {shown}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")


@dataclass
class Waited:
    """What ``before_update`` found: per step the seconds it waited, and the failed copies."""

    seconds: dict[int, float] = field(default_factory=dict)
    failed: list[tuple[Snapshot, BaseException]] = field(default_factory=list)


class Overlap:
    """The copy thread of one manager and the snapshots the next update must wait for."""

    def __init__(self, stager: Stager) -> None:
        self._stager = stager
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-copy")
        self._lock = threading.Lock()
        self._open: list[Snapshot] = []

    def start(self, step: int, layout: ShardLayout, tensors: dict[str, torch.Tensor], buf: HostBuffer) -> Snapshot:
        """Stage the header and the small host tensors now; the rest on the copy thread."""
        behind = {n for n, t in tensors.items() if t.is_cuda or t.numel() * t.element_size() > SYNC_BYTES}
        self._stager.stage(layout, tensors, buf, names=set(tensors) - behind)
        big = {n: tensors[n] for n in behind}
        snap = Snapshot(step, big, {n: t._version for n, t in big.items()})
        after = None
        if any(t.is_cuda for t in big.values()) and torch.cuda.is_available():
            # The copy thread's stream must start after what this thread queued (unverified here:
            # no device on the machines these tests run on).
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream())
        with self._lock:
            # Copies that ended need no wait at the update (a failed one reaches the caller through
            # its persist, which fails with it: the manager's next save/wait raises it).
            self._open = [s for s in self._open if not s.copied.done()]
            snap.copied = self._pool.submit(copy_behind, self._stager, layout, snap, buf, after)
            self._open.append(snap)
        return snap

    def before_update(self) -> Waited:
        """Wait for every copy not waited for yet; a tensor changed after its copy is a warning."""
        with self._lock:
            snaps, self._open = self._open, []
        out = Waited()
        for snap in snaps:
            t0 = time.perf_counter()
            exc = snap.copied.exception()
            out.seconds[snap.step] = time.perf_counter() - t0
            if exc is not None:
                out.failed.append((snap, exc))
                continue
            moved = changed(snap)
            if moved:
                warnings.warn(
                    f"step {snap.step}: {_names(moved)} changed in place before the update; the copy was already "
                    "taken, so the checkpoint is consistent, but with overlap=True saved tensors must not change "
                    "before the next update (a slower copy would have failed the save)", stacklevel=3)
            snap.tensors.clear()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            self._open = []
