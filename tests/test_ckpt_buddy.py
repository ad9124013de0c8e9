"""Buddy copies with real gloo processes: two "nodes" of two ranks, each node with its own tier-0
directory, a shared tier whose promotion is held back. A node's tier 0 is lost after a step is
saved and before it reaches the shared tier: its ranks restore it bit-exact from the partner
node's copy. A corrupt buddy copy is refused, naming the rank, and the job falls back to the
newest step every rank can restore."""

from __future__ import annotations

import logging
import os
import shutil
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierio.ckpt import CheckpointManager, KeepLast, Tier, list_checkpoints
from tierio.ckpt.promotion.buddy import pair
from tierio.errors import ConfigError

SMALL, LARGE = 64, 512  # rows of 1024 float32: step 1 fits promotion's burst, step 2 does not


def state(rank: int, step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{step}".encode()))
    return {"w": torch.randn(rows, 1024, generator=g), "b": torch.arange(rank + step, dtype=torch.int64),
            "rank": rank, "step": step}


def same(got: dict, want: dict) -> bool:
    return got["rank"] == want["rank"] and got["step"] == want["step"] and torch.equal(got["w"], want["w"]) \
        and torch.equal(got["b"], want["b"])


def manager(root: str, rank: int, **kw) -> CheckpointManager:
    return CheckpointManager([Tier(f"{root}/node{rank // 2}", KeepLast(2), scope="node"), Tier(f"{root}/shared")],
                             node=f"node{rank // 2}", buddy=True, commit_timeout=60, **kw)


def save_worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    # The shared tier is slow: 1 KB/s after a 1 MiB burst, so step 2 does not reach it for minutes.
    mgr = manager(root, rank, promote_bandwidth=1000, buddy_bandwidth=0)
    h = mgr.save(1, state(rank, 1, SMALL))
    h.wait(timeout=60)
    assert h.buddied.result(timeout=60) == 1  # this rank keeps its source's copy of step 1
    dist.barrier()
    if rank >= 2:
        dist.barrier()  # node 1 saves step 2 only once node 0's save of it has returned
    h = mgr.save(2, state(rank, 2, LARGE))
    if rank < 2:
        h.persisted.result(timeout=60)
        # the buddy exchange waits for the partner node, which has not saved step 2: save did not
        assert not h.buddied.done()
        dist.barrier()
    assert h.buddied.result(timeout=60) == 2
    assert not h.committed.done()  # step 2 is on the nodes' tier 0 and their buddies, not on the shared tier
    dist.barrier()
    os._exit(0)  # the job dies here, before step 2 is promoted


class Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def restore_worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        with manager(root, rank) as mgr:
            out = mgr.restore()
            assert mgr.restored_step == 2 and same(out, state(rank, 2, LARGE))
            assert mgr.restored_from.endswith(f"/node{rank // 2}")  # node 1's ranks: their copies written back
        dist.barrier()
        # the restored step is published as the manager closes: committed on the shared tier now
        assert [c.step for c in list_checkpoints(f"{root}/shared")] == [1, 2]
        dist.barrier()
        if rank == 0:  # step 2 only on the nodes again; node 1 is lost again; node 0's copy of rank 2's shard is corrupt
            shutil.rmtree(f"{root}/shared/step_000000002")
            shutil.rmtree(f"{root}/node1")
            with open(f"{root}/node0/buddy/node1/step_000000002/rank_00002.safetensors", "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
        dist.barrier()
        log = Log()
        logging.getLogger("tierio.ckpt").addHandler(log)
        with manager(root, rank) as mgr:
            with pytest.warns(UserWarning, match="falling back to an older step"):
                out = mgr.restore()
            assert mgr.restored_step == 1 and same(out, state(rank, 1, SMALL))
            refused = [line for line in log.lines if "rank 2's step 2" in line and "checksum mismatch" in line]
            assert refused, log.lines
            # saving after the restore abandons step 2: its buddy copies go with it (the rollback rule)
            h = mgr.save(3, state(rank, 3, SMALL))
            assert h.buddied.result(timeout=60) == 3
            h.wait(timeout=60)
            groups = len(dist.distributed_c10d._world.pg_map)
        # the manager's own buddy group is destroyed with it (its gloo threads would live to exit)
        assert len(dist.distributed_c10d._world.pg_map) == groups - 1
        dist.barrier()
        assert not os.path.exists(f"{root}/node{rank // 2}/buddy/node{1 - rank // 2}/step_000000002")
        assert os.path.exists(f"{root}/node{rank // 2}/buddy/node{1 - rank // 2}/step_000000003")
    finally:
        dist.destroy_process_group()


def test_lost_node_restores_from_its_buddy_and_a_corrupt_copy_is_refused(tmp_path):
    root = str(tmp_path)
    tmp.start_processes(save_worker, args=(root, f"file://{root}/pg1"), nprocs=4, start_method="spawn")
    assert [c.step for c in list_checkpoints(tmp_path / "shared")] == [1]
    for node, other in (("node0", "node1"), ("node1", "node0")):
        held = tmp_path / node / "buddy" / other / "step_000000002"
        assert sorted(n for n in os.listdir(held) if n.endswith(".safetensors")) == \
            (["rank_00002.safetensors", "rank_00003.safetensors"] if node == "node0" else
             ["rank_00000.safetensors", "rank_00001.safetensors"])
    shutil.rmtree(tmp_path / "node1")  # node 1's disk is gone; its replacement starts empty
    tmp.start_processes(restore_worker, args=(root, f"file://{root}/pg2"), nprocs=4, start_method="spawn")


def ring_worker(rank: int, root: str, init: str, phase: str) -> None:
    """Three nodes of one rank: node i keeps node i-1's copies, so partner and source differ."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3)
    tiers = [Tier(f"{root}/node{rank}", scope="node"), Tier(f"{root}/shared")]
    if phase == "save":
        mgr = CheckpointManager(tiers, node=f"node{rank}", buddy=True, commit_timeout=60, promote_bandwidth=1000,
                                buddy_bandwidth=0)
        h = mgr.save(7, state(rank, 7, LARGE))
        assert h.buddied.result(timeout=60) == 7
        assert not h.committed.done()
        dist.barrier()
        os._exit(0)  # nothing reached the shared tier
    try:
        with CheckpointManager(tiers, node=f"node{rank}", buddy=True, commit_timeout=60) as mgr:
            assert mgr.steps() == []  # the shared tier has nothing
            out = mgr.restore()
            assert mgr.restored_step == 7 and same(out, state(rank, 7, LARGE))
    finally:
        dist.destroy_process_group()


def test_three_nodes_in_a_ring_restore_a_lost_node_from_the_next_one(tmp_path):
    root = str(tmp_path)
    tmp.start_processes(ring_worker, args=(root, f"file://{root}/pg1", "save"), nprocs=3, start_method="spawn")
    for n in range(3):  # node n keeps node n-1's copy
        assert os.listdir(tmp_path / f"node{n}" / "buddy") == [f"node{(n - 1) % 3}"]
    shutil.rmtree(tmp_path / "node1")  # its copy is on node 2
    tmp.start_processes(ring_worker, args=(root, f"file://{root}/pg2", "restore"), nprocs=3, start_method="spawn")
    assert (tmp_path / "node1" / "step_000000007" / "rank_00001.safetensors").exists()  # written back


def test_pairing_is_node_to_next_node_by_local_index():
    names = ["a", "a", "b", "b", "c", "c"]
    p = pair(names, 3)
    assert (p.nodes, p.partner, p.source, p.source_node) == (3, 5, 1, "a")
    p = pair(names, 4)
    assert (p.partner, p.source, p.source_node) == (0, 2, "b")
    assert not pair(["x", "x"], 1).active  # one node: nothing to pair
    with pytest.raises(ConfigError, match="same number of ranks"):
        pair(["a", "a", "b"], 0)
    with pytest.raises(ConfigError, match="cannot name a directory"):
        pair(["../up", "b"], 1)


def test_buddy_needs_a_node_local_tier0(tmp_path):
    with pytest.raises(ConfigError, match="node-local tier 0"):
        CheckpointManager([tmp_path / "a", tmp_path / "b"], buddy=True)
    with pytest.raises(ConfigError, match="cannot be combined"):
        CheckpointManager([Tier(str(tmp_path / "a"), scope="node"), tmp_path / "b"], buddy=True, incremental=True)


def test_one_node_makes_no_copies(tmp_path, caplog):
    """buddy=True on one node: a log line says so, and saves go on as without it."""
    with caplog.at_level(logging.INFO, logger="tierio.ckpt"):
        with CheckpointManager([Tier(tmp_path / "nvme", scope="node"), tmp_path / "shared"], buddy=True) as mgr:
            h = mgr.save(1, state(0, 1, 4))
            h.wait(timeout=60)
            assert h.buddied.result(timeout=60) is None
    assert any("buddy copies are off" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "nvme" / "buddy").exists()


def _saved_part(tmp_path) -> tuple:
    """Rank 0's record and shard of step 1 as a one-rank save with a node-local tier 0 left them."""
    from tierio.ckpt.promotion.buddy import read_parcel
    from tierio.storage import open_store

    with CheckpointManager([Tier(tmp_path / "nvme", scope="node"), tmp_path / "shared"]) as mgr:
        mgr.save(1, state(0, 1, 8)).wait(timeout=60)
    store = open_store(str(tmp_path / "nvme"))
    rec = next(p for p in os.listdir(tmp_path / "nvme" / "step_000000001") if p.endswith(".json"))
    return store, read_parcel(store, 1, f"step_000000001/{rec}", "step_000000001/rank_00000.safetensors")


def test_a_copy_is_checked_against_its_record_before_it_is_kept(tmp_path):
    from dataclasses import replace

    from tierio.ckpt.promotion.buddy import check_parcel
    from tierio.errors import FormatError, IntegrityError

    _, parcel = _saved_part(tmp_path)
    assert check_parcel(parcel, 0, 1, "copy").file == "rank_00000.safetensors"
    bad = parcel.shard.clone()
    bad[-1] ^= 0xFF
    with pytest.raises(IntegrityError, match="checksum mismatch in copy, tensor 'w'"):
        check_parcel(replace(parcel, shard=bad), 0, 1, "copy")
    with pytest.raises(IntegrityError, match="bytes, its record says"):
        check_parcel(replace(parcel, shard=parcel.shard[:-1]), 0, 1, "copy")
    with pytest.raises(FormatError, match="not a record of rank 1"):
        check_parcel(parcel, 1, 1, "copy")  # another rank's copy
    with pytest.raises(IntegrityError, match="does not match its name"):
        check_parcel(replace(parcel, record=parcel.record.replace(b'"step":1', b'"step":2')), 0, 1, "copy")
    with pytest.raises(FormatError, match="world size"):
        check_parcel(parcel, 0, 2, "copy")  # saved by another world size


def test_a_step_is_restorable_from_node_copies_only_when_every_rank_has_a_part(tmp_path):
    from tierio.ckpt.promotion.buddy_restore import Part, plan_steps

    def own(r: int, step: int, token: str = "aa") -> Part:
        return Part(r, step, token, f"step_{step:09d}/rank_{r:05d}.{token}.{'0' * 16}.json", r)

    def held(r: int, step: int, holder: int, token: str = "aa") -> Part:
        return Part(r, step, token, f"buddy/n/step_{step:09d}/rank_{r:05d}.{token}.{'0' * 16}.json", holder)

    found = [[own(0, 5), own(0, 6), held(1, 5, 0), held(1, 6, 0)],  # rank 1's node was lost
             [],
             [own(2, 5), own(2, 6, token="bb"), held(0, 5, 2)]]
    plans = plan_steps(found, 3)
    # step 6: rank 2's part is of another run (token), so no complete set
    assert sorted(plans) == [5]
    assert plans[5].fetches() == {1: held(1, 5, 0)}  # own copies win over held ones
    assert plans[5].parts[0] == own(0, 5)
    assert plan_steps(found, 4) == {}  # rank 3 has no part anywhere


def refused_worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    tiers = [Tier(f"{root}/tmpfs" if rank == 0 else f"{root}/node1", scope="node"), Tier(f"{root}/shared")]
    mgr = CheckpointManager(tiers, node=f"node{rank}", buddy=True, commit_timeout=60)
    if rank == 0:  # node 0's disk is too small for this step: save refuses it at once
        from tierio.errors import DiskFullError

        with pytest.raises(DiskFullError):
            mgr.save(1, state(0, 1, 17 * 1024))  # 68 MiB on a 64 MiB tmpfs
    else:
        h = mgr.save(1, state(1, 1, SMALL))
        assert h.buddied.result(timeout=60) is None  # node 0 had nothing to send, and said so
    h = mgr.save(2, state(rank, 2, SMALL))
    assert h.buddied.result(timeout=60) == 2  # the exchanges stay in step
    dist.barrier()
    os._exit(0)


def test_a_refused_save_does_not_leave_the_partner_waiting(tmp_path, small_tmpfs):
    root = str(tmp_path)
    tmp.start_processes(refused_worker, args=(root, f"file://{root}/pg"), nprocs=2, start_method="spawn")
    assert os.listdir(tmp_path / "node1" / "buddy" / "node0") == ["step_000000002"]

