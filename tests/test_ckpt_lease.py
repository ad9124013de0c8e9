"""Tier leases: one run writes a tier; a second writer gets a clear error naming the holder; stale
leases (dead holder, expired heartbeat) are taken over; ranks of one job share their run's lease."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
import warnings

import pytest
import torch

from tierio.ckpt import CheckpointManager, list_checkpoints, unlock, verify
from tierio.ckpt import lease as lease_mod
from tierio.ckpt.lease import LEASE_KEY, Holder, read_lease
from tierio.cli.main import main
from tierio.errors import LeaseError
from tierio.storage import open_store


def state(step: int, who: str = "a") -> dict:
    g = torch.Generator().manual_seed(step * 7 + len(who))
    return {"w": torch.randn(16 * 1024, generator=g), "step": step, "who": who}


def hold_tier(root: str, ready, stop) -> None:
    """Child: a training job that has saved once and keeps its manager open."""
    with CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
        ready.set()
        stop.wait(300)


def take_and_die(root: str, ready, stop) -> None:
    mgr = CheckpointManager([root])
    mgr.save(1, state(1)).wait()
    ready.set()
    time.sleep(300)  # killed with SIGKILL by the test


def start(target, root: str):
    """Start ``target(root, ready, stop)`` in a fresh process; returns it once ready, and its stop event."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=target, args=(root, ready, stop))
    p.start()
    assert ready.wait(180), "child did not start"
    return p, stop


def test_second_writer_in_another_process_is_refused(tmp_path, capsys):
    root = str(tmp_path / "tier")
    p, stop = start(hold_tier, root)
    try:
        with CheckpointManager([root]) as mgr:
            with pytest.raises(LeaseError, match=rf"pid {p.pid}.*tierio ckpt unlock"):
                mgr.save(1, state(1, "intruder"))  # the same step number: would corrupt the other run's step
            with pytest.raises(LeaseError):
                mgr.save(2, state(2, "intruder"))
            assert mgr.restore(1)["who"] == "a"  # reading needs no lease
        # The command line respects the lease too, and shows it.
        assert main(["ckpt", "gc", root, "--keep", "last:1", "--min-keep", "0"]) == 1
        assert "leased by another writer" in capsys.readouterr().err
        assert main(["ckpt", "unlock", root]) == 1
        assert "looks alive" in capsys.readouterr().err
        assert main(["ckpt", "ls", root, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["lease"]["pid"] == p.pid and doc["lease"]["stale"] is None
        assert [c.step for c in list_checkpoints(root)] == [1] and verify(root, 1).ok
    finally:
        stop.set()
        p.join(60)
    assert read_lease(open_store(root)) is None  # released by close()
    with CheckpointManager([root]) as mgr:  # the tier is free again
        mgr.save(2, state(2, "b")).wait()
        assert mgr.steps() == [1, 2]


def test_lease_of_a_killed_process_is_taken_over(tmp_path, caplog):
    root = str(tmp_path / "tier")
    p, _ = start(take_and_die, root)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert read_lease(open_store(root)).pid == p.pid  # left behind
    with caplog.at_level(logging.WARNING, logger="tierio.ckpt"), CheckpointManager([root]) as mgr:
        mgr.save(2, state(2, "b")).wait()
        assert mgr.stats()["leases"] == {open_store(root).url: "held"}
    assert "no longer running" in caplog.text


def foreign(heartbeat_age: float, world_size: int = 1) -> Holder:
    now = time.time()
    return Holder("otherjob", "node-17", "another-boot/1", 4242, world_size, now - heartbeat_age - 5, now - heartbeat_age)


def test_foreign_lease_refused_until_expired_unlocked_or_broken(tmp_path, capsys, caplog):
    root = tmp_path / "tier"
    store = open_store(root)
    assert store.create_exclusive(LEASE_KEY, foreign(2.0).encode())
    with CheckpointManager([root]) as mgr:
        with pytest.raises(LeaseError, match="run otherjob on host node-17 \\(pid 4242"):
            mgr.save(1, state(1))
    assert main(["ckpt", "unlock", str(root)]) == 1
    assert main(["ckpt", "ls", str(root)]) == 0
    assert "write lease: run otherjob" in capsys.readouterr().err
    with CheckpointManager([root], break_lease=True) as mgr:  # the operator knows node-17 is gone
        mgr.save(1, state(1)).wait()
    # An expired heartbeat (the holder's node died) is taken over without help, with a warning.
    store.delete(LEASE_KEY)
    store.create_exclusive(LEASE_KEY, foreign(lease_mod.EXPIRES + 60).encode())
    with caplog.at_level(logging.WARNING, logger="tierio.ckpt"), CheckpointManager([root]) as mgr:
        mgr.save(2, state(2)).wait()
    assert "last heartbeat is" in caplog.text
    # unlock removes a stale lease, and --force a live-looking one.
    store.create_exclusive(LEASE_KEY, foreign(lease_mod.EXPIRES + 60).encode())
    assert unlock(root).run == "otherjob" and read_lease(store) is None
    store.create_exclusive(LEASE_KEY, foreign(1.0).encode())
    assert main(["ckpt", "unlock", str(root), "--force"]) == 0
    assert read_lease(store) is None


def test_lost_lease_stops_the_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_mod, "HEARTBEAT", 0.05)
    root = tmp_path / "tier"
    with CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
        url = open_store(root).url
        for _ in range(20):
            unlock(root, force=True)  # an operator broke the lease and another job took the tier
            lease_mod.acquire(open_store(root), foreign(0.0))
            # A renewal that read the lease just before the takeover writes it back over the new
            # holder's (read-then-write, no compare-and-swap); then the other job is the one that
            # finds its lease taken. Take the tier again until this manager is the one that lost.
            for _ in range(2000):
                if mgr.stats()["leases"][url].startswith("lost") or read_lease(open_store(root)).run != "otherjob":
                    break
                time.sleep(0.01)
            if mgr.stats()["leases"][url].startswith("lost"):
                break
        with pytest.raises(LeaseError, match="taken over"):
            mgr.save(2, state(2))
    assert read_lease(open_store(root)).run == "otherjob"  # close() left the new holder's lease alone


def rank_job(rank: int, root: str, ready) -> None:
    """Two ranks with explicit rank/world_size and no process group: rank 1 joins rank 0's run."""
    with CheckpointManager([root], rank=rank, world_size=2, commit_timeout=120) as mgr:
        mgr.save(5, state(5, f"rank{rank}")).wait()
        assert mgr.stats()["leases"] == {open_store(root).url: "held" if rank == 0 else "joined"}
    ready.set()


def test_ranks_of_one_job_share_the_lease(tmp_path):
    root = str(tmp_path / "tier")
    ctx = mp.get_context("spawn")
    done = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=rank_job, args=(r, root, done[r])) for r in (1, 0)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert all(e.is_set() for e in done) and all(p.exitcode == 0 for p in procs)
    info = list_checkpoints(root)
    assert [c.step for c in info] == [5] and verify(root, 5).ok
    names = sorted(os.listdir(tmp_path / "tier" / "step_000000005"))
    assert names == ["manifest.json", "rank_00000.safetensors", "rank_00001.safetensors"]


def test_s3_tier_lease(tmp_path, s3_url):
    with CheckpointManager([tmp_path / "a", s3_url]) as first:
        first.save(1, state(1)).wait()
        assert read_lease(open_store(s3_url)).run == first.run_id
        with CheckpointManager([tmp_path / "b", s3_url]) as second:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                h = second.save(2, state(2, "b"))
                h.persisted.result(timeout=120)  # its own tier 0 is fine
                assert isinstance(h.promoted.exception(timeout=120), LeaseError)
            assert second.stats()["pending_promotions"] == [2]
        assert [c.step for c in list_checkpoints(s3_url)] == [1]
    assert read_lease(open_store(s3_url)) is None
