"""Zero-stall snapshots (``CheckpointOptions(overlap=True)``): ``save`` returns before the staging
copy of the large tensors is done; a copy thread takes it (device tensors on the side CUDA stream)
while the forward and backward passes run, and the next update waits only for what is not copied.

Why it is sound: parameters and optimizer state change only in the optimizer step; forward and
backward only read them. The promise the caller makes is therefore: *a tensor handed to an
overlapped save is not changed in place before the next update begins*, where the update begins
at the optimizer step pre-hook (``CheckpointManager.attach(optimizer)``) or an explicit
``before_update()``, which wait for the copies.

How a broken promise is caught: every in-place torch operation bumps a tensor's version counter,
but only after its kernel has written the data (a CPU op) or once it is queued (a CUDA op). The
copy thread therefore cannot tell a change that raced its copy from none: only the thread that
changes the tensors can. That thread is the one that calls ``save``, ``before_update`` (the
optimizer pre-hook) and the waits, so when it makes one of those calls, every in-place op it
issued has bumped its counter. An overlapped step is written to tier 0 as usual, but its record
and manifest (the commit) wait for the snapshot's *verdict*, given by that thread at the next
``before_update()``, ``save()`` (for a copy already done), ``wait()``, ``SaveHandle.wait()`` or
``close()``: the counters unchanged since ``save`` -> the step commits; any changed -> the step
is not committed (``SnapshotChangedError``, raised there, once; its shard is removed and the
previous checkpoint stays the latest). A change before the update is thus always an error, however
fast the copy was. The copy thread's own check after its copy only fails such a save sooner.
Writes that bypass torch (through ``.data`` or a numpy view) do not bump the counter and are not
seen: they break the promise silently.

Consequence for waiting: ``SaveHandle.persisted`` (and what follows it) of an overlapped save
completes only after its verdict, i.e. after the next update begins or a wait. A process that ends
without any of those calls leaves the step uncommitted (its shard is debris for ``gc``).

Small tensors (step counters, RNG states, scheduler values) and every non-tensor value are
captured in ``save`` itself.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio.errors import SnapshotChangedError
from tierio.format.shard import ShardLayout
from tierio.io.buffers import HostBuffer

from tierio.ckpt.saving.stage import Stager

SYNC_BYTES = 64 << 10  # host tensors up to this size are copied in save() itself


@dataclass(eq=False)
class Snapshot:
    """The part of one overlapped save copied behind: its tensors (held until the verdict), their
    version counters when ``save`` returned, the copy's completion and the verdict."""

    step: int
    tensors: dict[str, torch.Tensor]
    versions: dict[str, int]
    copied: Future = field(default_factory=Future)
    # Given by the caller's thread (Overlap.judge): None commits the step, SnapshotChangedError does not.
    verdict: Future = field(default_factory=Future)
    reported: bool = False  # its failure was raised to the caller by the judging call


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


def changed_error(snap: Snapshot, moved: list[str]) -> SnapshotChangedError:
    """The verdict on a snapshot whose tensors changed after ``save`` and before the next update."""
    return SnapshotChangedError(
        f"step {snap.step}: {_names(moved)} changed in place after save() and before the next update; with "
        "overlap=True the copy of a saved tensor may run until then, so the checkpoint could mix two states. This "
        "step is not committed (not written); the previous checkpoint is intact. Attach the optimizer with "
        "mgr.attach(optimizer), or call mgr.before_update() before changing saved tensors", moved)


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return f"tensor{'s' if len(names) > 1 else ''} {shown}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")


@dataclass
class Waited:
    """What a judgement found: per step the seconds it waited for the copy, and the failed snapshots."""

    seconds: dict[int, float] = field(default_factory=dict)
    failed: list[tuple[Snapshot, BaseException]] = field(default_factory=list)


class Overlap:
    """The copy thread of one manager and the snapshots still waiting for their verdict."""

    def __init__(self, stager: Stager) -> None:
        self._stager = stager
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-copy")
        self._lock = threading.Lock()
        self._open: list[Snapshot] = []  # not judged yet, oldest first

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
            snap.copied = self._pool.submit(copy_behind, self._stager, layout, snap, buf, after)
            self._open.append(snap)
        return snap

    def judge(self, wait_copies: bool = True, report: bool = True) -> Waited:
        """Give the verdict of the open snapshots; call it only from the thread that changes the
        saved tensors (its in-place ops have all bumped their counters by now). With
        ``wait_copies=False`` a snapshot still being copied stays open (the copy may run on past
        this call). ``report``: the caller raises the failures (else the persist reports them)."""
        with self._lock:
            snaps, kept = [], []
            for s in self._open:
                (snaps if wait_copies or s.copied.done() else kept).append(s)
            self._open = kept
        out = Waited()
        for snap in snaps:
            t0 = time.perf_counter()
            exc = snap.copied.exception()
            out.seconds[snap.step] = time.perf_counter() - t0
            if exc is None:
                moved = changed(snap)
                exc = changed_error(snap, moved) if moved else None
            snap.tensors.clear()  # the copy is over: the snapshot no longer holds the caller's tensors
            if exc is None:
                snap.verdict.set_result(None)
                continue
            snap.reported = report  # before the verdict: the persist it releases must see it
            out.failed.append((snap, exc))
            snap.verdict.set_exception(exc)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            self._open = []
