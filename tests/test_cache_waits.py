"""The node cache's waits: a process that finds an entry missing never waits on another process's
pin of it, and an entry committed before its bytes reached the disk is not trusted after a reboot."""

from __future__ import annotations

import os
import threading
import time

from tierio.storage.cache import LOCKS, UNSYNCED, CacheOptions, FillPlan, NodeCache, entry_name


def _plan(data: bytes, started: threading.Event | None = None, durable: bool = True):
    def write(target):
        if started is not None:
            started.set()
        target.write_bytes(data)

    return lambda: FillPlan(len(data), write, "test entry", durable=durable)


def test_a_waiter_for_a_missing_entry_does_not_wait_on_the_pin_of_whoever_filled_it(tmp_path):
    """B finds the entry missing; before B asks to fill it, A fills it and keeps reading it (a
    pin). B must then use A's copy, not wait for A to finish reading (with DataLoader workers
    that deliver batches in turn, A may be waiting for B: a deadlock)."""
    a_may_start, a_pinned = threading.Event(), threading.Event()

    class Interleaved(NodeCache):
        checked = False

        def _pin_if_usable(self, *args):
            pin = super()._pin_if_usable(*args)
            if not self.checked:  # B's first look: nothing there yet; now let A fill and pin it
                self.checked = True
                a_may_start.set()
                assert a_pinned.wait(30)
            return pin

    options = CacheOptions(limit=1 << 20, wait_timeout=30)
    a_cache, b_cache = NodeCache(tmp_path, options), Interleaved(tmp_path, options)
    a_pin = []

    def a() -> None:
        assert a_may_start.wait(30)
        a_pin.append(a_cache.get("k", "file", _plan(b"from A")))
        a_pinned.set()

    got = []
    ta = threading.Thread(target=a)
    tb = threading.Thread(target=lambda: got.append(b_cache.get("k", "file", _plan(b"from B"))))
    ta.start()
    tb.start()
    ta.join(30)
    tb.join(10)
    finished = not tb.is_alive()
    for p in a_pin:
        p.release()  # lets a B stuck behind A's pin finish, so the test ends either way
    tb.join(30)
    assert finished, "B waited on A's pin of the entry A had just filled"
    assert got[0].hit and got[0].path.read_bytes() == b"from A"
    got[0].release()


def _flushed(root) -> None:
    """Wait until every entry flushed behind its fill has reached the disk (its marker is gone)."""
    deadline = time.monotonic() + 30
    while any((root / UNSYNCED).iterdir()):
        assert time.monotonic() < deadline, "the flush behind the fill never happened"
        time.sleep(0.01)


def test_an_entry_committed_unflushed_before_the_last_boot_is_filled_again(tmp_path):
    cache = NodeCache(tmp_path, CacheOptions(limit=1 << 20))
    cache.get("k", "file", _plan(b"first", durable=False)).release()
    _flushed(tmp_path)
    again = cache.get("k", "file", _plan(b"second"))
    assert again.hit and again.path.read_bytes() == b"first"
    again.release()
    # an entry whose flush never happened, from before the system started: zeros may stand in it
    cache.evict("k")
    pin = cache.get("k", "file", _plan(b"third", durable=False))
    pin.release()
    _flushed(tmp_path)
    marker = tmp_path / UNSYNCED / pin.name
    marker.touch()  # as if the flush had never happened, before the system started
    os.utime(marker, (0, 0))
    refilled = cache.get("k", "file", _plan(b"fourth"))
    assert not refilled.hit and refilled.path.read_bytes() == b"fourth"
    refilled.release()


def test_a_reader_waits_for_another_process_fill_whatever_the_wait_for_room(tmp_path):
    """Another process is filling the entry (it holds the entry's lock) when this one asks for
    it: this one waits for the fill and uses it, even with no wait for room (``wait_timeout=0``,
    the weight cache's default), instead of failing at once."""
    import fcntl

    lock = tmp_path / LOCKS / f"{entry_name('k')}.lock"

    class Interleaved(NodeCache):
        checked = False

        def _pin_if_usable(self, *args):
            pin = super()._pin_if_usable(*args)
            if not self.checked:  # this process's first look found nothing; now another starts filling
                self.checked = True
                fd = os.open(lock, os.O_RDWR | os.O_CREAT)
                fcntl.flock(fd, fcntl.LOCK_EX)
                threading.Timer(1.0, lambda: os.close(fd)).start()  # its fill ends (without an entry: this one fills)
            return pin

    cache = Interleaved(tmp_path, CacheOptions(limit=1 << 20, wait_timeout=0))
    with cache.get("k", "file", _plan(b"mine")) as pin:
        assert pin.path.read_bytes() == b"mine"
