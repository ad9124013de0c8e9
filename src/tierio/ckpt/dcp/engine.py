"""The manager's engine driven by DCP, in DCP's thread: write a rank's part now, commit on the
coordinator, track the commit and promotion behind like a save's."""

from __future__ import annotations

from typing import Any

import torch

from tierio.format.shard import Placement

from tierio.ckpt.manager import CheckpointManager
from tierio.ckpt.promotion.cluster import Own
from tierio.ckpt.promotion.copy import copy_shard
from tierio.ckpt.saving.job import SaveHandle
from tierio.ckpt.steps.commit import CommitPlan, await_commit, build_manifest, commit, write_record
from tierio.ckpt.steps.lineage import Lineage
from tierio.ckpt.tier import commit_tier


# DCP blocks while it saves and commits on its coordinator: these three calls drive the manager's
# persister, promoter and step book directly, in DCP's thread, instead of through ``save``.

def write_now(mgr: CheckpointManager, step: int, tensors: dict[str, torch.Tensor], places: dict[str, Placement]) -> Own:
    """Write this rank's shard and record of ``step`` now, in this thread, and when tier 0 is
    node-local copy them to the first shared tier too (``write_data``). ``places`` places the
    global tensors' slices; the step is committed by ``commit_now``."""
    mgr._check_open()
    persister, book, tiers, cluster = mgr._persister, mgr._book, mgr._tiers, mgr._cluster
    rollback = persister.check(step)
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
        job = persister.stage_direct(step, tensors, places, rollback)  # DCP blocks: no copy first
    else:
        job = persister.stage(step, tensors, places, None, rollback, SaveHandle(step))
    own: Own | None = None
    try:
        own, lineage = persister.write(step, job, True)
        if tiers[0].node_local:
            shared = commit_tier(tiers)
            cluster.ensure(shared)
            book.account(shared, copy_shard(tiers[0].store, shared.store, step, own.entry, cluster.pool,
                                            cluster.limiter))
            write_record(shared.store, step, mgr.world_size, own.entry, lineage.token)
    except BaseException:
        persister.cleanup_failed(step, own)
        book.end(step)
        raise
    return own


def commit_now(mgr: CheckpointManager, step: int, parts: dict[int, Own], tree: Any, reason: str | None = None) -> None:
    """Commit ``step`` from every rank's part, with one job-wide state ``tree`` (``finish``, on the
    coordinator); ``reason`` as ``CheckpointManager.save``'s."""
    store = commit_tier(mgr._tiers).store
    rollback = mgr._book.rollback()
    lineage = Lineage(mgr._cluster.run(), rollback.after if rollback is not None else None, reason)
    plan = CommitPlan(step, mgr.world_size, {r: p.record for r, p in parts.items() if p.record is not None},
                      {r: p.entry.bytes for r, p in parts.items()}, lineage.extra(),
                      {r: p.entry for r, p in parts.items()}, tree, mgr.options.inline_record_bytes)
    commit(store, build_manifest(store, plan), [p.record.name for p in parts.values() if p.record is not None],
           mgr._cluster.fence(store))


def track(mgr: CheckpointManager, step: int, own: Own) -> SaveHandle:
    """After ``write_now``: wait for the commit of ``step`` and promote this rank's part of it, in
    the background, like a save's."""
    book, promoter = mgr._book, mgr._promoter
    handle = SaveHandle(step, bytes=own.entry.bytes)
    handle.staged.set_result(step)
    handle.persisted.set_result(step)
    book.add(handle, log=False)

    def run() -> None:
        try:
            await_commit(commit_tier(mgr._tiers).store, step, own.entry, own.record, mgr._cluster.wait)
            handle.committed.set_result(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            book.end(step)
            handle.fail(exc)
            return
        if len(mgr._tiers) > 1:
            promoter.run([step], handle, False)
        else:
            promoter.done(step, handle)
    promoter.submit(run)
    return handle
