"""Background threads run below the training step's priority, and so does the I/O they submit."""

from __future__ import annotations

import os
import threading

import torch

from tierio.ckpt import CheckpointManager, CheckpointOptions, KeepLast, Tier
from tierio.io import background, engine


def _nice_of(tid: int) -> int:
    """A thread's niceness as the kernel reports it (field 19 of /proc/self/task/TID/stat)."""
    stat = open(f"/proc/self/task/{tid}/stat").read()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_a_background_pool_runs_its_threads_niced_and_their_io_on_a_background_pool():
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    with background.pool("t-bg", 7) as pool:
        nice, level = pool.submit(lambda: (_nice_of(threading.get_native_id()), background.level())).result()
        assert (nice, level) == (min(19, base + 7), 7)
        # an I/O request submitted from the background thread goes to the background engine pool
        # (``executor().submit``: ``engine.submit``'s result() may run a request not yet started
        # on the waiting thread itself)
        nice, level, name = pool.submit(lambda: engine.executor().submit(lambda: (
            _nice_of(threading.get_native_id()), background.level(), threading.current_thread().name)).result()
        ).result()
        assert (nice, level) == (min(19, base + 7), 7) and name.startswith("tierio-io-bg7")
    # the training thread's own requests stay at its priority
    nice, level, name = engine.executor().submit(lambda: (_nice_of(threading.get_native_id()), background.level(),
                                               threading.current_thread().name)).result()
    assert (nice, level) == (base, 0) and name.startswith("tierio-io")
    assert _nice_of(threading.get_native_id()) == base


def test_a_checkpoint_persists_on_niced_threads_and_zero_keeps_them_level(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}

    def persisting_threads() -> dict[str, int]:
        return {t.name: _nice_of(t.native_id) for t in threading.enumerate()
                if t.name.startswith(("tierio-ckpt-persist", "tierio-ckpt-promote", "tierio-ckpt-checksum"))
                and t.native_id is not None}

    for nice in (10, 0):
        tiers = [Tier(tmp_path / f"a{nice}", KeepLast(1)), Tier(tmp_path / f"b{nice}", KeepLast(1))]
        with CheckpointManager(tiers, options=CheckpointOptions(background_nice=nice)) as mgr:
            mgr.save(1, state).wait()
            mgr.wait()
            seen = persisting_threads()
            assert any(n.startswith("tierio-ckpt-persist") for n in seen) and \
                any(n.startswith("tierio-ckpt-promote") for n in seen), seen
            assert set(seen.values()) == {min(19, base + nice)}, seen
            assert torch.equal(mgr.restore()["w"], state["w"])
        assert _nice_of(threading.get_native_id()) == base


def test_a_thread_started_by_a_background_thread_stays_off_the_foreground_pools():
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    seen = []

    def child() -> None:
        seen.append(engine.executor().submit(lambda: (_nice_of(threading.get_native_id()), threading.current_thread().name)).result())

    def start_child() -> None:
        t = threading.Thread(target=child)  # an ordinary thread, but born niced
        t.start()
        t.join()

    with background.pool("t-parent", 5) as pool:
        pool.submit(start_child).result()
    (nice, name), = seen
    assert nice == min(19, base + 5) and name.startswith("tierio-io-bg5")
    nice, name = engine.executor().submit(lambda: (_nice_of(threading.get_native_id()), threading.current_thread().name)).result()
    assert nice == base and not name.startswith("tierio-io-bg")
