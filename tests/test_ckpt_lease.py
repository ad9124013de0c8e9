"""Tier leases: one run writes a tier; a second writer gets a clear error naming the holder; stale
leases (dead holder, unrenewed for the expiry) are taken over; ranks of one job share their run's
lease. Leases change only by creating the next generation, so the races of two takers, of a paused
holder and of a deposed writer are tested here with real processes on a directory and on S3."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import warnings
from dataclasses import replace

import pytest
import torch

from tierio.ckpt import CheckpointManager, list_checkpoints, unlock, verify
from tierio.ckpt.steps import lease as lease_mod
from tierio.ckpt.steps.commit import put_manifest
from tierio.ckpt.steps.lease import (
    GENERATION_FIELD, LEASE_PREFIX, Holder, LeaseTiming, acquire, check_conditions, generation_key, look, read_lease,
)
from tierio.ckpt.steps.tier_leases import TierLeases
from tierio.cli.main import main
from tierio.errors import ConfigError, FormatError, LeaseError
from tierio.storage import LocalStore, open_store

from faulty_endpoints import Fault, FaultyProxy, via

FAST = "2"  # TIERIO_LEASE_EXPIRES of the children: renewals every 1/6 s, self-fence after 1.5 s


@pytest.fixture(autouse=True)
def fast_leases(monkeypatch):
    monkeypatch.setenv("TIERIO_LEASE_EXPIRES", FAST)


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


def start(target, root: str, *args):
    """Start ``target(root, ready, stop, *args)`` in a fresh process; returns it once ready, and its stop event."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=target, args=(root, ready, stop, *args))
    p.start()
    assert ready.wait(180), "child did not start"
    return p, stop


def steps(url: str) -> list[int]:
    return [c.step for c in list_checkpoints(url)]


def test_second_writer_in_another_process_is_refused(tmp_path, capsys):
    root = str(tmp_path / "tier")
    p, stop = start(hold_tier, root)
    try:
        with CheckpointManager([root]) as mgr:
            # It watches the lease, sees the holder renew it, and refuses: the holder is alive.
            with pytest.raises(LeaseError, match=rf"pid {p.pid}.*renewed its lease.*tierio ckpt unlock"):
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
        assert doc["lease"]["pid"] == p.pid and doc["lease"]["stale"] is None and doc["lease"]["generation"] == 1
        assert steps(root) == [1] and verify(root, 1).ok
    finally:
        stop.set()
        p.join(60)
    assert read_lease(open_store(root)) is None  # released by close()
    with CheckpointManager([root]) as mgr:  # the tier is free again: taken at once
        mgr.save(2, state(2, "b")).wait()
        assert mgr.steps() == [1, 2]
    assert json.loads((tmp_path / "tier" / "step_000000002" / "manifest.json").read_text())["extra"][GENERATION_FIELD] == 3


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


def foreign(renewed_age: float, world_size: int = 1, generation: int = 1) -> Holder:
    now = time.time()
    return Holder("otherjob", "node-17", "another-boot/1", 4242, world_size, generation, "held",
                  now - renewed_age - 5, now - renewed_age)


def plant(store, holder: Holder) -> None:
    assert store.create_exclusive(generation_key(holder.generation), holder.encode())


def test_foreign_lease_is_judged_on_this_clock_never_the_holders(tmp_path, capsys, caplog):
    """A holder on another node whose clock is days ahead looks fresh by its timestamps; one whose
    clock is days behind looks long dead. Neither counts: only whether its lease changes does."""
    root = tmp_path / "tier"
    store = open_store(root)
    plant(store, foreign(-10 * 86400))  # renewed "in ten days": it is dead all the same
    with caplog.at_level(logging.WARNING, logger="tierio.ckpt"), CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
    assert "stayed unchanged for 2 s on this node's clock" in caplog.text
    # A live holder with a clock ten days behind: it renews, so it is never taken over.
    held = foreign(10 * 86400, generation=look(store).generation + 1)
    plant(store, held)
    stop = threading.Event()

    def renewing() -> None:  # the other node's renewals, as lease.renew writes them
        h = held
        while not stop.wait(0.1):
            h = replace(h, beat=h.beat + 1)
            store.put_buffers(generation_key(h.generation), [h.encode()])

    t = threading.Thread(target=renewing, daemon=True)
    t.start()
    try:
        with CheckpointManager([root]) as mgr:
            with pytest.raises(LeaseError, match="run otherjob on host node-17 \\(pid 4242.*renewed its lease"):
                mgr.save(2, state(2))
        assert main(["ckpt", "unlock", str(root)]) == 1
        assert main(["ckpt", "ls", str(root)]) == 0
        assert "write lease: run otherjob" in capsys.readouterr().err
        with CheckpointManager([root], break_lease=True) as mgr:  # the operator knows node-17 is gone
            mgr.save(2, state(2)).wait()
    finally:
        stop.set()
        t.join()
    assert steps(str(root)) == [1, 2]
    # unlock breaks a lease that stays unchanged while it watches, and --force one at once.
    plant(store, foreign(0.0, generation=look(store).generation + 1))
    assert unlock(root).run == "otherjob" and read_lease(store) is None
    plant(store, foreign(0.0, generation=look(store).generation + 1))
    assert main(["ckpt", "unlock", str(root), "--force"]) == 0
    assert read_lease(store) is None


def contend(root: str, run: str, barrier, results) -> None:
    """Child: one job's leader taking a tier's lease the moment every contender is ready."""
    store = open_store(root)
    leases = TierLeases(run, 0, 1)
    barrier.wait(60)
    try:
        leases.ensure(store)
        results.put((run, "held", leases.fence(store)))
        time.sleep(4)  # keep renewing while the others watch
    except LeaseError as exc:
        results.put((run, "refused", str(exc)))
    finally:
        leases.close()


@pytest.mark.parametrize("tier", ["dir", "s3"])
def test_two_takers_of_a_stale_lease_never_both_win(tmp_path, tier, request):
    root = str(tmp_path / "tier") if tier == "dir" else request.getfixturevalue("s3_url")
    store = open_store(root)
    dead = replace(Holder.mine("deadjob", 1), pid=2**22 + 12345)  # on this node, and gone: stale at once
    assert not lease_mod._alive(dead.pid)
    plant(store, replace(dead, generation=1))
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=contend, args=(root, f"job{i}", barrier, results)) for i in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    won = [g for g in got if g[1] == "held"]
    assert len(won) == 1, got
    assert won[0][2] == 2  # the generation after the dead one's
    assert all("renewed its lease" in g[2] for g in got if g[1] == "refused"), got


def paused_holder(root: str, ready, stop, go, results) -> None:
    """Child: holds the tier, is stopped with SIGSTOP by the test, then (continued) tries to go on saving."""
    with CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
        ready.set()
        go.wait(300)  # SIGSTOP lands here; SIGCONT, then the test sets go
        try:
            mgr.save(3, state(3, "deposed")).wait()
            results.put("saved")
        except LeaseError as exc:
            results.put(f"LeaseError: {exc}")
        results.put(mgr.stats()["leases"])
        stop.wait(60)


@pytest.mark.parametrize("tier", ["dir", "s3"])
def test_paused_holder_neither_overwrites_its_successor_nor_commits(tmp_path, tier, request):
    root = str(tmp_path / "tier") if tier == "dir" else request.getfixturevalue("s3_url")
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    p, stop = start(paused_holder, root, go, results)
    os.kill(p.pid, signal.SIGSTOP)  # a GC pause, a frozen node
    try:
        with CheckpointManager([root]) as mgr:  # watches the frozen lease for the expiry, then takes it
            mgr.save(2, state(2, "successor")).wait()
            mine = look(open_store(root))
            os.kill(p.pid, signal.SIGCONT)
            go.set()
            outcome = results.get(timeout=120)
            assert outcome.startswith("LeaseError") and "no longer writes" in outcome, outcome
            assert next(iter(results.get(timeout=60).values())).startswith("lost")
            time.sleep(1.0)  # several of the deposed holder's renewal periods
            assert look(open_store(root)) .generation == mine.generation  # its successor's lease untouched
            assert mgr.stats()["leases"][open_store(root).url] == "held"
            mgr.save(4, state(4, "successor")).wait()
    finally:
        os.kill(p.pid, signal.SIGCONT)
        go.set()
        stop.set()
        p.join(60)
    assert steps(root) == [1, 2, 4]  # the deposed writer's step 3 is never listed


@pytest.mark.parametrize("tier", ["dir", "s3"])
def test_a_commit_racing_a_takeover_is_retracted(tmp_path, tier, request):
    """The writer passes the fence, is deposed before its manifest lands (a pause between the two),
    and finds out in the check after the write: it removes its manifest and raises."""
    root = str(tmp_path / "tier") if tier == "dir" else request.getfixturevalue("s3_url")
    store = open_store(root)
    leases = TierLeases("writer", 0, 1)
    leases.ensure(store)
    calls = []

    def fence() -> int:
        g = leases.fence(store)
        if not calls:  # between the check and the write, another job breaks in
            acquire(store, Holder.mine("breaker", 1), force=True)
        calls.append(g)
        return g

    with pytest.raises(LeaseError, match="taken over"):
        put_manifest(store, 7, b'{"not": "a real manifest"}', fence)
    assert not store.exists("step_000000007/manifest.json")
    leases.close()
    assert read_lease(store).run == "breaker"  # close() left the new holder's lease alone


def test_heartbeat_survives_a_torn_or_hostile_lease_and_marks_it_lost(tmp_path):
    root = tmp_path / "tier"
    with CheckpointManager([root]) as mgr:
        mgr.save(1, state(1)).wait()
        url = open_store(root).url
        # A newer generation that is not even a lease: the tier is no longer provably this run's.
        (root / LEASE_PREFIX / "000000000009.json").write_bytes(b'{"schema": "tierio.lease", "vers')
        for _ in range(200):
            if mgr.stats()["leases"][url].startswith("lost"):
                break
            time.sleep(0.05)
        assert mgr.stats()["leases"][url].startswith("lost: its lease was taken over; it is now held by an unreadable")
        assert mgr._leases._thread.is_alive()  # the renewal thread lives on
        with pytest.raises(LeaseError, match="no longer writes"):
            mgr.save(2, state(2)).wait()
    assert steps(str(root)) == [1]


def lease_requests(on: threading.Event):
    # Swallowed, never answered, never reaching the server: a reset after the request was sent can
    # leave the object empty on SeaweedFS, which the next test covers on its own.
    def rule(line: str) -> Fault | None:
        return Fault(stall=True) if on.is_set() and "tierio-lease" in line else None
    return rule


def test_a_holder_that_cannot_renew_stops_writing_before_it_may_be_taken_over(s3_url, seaweed):
    """No request about the lease is answered (a store that stopped answering this node); after
    expires - margin on its own clock the holder refuses to write, though nobody took over."""
    cut = threading.Event()
    proxy = FaultyProxy(seaweed.endpoint, lease_requests(cut))
    try:
        url = via(proxy.endpoint, s3_url, timeout=0.5)
        with CheckpointManager([url], lease_expires=1.0) as mgr:
            mgr.save(1, state(1)).wait()
            cut.set()
            time.sleep(1.2)  # > expires - margin = 0.75 s
            with pytest.raises(LeaseError, match="self-fenced"):
                mgr.save(2, state(2)).wait()
            assert next(iter(mgr.stats()["leases"].values())).startswith("lost")
            cut.clear()
    finally:
        proxy.close()
    assert steps(s3_url) == [1]
    assert read_lease(open_store(s3_url)).run == mgr.run_id  # a self-fenced holder does not release: it expires


def test_a_lease_emptied_by_a_cut_write_is_unreadable_then_taken_over(s3_url, seaweed, caplog):
    """SeaweedFS keeps a PUT whose connection was reset after the request as an EMPTY object: a
    renewal cut that way empties the lease. It reads as an unreadable lease (not as a lease that
    keeps changing), and a new run takes it over once it stayed so for the expiry time."""
    store = open_store(s3_url)
    with CheckpointManager([s3_url]) as first:
        first.save(1, state(1)).wait()
    g = lease_mod.newest_generation(store)
    store.put_buffers(lease_mod.generation_key(g), [b""])  # what the cut renewal leaves behind
    seen = lease_mod.look(store)
    assert seen.generation == g and seen.holder is None and seen.raw == b""
    with pytest.raises(FormatError, match="lease"):
        read_lease(store)
    with caplog.at_level(logging.WARNING, logger="tierio.ckpt"):
        with CheckpointManager([s3_url], lease_expires=1.0) as second:
            second.save(2, state(2)).wait()
            assert read_lease(store).run == second.run_id
    assert "unreadable" in caplog.text
    assert steps(s3_url) == [1, 2]


def rank_job(rank: int, root: str, ready, run_id: str | None, results) -> None:
    """A rank given by hand, with no process group."""
    try:
        with CheckpointManager([root], rank=rank, world_size=2, commit_timeout=120, run_id=run_id) as mgr:
            mgr.save(5, state(5, f"rank{rank}")).wait()
            results.put((rank, mgr.stats()["leases"][open_store(root).url]))
    except ConfigError as exc:
        results.put((rank, f"ConfigError: {exc}"))
    ready.set()


def run_ranks(root: str, run_ids: tuple[str | None, str | None], ranks=(1, 0)) -> dict:
    ctx = mp.get_context("spawn")
    done, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=rank_job, args=(r, root, done, run_ids[r], results)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert all(p.exitcode == 0 for p in procs)
    return dict(results.get(timeout=10) for _ in procs)


def test_ranks_of_one_job_share_the_lease(tmp_path):
    root = str(tmp_path / "tier")
    assert run_ranks(root, ("job7", "job7")) == {0: "held", 1: "joined"}
    assert steps(root) == [5] and verify(root, 5).ok
    names = sorted(os.listdir(tmp_path / "tier" / "step_000000005"))
    assert names == ["manifest.json", "rank_00000.safetensors", "rank_00001.safetensors"]


def test_a_rank_without_a_run_id_never_adopts_another_jobs_lease(tmp_path, monkeypatch):
    root = str(tmp_path / "tier")
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    p, stop = start(hold_tier_of_two, root)  # a live job of the same world size holds the tier
    try:
        got = run_ranks(root, (None, None), ranks=(1,))
    finally:
        stop.set()
        p.join(60)
    assert got[1].startswith("ConfigError") and "run_id=" in got[1]
    assert steps(root) == []


def hold_tier_of_two(root: str, ready, stop) -> None:
    leases = TierLeases("otherjob", 0, 2)
    leases.ensure(open_store(root))
    ready.set()
    stop.wait(300)
    leases.close()


def test_the_launchers_job_id_names_the_run_of_ranks_without_a_group(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "8812")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    root = str(tmp_path / "tier")
    assert run_ranks(root, (None, None)) == {0: "held", 1: "joined"}
    assert steps(root) == [5]
    run = json.loads((tmp_path / "tier" / "step_000000005" / "manifest.json").read_text())["extra"]["tierio.run"]
    assert run == "slurm-8812-0-r0"


def lease_node_tier(root: str, ready, stop) -> None:
    leases = TierLeases("nodejob", 0, 1)
    leases.ensure(open_store(root), node_local=True)
    ready.set()
    stop.wait(300)
    leases.close()


def test_node_local_tier_lock_proves_a_dead_holder_at_once(tmp_path, caplog):
    root = str(tmp_path / "nvme")
    p, stop = start(lease_node_tier, root)
    try:
        mine = TierLeases("other", 0, 1)
        with pytest.raises(LeaseError, match="another process on this node holds"):
            mine.ensure(open_store(root), node_local=True)  # refused at once, no watch
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    # A free lock is proof enough, even with an hour-long expiry: taken without a watch.
    mine = TierLeases("other", 0, 1, timing=LeaseTiming(3600.0))
    with caplog.at_level(logging.WARNING, logger="tierio.ckpt"):
        mine.ensure(open_store(root), node_local=True)
    assert "tierio-lease.lock was free" in caplog.text and "watching" not in caplog.text
    assert look(open_store(root)).holder.run == "other"
    mine.close()


class IgnoringStore(LocalStore):
    """A filesystem store whose create-if-absent overwrites: what a server that ignores
    If-None-Match does to a lease."""

    def create_exclusive(self, key: str, data: bytes) -> bool:
        self.put_buffers(key, [data])
        return True


def test_a_store_that_ignores_conditions_is_refused(tmp_path):
    store = IgnoringStore(tmp_path / "tier")
    with pytest.raises(LeaseError, match="does not honour create-if-absent"):
        check_conditions(store)
    with pytest.raises(LeaseError, match="does not honour"):
        with CheckpointManager([store]) as mgr:
            mgr.save(1, state(1)).wait()
    assert store.list(LEASE_PREFIX) == []  # the probe leaves nothing behind


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
        assert steps(s3_url) == [1]
    assert read_lease(open_store(s3_url)) is None


@pytest.mark.parametrize("node_local", [False, True])
def test_threads_writing_a_tier_first_at_once_take_one_lease(tmp_path, node_local):
    """A persist and a promotion thread can both be the first to write a tier (a restored step
    published while the next save persists). They must take one lease between them: a second
    take-over by the same run left the first thread's generation stale, and its commit was then
    fenced off as if another run held the tier (seen in the crash enumeration under load)."""
    root = str(tmp_path / ("nvme" if node_local else "shared"))
    leases = TierLeases("job", 0, 1)
    start_line = threading.Barrier(8)
    errors: list[BaseException] = []

    def first_write() -> None:
        try:
            start_line.wait()
            leases.ensure(open_store(root), leader=True, node_local=node_local)
            leases.fence(open_store(root))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=first_write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        seen = look(open_store(root))
        assert seen.holder.run == "job" and leases.fence(open_store(root)) == seen.generation
    finally:
        leases.close()
