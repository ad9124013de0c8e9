"""The node-local cache (tierio.storage.cache) with real files, real flocks and real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest

from tierio.errors import ConfigError, FormatError
from tierio.storage.cache import CacheOptions, FillPlan, NodeCache, entry_name

UNIT = 1000


def _plan(size: int = UNIT, fill: bytes | None = None, log: Path | None = None, delay: float = 0.0):
    def write(target: Path) -> None:
        if log is not None:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        target.write_bytes(fill if fill is not None else b"x" * size)

    return lambda: FillPlan(size, write, f"test entry of {size} bytes")


def _cache(root: Path, units: float = 3, wait: float = 0.0, **kw) -> NodeCache:
    return NodeCache(root, CacheOptions(limit=int(units * UNIT), wait_timeout=wait, **kw))


def _present(cache: NodeCache, *keys: str) -> list[bool]:
    return [cache.entry_path(entry_name(k)).exists() for k in keys]


def test_fill_once_then_hit_and_atomic_layout(tmp_path):
    cache = _cache(tmp_path / "c")
    with cache.get("a", "file", _plan(fill=b"a" * UNIT)) as pin:
        assert not pin.hit and pin.path.read_bytes() == b"a" * UNIT
    with cache.get("a", "file", _plan(fill=b"other")) as pin:
        assert pin.hit and pin.path.read_bytes() == b"a" * UNIT
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".lock", ".partial", ".reserve", "entries", "indexes", "locks"]
    assert not list((tmp_path / "c" / ".partial").iterdir()) and not list((tmp_path / "c" / ".reserve").iterdir())
    # a verify hook that refuses keeps nothing; a usable() that refuses refills
    def refuse(_: Path) -> None:
        raise FormatError("refused")

    with pytest.raises(FormatError, match="refused"):
        cache.get("b", "file", lambda: FillPlan(UNIT, lambda t: t.write_bytes(b"b" * UNIT), "b", verify=refuse))
    assert _present(cache, "b") == [False] and not list((tmp_path / "c" / ".partial").iterdir())
    with cache.get("a", "file", _plan(fill=b"A" * UNIT), usable=lambda p: False) as pin:
        assert not pin.hit and pin.path.read_bytes() == b"A" * UNIT


def test_directory_entries_count_every_file(tmp_path):
    cache = _cache(tmp_path / "c", units=10)

    def write(target: Path) -> None:
        (target / "sub").mkdir()
        (target / "one").write_bytes(b"1" * UNIT)
        (target / "sub" / "two").write_bytes(b"2" * (2 * UNIT))

    with cache.get("model", "dir", lambda: FillPlan(3 * UNIT, write, "model")) as pin:
        assert (pin.path / "sub" / "two").read_bytes() == b"2" * (2 * UNIT)
    assert [e.bytes for e in cache.entries()] == [3 * UNIT]
    assert cache.evict("model") and not cache.evict("model")
    assert cache.entries() == [] and not list((tmp_path / "c" / "locks").iterdir())


def test_lru_uses_a_nanosecond_clock_and_skips_pinned_entries(tmp_path):
    cache = _cache(tmp_path / "c", units=3)
    for k in "abc":  # three fills within a few ms: the kernel's file times could tie
        cache.get(k, "file", _plan()).release()
    cache.get("a", "file", _plan()).release()  # a is now the most recently used
    held = cache.get("b", "file", _plan())  # b is pinned
    try:
        cache.get("d", "file", _plan()).release()
        assert _present(cache, "a", "b", "c", "d") == [True, True, False, True]
    finally:
        held.release()


def test_make_room_evicts_nothing_when_pins_keep_the_fill_from_fitting(tmp_path):
    cache = _cache(tmp_path / "c", units=4, wait=0.3)
    for k in "abc":
        cache.get(k, "file", _plan()).release()
    pins = [cache.get(k, "file", _plan()) for k in "bc"]
    try:
        with pytest.raises(ConfigError, match="in use"):
            cache.get("big", "file", _plan(3 * UNIT))  # only a (1 unit) could go: not enough
        assert _present(cache, "a", "b", "c") == [True, True, True]  # so nothing went
    finally:
        for p in pins:
            p.release()
    cache.get("big", "file", _plan(3 * UNIT)).release()
    assert _present(cache, "big") == [True] and cache.usage().present <= 4 * UNIT


@pytest.mark.parametrize("size", [float("nan"), float("inf"), -1, 1.5, True, "10"])
def test_bogus_sizes_are_format_errors_before_any_eviction(tmp_path, size):
    cache = _cache(tmp_path / "c", units=2, wait=5)
    cache.get("a", "file", _plan()).release()
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="size"):
        cache.get("bogus", "file", lambda: FillPlan(size, lambda t: t.write_bytes(b""), "bogus entry"))
    assert time.monotonic() - t0 < 5  # not a wait for room
    assert _present(cache, "a") == [True]
    with pytest.raises(ConfigError, match="at most"):
        cache.get("huge", "file", _plan(3 * UNIT))


def test_indexes_do_not_count_and_are_trimmed_on_their_own(tmp_path):
    cache = _cache(tmp_path / "c", units=2, index_limit=3 * UNIT)
    for i in range(5):
        assert cache.put_index(f"idx{i}", bytes([i]) * UNIT)
    assert cache.read_index("idx4", 10 * UNIT) == b"\x04" * UNIT
    assert cache.read_index("idx4", UNIT - 1) is None  # larger than the caller allows
    assert cache.read_index("missing", UNIT) is None
    assert cache.usage().present == 0  # indexes are not entries
    cache.get("a", "file", _plan()).release()
    cache.get("b", "file", _plan()).release()  # make room ran: indexes trimmed to their own limit
    kept = [i for i in range(5) if cache.read_index(f"idx{i}", UNIT) is not None]
    assert kept == [2, 3, 4] and _present(cache, "a", "b") == [True, True]


def test_names_are_derived_never_taken_from_keys(tmp_path):
    for key in ["../../victim", "/etc/passwd", "a/../../b", "..", ".", ".hidden", "x\x00y", "s3://b/m?endpoint=http://h:1/..",
                "\udcff", "a" * 5000]:
        name = entry_name(key)
        assert "/" not in name and not name.startswith(".") and len(name) < 100 and "\x00" not in name
    assert entry_name("s3://b/models/llama?endpoint=http://h:1").startswith("llama-")
    assert entry_name("a") != entry_name("a ")
    cache = _cache(tmp_path / "deep" / "c")
    with cache.get("../../victim", "file", _plan()) as pin:
        assert pin.path.parent == tmp_path / "deep" / "c" / "entries"
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["c"]


def test_planted_links_are_replaced_never_followed(tmp_path):
    cache = _cache(tmp_path / "c")
    outside = tmp_path / "outside"
    outside.mkdir()
    name = entry_name("a")
    (tmp_path / "c" / "locks" / f"{name}.lock").symlink_to(outside / "made-by-lock")
    (tmp_path / "c" / "indexes" / entry_name("i")).symlink_to(outside / "secret")
    (outside / "secret").write_bytes(b"secret")
    os.mkfifo(tmp_path / "c" / ".reserve" / "fifo")
    cache.get("a", "file", _plan()).release()
    assert cache.read_index("i", 100) is None  # a link is not an index
    assert cache.usage().reserved == 0  # the FIFO was not read (it would block)
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    (tmp_path / "c" / "entries").rename(tmp_path / "c" / "moved")
    (tmp_path / "c" / "entries").symlink_to(outside)
    with pytest.raises(FormatError, match="symbolic link"):
        _cache(tmp_path / "c")


# -- several processes ------------------------------------------------------------------------
def _hold(root: str, key: str, ready, release) -> None:
    cache = _cache(Path(root), units=2, wait=0.3)
    with cache.get(key, "file", _plan()):
        ready.set()
        release.wait(60)


def test_two_processes_pin_fill_and_evict(tmp_path):
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / "c"), "a", ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        cache = _cache(tmp_path / "c", units=2, wait=0.3)
        cache.get("b", "file", _plan()).release()
        cache.get("c", "file", _plan()).release()  # room by evicting b: a is pinned by the other process
        assert _present(cache, "a", "b", "c") == [True, False, True]
        with pytest.raises(ConfigError, match="in use"):
            cache.get("big", "file", _plan(2 * UNIT))
        assert _present(cache, "a", "c") == [True, True]
        release.set()
        holder.join(60)
        assert holder.exitcode == 0
        cache.get("big", "file", _plan(2 * UNIT)).release()  # the pin died with its holder's lock
        assert _present(cache, "a", "c", "big") == [False, False, True]
    finally:
        release.set()
        holder.join(60)


def _fill_shared(root: str, log: str, out) -> None:
    cache = _cache(Path(root), units=4)
    with cache.get("shared", "file", _plan(fill=b"s" * UNIT, log=Path(log), delay=0.5)) as pin:
        out.put((pin.hit, pin.path.read_bytes() == b"s" * UNIT))


def test_two_processes_asking_at_once_fill_once(tmp_path):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fill_shared, args=(str(tmp_path / "c"), str(tmp_path / "log"), out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert results == [(False, True), (True, True)]
    assert len((tmp_path / "log").read_text().split()) == 1


def _die_while_filling(root: str) -> None:
    def write(target: Path) -> None:
        target.write_bytes(b"half")
        os._exit(3)  # a crash in the middle of a fill: no cleanup runs

    _cache(Path(root)).get("d", "file", lambda: FillPlan(UNIT, write, "d"))


def test_a_fill_that_died_leaves_nothing_claimed(tmp_path):
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_die_while_filling, args=(str(tmp_path / "c"),))
    p.start()
    p.join(60)
    assert p.exitcode == 3
    assert list((tmp_path / "c" / ".reserve").iterdir()) and list((tmp_path / "c" / ".partial").iterdir())
    cache = _cache(tmp_path / "c")
    assert cache.usage().reserved == 0
    assert not list((tmp_path / "c" / ".reserve").iterdir()) and not list((tmp_path / "c" / ".partial").iterdir())
    with cache.get("d", "file", _plan()) as pin:
        assert not pin.hit and pin.path.stat().st_size == UNIT


def _linger(go) -> None:
    go.wait(60)


def test_a_forked_child_does_not_keep_its_parents_pins(tmp_path):
    cache = _cache(tmp_path / "c")
    pin = cache.get("a", "file", _plan())
    ctx = mp.get_context("fork")
    go = ctx.Event()
    child = ctx.Process(target=_linger, args=(go,))
    child.start()  # inherits the pinned descriptor, and closes it right after the fork
    try:
        pin.release()
        done = threading.Event()
        threading.Thread(target=lambda: (cache.evict("a"), done.set()), daemon=True).start()
        assert done.wait(20), "the forked child still holds the parent's pin"
        assert _present(cache, "a") == [False]
    finally:
        go.set()
        child.join(60)


def test_verified_download_checks_every_window_and_records_its_xxh3(tmp_path):
    from tierio.errors import IntegrityError
    from tierio.io.buffers import BufferPool
    from tierio.io.checksum import xxh3
    from tierio.storage.download import download_verified
    from tierio.storage.local import LocalStore

    data = os.urandom(3 * 4096 + 100)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "obj").write_bytes(data)
    store = LocalStore(tmp_path / "store", direct=False)
    window = 4096
    sums = [xxh3(data[o : o + window]) for o in range(0, len(data), window)]
    pool = BufferPool(budget_bytes=None, pin=False, max_buffers=4)
    download_verified(store, "obj", tmp_path / "copy", len(data), window, sums, buffers=pool, depth=2, where="obj")
    assert (tmp_path / "copy").read_bytes() == data
    bad = sums[:1] + ["0" * 16] + sums[2:]
    with pytest.raises(IntegrityError, match=f"obj: bytes {window}..{2 * window} do not match their checksum"):
        download_verified(store, "obj", tmp_path / "copy2", len(data), window, bad, buffers=pool, depth=2, where="obj")
