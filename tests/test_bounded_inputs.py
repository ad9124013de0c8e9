"""Sizes a peer or a file declares are checked before anything is allocated or read: a manifest
that a rank waits for (``await_commit``) and a buddy copy's header from another rank (real gloo
processes)."""

from __future__ import annotations

import os
import tracemalloc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierio.ckpt.promotion.buddy import Link, Pairing, parcel_room, transfer
from tierio.ckpt.steps.commit import Waiting, await_commit
from tierio.errors import FormatError, StorageError
from tierio.format.manifest import MAX_MANIFEST_BYTES, RankEntry
from tierio.format.shard import manifest_key
from tierio.storage import LocalStore


def test_await_commit_refuses_an_oversized_manifest_from_its_stat_without_reading_it(tmp_path):
    """Before: each look read the whole manifest (here 64 MiB, any size a writer of the tier chose)
    into memory, and only then did the parser's size limit refuse it."""
    store = LocalStore(tmp_path)
    path = tmp_path / manifest_key(3)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
    mine = RankEntry(1, "rank_00001.safetensors", 0, {}, {})
    tracemalloc.start()
    try:
        with pytest.raises(StorageError, match=f"timed out.*above the {MAX_MANIFEST_BYTES}-byte limit"):
            await_commit(store, 3, mine, None, Waiting(0.3, 0.02, 0.05))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated while waiting"


HOSTILE_SHARD = 1 << 40  # a TiB: more than this host's memory and the test tier's free space


def hostile_worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        if rank == 1:  # the peer: a header declaring a huge shard, and no bytes after it
            dist.send(torch.tensor([5, 20, 100, HOSTILE_SHARD], dtype=torch.int64), 0)
        else:
            store = LocalStore(root)
            assert parcel_room(store) < HOSTILE_SHARD
            link = Link(dist.group.WORLD, Pairing(2, 1, 1, "node1"), None)
            try:
                transfer(link, [], 1, parcel_room(store))
            except FormatError as exc:  # before: torch.empty(1 TiB) failed untyped, or waited for the bytes
                assert "buddy rank 1 declared a copy of step 5" in str(exc) and "refused before allocating" in str(exc)
            else:
                raise AssertionError("a 1 TiB buddy copy was accepted")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_buddy_header_declaring_more_than_this_rank_can_hold_is_refused_before_allocating(tmp_path):
    root = str(tmp_path)
    os.makedirs(f"{root}/tier0")
    tmp.start_processes(hostile_worker, args=(f"{root}/tier0", f"file://{root}/pg"), nprocs=2, start_method="spawn")


def test_parcel_room_is_bounded_by_memory_and_the_tier_free_space(tmp_path):
    store = LocalStore(tmp_path)
    total, free = store.capacity()
    assert 0 < parcel_room(store) <= free
    assert parcel_room(store) <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
