"""The persist process (``io.offload``): a save's byte loops run in a helper process on staging
memory it shares, the helper ignores the scheduler's signals, dies with the training process, and
a helper that dies fails only the request in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tierio.ckpt import CheckpointManager, KeepLast, Tier, verify
from tierio.errors import StorageError
from tierio.io import background, offload
from tierio.storage.local import LocalStore


def _state(seed: int, mib: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib << 18, generator=g), "b": torch.arange(1000) + seed, "step": seed}


def _tiers(root: Path) -> list[Tier]:
    return [Tier(root / "fast", KeepLast(2)), Tier(root / "slow", KeepLast(3))]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _resume(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGCONT)


def _maps_staging(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "tierio-staging" in f.read()


def test_a_save_writes_checksums_and_promotes_in_the_persist_process(tmp_path):
    before = offload.stats()["requests"]
    alone = offload.stats()["holders"] == 0
    with CheckpointManager(_tiers(tmp_path)) as mgr:
        mgr.save(1, _state(1)).wait()
        pid = offload.helper_pid()
        assert pid is not None and pid != os.getpid() and _alive(pid)
        assert _maps_staging(pid)  # the staging and promotion buffers are its memory too
        # the shard's write, its checksums, the promotion's read, checksums and write, and the
        # background threads' other store calls (records, manifests, listings)
        assert mgr.stats()["persist_process"]["requests"] - before >= 5
        for tier in ("fast", "slow"):
            assert verify(tmp_path / tier, 1).ok
        got = mgr.restore()
        assert torch.equal(got["w"], _state(1)["w"]) and torch.equal(got["b"], _state(1)["b"])
    if not alone:
        return
    assert offload.helper_pid() is None  # the last manager stops it
    for _ in range(200):
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid)


def test_without_the_persist_process_nothing_leaves_the_training_process(tmp_path):
    before = offload.stats()["requests"]
    with CheckpointManager(_tiers(tmp_path), persist_process=False) as mgr:
        mgr.save(1, _state(1)).wait()
        assert torch.equal(mgr.restore()["w"], _state(1)["w"])
    assert offload.stats()["requests"] == before


def test_a_killed_persist_process_fails_that_save_and_the_next_one_starts_a_new_one(tmp_path):
    with CheckpointManager(_tiers(tmp_path)) as mgr:
        mgr.save(1, _state(1)).wait()
        pid = offload.helper_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # paused: the next save's write waits on it
        try:
            handle = mgr.save(2, _state(2))
            handle.staged.result(timeout=60)  # the training thread is not held up by it
            os.kill(pid, signal.SIGKILL)
        finally:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        with pytest.raises(StorageError, match=r"persist process \(pid \d+\) ended \(signal SIGKILL\)"):
            handle.wait(timeout=120)
        assert mgr.steps() == [1]
        with pytest.raises(StorageError, match="persist process"):
            mgr.save(3, _state(3))  # the next call reports a background failure too
        mgr.save(3, _state(3)).wait()  # a new helper
        assert offload.helper_pid() not in (None, pid)
        assert mgr.steps() == [1, 3]
        for step in (1, 3):
            assert torch.equal(mgr.restore(step)["w"], _state(step)["w"])
        assert verify(tmp_path / "slow", 3).ok


def test_the_persist_process_ignores_the_signals_a_scheduler_sends_the_job(tmp_path):
    with CheckpointManager(_tiers(tmp_path)) as mgr:
        mgr.save(1, _state(1)).wait()
        pid = offload.helper_pid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            os.kill(pid, sig)
        time.sleep(0.2)
        assert _alive(pid)
        mgr.save(2, _state(2)).wait()
        assert offload.helper_pid() == pid and mgr.steps() == [1, 2]


CHILD = textwrap.dedent("""
    import sys, time, torch
    from tierio.ckpt import CheckpointManager
    from tierio.io import offload
    mgr = CheckpointManager([sys.argv[1]])
    mgr.save(1, {"w": torch.ones(1 << 20)}).wait()
    print(offload.helper_pid(), flush=True)
    time.sleep(600)
""")


def test_the_persist_process_ends_with_a_killed_training_process(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "t")], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        assert _alive(pid)
    finally:
        child.kill()
        child.wait()
    for _ in range(400):
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid), "the persist process outlived the training process"


FALLBACK = textwrap.dedent("""
    import logging, sys, torch
    from tierio.ckpt import CheckpointManager
    from tierio.io import offload
    logging.basicConfig()
    sys.executable = "/bin/false"  # an interpreter that cannot start the helper
    with CheckpointManager([sys.argv[1], sys.argv[2]]) as mgr:
        mgr.save(1, {"w": torch.arange(1 << 20)}).wait()
        assert torch.equal(mgr.restore()["w"], torch.arange(1 << 20))
    print(offload.stats())
""")


def test_a_persist_process_that_cannot_start_leaves_the_work_on_threads(tmp_path):
    out = subprocess.run([sys.executable, "-c", FALLBACK, str(tmp_path / "a"), str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "'unavailable': True" in out.stdout and "'requests': 0" in out.stdout
    assert "persist process did not start" in out.stderr and "persist_process=False" in out.stderr



def test_the_last_holder_letting_go_leaves_the_helper_to_the_request_still_running_in_it(tmp_path):
    """A closing manager lets go of the helper while a promotion may still write there (a step
    restored from the nodes' tier 0 is published behind the restore): that write completes, and
    the helper stops after it."""
    alone = offload.stats()["holders"] == 0
    store = LocalStore(tmp_path / "tier")
    store.offload = True
    offload.hold(0)
    held, pid = True, None
    try:
        with background.pool("test-promote", 5) as pool:  # routed: a background thread's call
            assert pool.submit(store.put_buffers, "first", [b"1"]).result(timeout=120) == 1
            assert offload.stats()["requests"] > 0
            pid = offload.helper_pid()
            os.kill(pid, signal.SIGSTOP)  # its next request stays in flight until it goes on
            write = pool.submit(store.put_buffers, "step/shard", [b"x" * 1000])
            for _ in range(1200):
                if offload.stats()["in_flight"] == 1:
                    break
                time.sleep(0.05)
            assert offload.stats()["in_flight"] == 1, write.exception(timeout=1)
            offload.let_go()
            held = False
            _resume(pid)
            assert write.result(timeout=120) == 1000
        assert (tmp_path / "tier" / "step" / "shard").read_bytes() == b"x" * 1000
        if alone:
            assert offload.helper_pid() is None  # stopped once its last request ended
    finally:
        if pid is not None:
            _resume(pid)
        if held:
            offload.let_go()
