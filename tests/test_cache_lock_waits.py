"""A node cache reader behind a filler that hangs: every wait on an entry's lock ends after
``fill_wait`` with a typed error naming the entry and the process that holds it. The hung filler
is a real second process, stopped in the middle of its fill with the entry's lock held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tierio.storage.cache import CacheOptions, EntryBusyError, FillPlan, NodeCache, entry_name

KEY = "s3://bucket/data/shard-00001.tar"

FILLER = textwrap.dedent("""
    import os, signal, sys
    from tierio.storage.cache import CacheOptions, FillPlan, NodeCache

    def write(target):
        print("filling", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # a stopped process (or a download that never ends)
        target.write_bytes(b"late")

    NodeCache(sys.argv[1], CacheOptions(limit=1 << 20)).get(sys.argv[2], "file", lambda: FillPlan(4, write, "shard"))
""")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def hung_filler(tmp_path):
    """A process stopped while it fills KEY's entry, holding the entry's exclusive lock."""
    p = subprocess.Popen([sys.executable, "-c", FILLER, str(tmp_path), KEY], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "filling"
        deadline = time.monotonic() + 10
        while _state(p.pid) != "T":  # stopped for real: a SIGCONT sent before the stop would be lost
            assert time.monotonic() < deadline, "the filler never stopped"
            time.sleep(0.01)
        yield p
    finally:
        p.kill()  # SIGKILL ends a stopped process too; the kernel then drops its lock
        p.wait(10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", ["get", "evict"])
def test_a_reader_behind_a_hung_filler_gives_up_after_fill_wait(tmp_path, hung_filler, call):
    """Before: flock(LOCK_SH) (LOCK_EX for evict) waited for as long as the filler lived."""
    cache = NodeCache(tmp_path, CacheOptions(limit=1 << 20, fill_wait=1.0))
    with pytest.raises(EntryBusyError) as err:
        if call == "get":
            cache.get(KEY, "file", lambda: FillPlan(3, lambda t: t.write_bytes(b"new"), "shard"))
        else:
            cache.evict(KEY)
    message = str(err.value)
    assert KEY in message and entry_name(KEY) in message  # the entry ...
    assert f"pid {hung_filler.pid} (exclusive" in message  # ... what holds it ...
    assert "fill_wait" in message and "end that process" in message  # ... and what to do
    hung_filler.kill()
    hung_filler.wait(10)
    with cache.get(KEY, "file", lambda: FillPlan(3, lambda t: t.write_bytes(b"new"), "shard")) as pin:
        assert pin.path.read_bytes() == b"new"  # the dead filler's lock is gone, and so is its fill


@pytest.mark.timeout(30)
def test_a_reader_waits_for_a_filler_that_finishes_within_fill_wait(tmp_path, hung_filler):
    """The bounded wait still waits: the stopped filler is resumed and its fill is what the reader gets."""
    cache = NodeCache(tmp_path, CacheOptions(limit=1 << 20, fill_wait=20.0))
    os.kill(hung_filler.pid, signal.SIGCONT)
    with cache.get(KEY, "file", lambda: FillPlan(3, lambda t: t.write_bytes(b"new"), "shard")) as pin:
        assert pin.hit and pin.path.read_bytes() == b"late"


def test_a_waiter_is_late_by_at_most_a_tenth_of_its_wait():
    """Before: the pause doubled up to 50 ms, so DataLoader workers waiting on one shard download
    got it up to 50 ms after it ended (measured 20-54 ms for the second worker's first batch)."""
    from tierio.storage.cache import _POLL, poll_pause

    assert poll_pause(0.0, 60.0) == 0.001  # the first tries come quickly
    for waited in (0.01, 0.05, 0.1, 0.3):
        assert poll_pause(waited, 60.0) == pytest.approx(waited / 10)
    assert poll_pause(30.0, 60.0) == _POLL  # a long fill is polled cheaply
    assert poll_pause(5.0, 0.002) == 0.002  # never past the caller's deadline
    assert poll_pause(5.0, -1.0) == 0.0
