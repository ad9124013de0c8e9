"""The one windowed read engine (tierio.io.engine) and its users: window planning, order of
results, errors that wait for running requests, nested use on a saturated pool, one shared pool."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch
from payloads import payload
from safetensors.torch import save_file

from tierio.errors import IntegrityError
from tierio.io import copy_file, read_into, write_file
from tierio.io.buffers import HostBuffer
from tierio.io.engine import (
    POOL_THREADS,
    ByteRange,
    Window,
    Windowing,
    drain,
    executor,
    plan,
    run_windows,
    windows,
)
from tierio.storage.local import LocalStore
from tierio.storage.scatter import read_scatter
from tierio.units import MiB
from tierio.weights import load, load_into

KiB = 1 << 10
HANG = 120  # seconds after which a run that has not finished is taken for a deadlock


def finishes(fn) -> list:
    """Run ``fn`` on its own thread; fail (instead of hanging the suite) when it never returns."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(HANG)
    assert not t.is_alive(), "the engine deadlocked"
    assert out, "the run raised (see the thread's traceback above)"
    return out


# -- planning ----------------------------------------------------------------------------------
def test_plan_merges_small_holes_and_starts_regions_on_the_grid():
    shape = Windowing(size=4 * MiB, depth=2, merge_gap=MiB, grid=MiB)
    ranges = [ByteRange(10 * MiB + 5, 11 * MiB), ByteRange(3 * MiB + 7, 4 * MiB), ByteRange(5 * MiB, 6 * MiB),
              ByteRange(6 * MiB, 6 * MiB), ByteRange(7 * MiB + 1, 8 * MiB)]
    regions = plan(ranges, shape)
    # 3..4 and 5..6 are a hole of exactly 1 MiB apart (read through); 6..7+1 is a hole of 1 MiB + 1.
    assert [(r.start, r.end, r.members) for r in regions] == [
        (3 * MiB, 6 * MiB, [1, 2]), (7 * MiB, 8 * MiB, [4]), (10 * MiB, 11 * MiB, [0])]


def test_plan_never_reads_a_byte_twice_when_grid_starts_overlap():
    # two row pieces of one 4 KiB page with a hole above the merge gap: one region, not two that
    # both start at 0 (a strided tensor-parallel slice read exactly)
    regions = plan([ByteRange(100, 200), ByteRange(300, 400), ByteRange(8192, 8200)], Windowing(size=MiB, depth=1))
    assert [(r.start, r.end, r.members) for r in regions] == [(0, 400, [0, 1]), (8192, 8200, [2])]


def test_windows_cover_each_region_from_its_start():
    regions = plan([ByteRange(4096 * 3 + 1, 4096 * 3 + 10 * MiB)], Windowing(size=4 * MiB, depth=1))
    ws = list(windows(regions, 4 * MiB))
    assert ws[0].offset == 4096 * 3 and all(w.offset % 4096 == 0 for w in ws)
    assert [w.length for w in ws] == [4 * MiB, 4 * MiB, 2 * MiB]
    assert ws[-1].end == regions[0].end and all(a.end == b.offset for a, b in itertools.pairwise(ws))


# -- running -----------------------------------------------------------------------------------
def test_results_come_back_in_window_order_from_the_shared_pool():
    seen: set[str] = set()

    def body(w: Window) -> int:
        seen.add(threading.current_thread().name)
        if w.of % 7 == 0:
            time.sleep(0.001)  # finish out of order
        return w.of

    assert run_windows([Window(i, 0, 1) for i in range(200)], body, depth=8) == list(range(200))
    assert all(n.startswith("tierio-io") or n == threading.current_thread().name for n in seen)


def test_an_error_cancels_the_rest_and_waits_for_running_windows():
    """The caller closes descriptors right after an error: no window may still be running then."""
    lock = threading.Lock()
    state = {"running": 0}
    started: list[int] = []
    others_started = threading.Event()

    def body(w: Window) -> None:
        with lock:
            state["running"] += 1
            started.append(w.of)
            if len(started) >= 4:
                others_started.set()
        try:
            if w.of == 0:
                others_started.wait(30)
                raise IntegrityError("window 0 failed")
            time.sleep(0.05)  # still running when window 0's error reaches the caller
        finally:
            with lock:
                state["running"] -= 1

    with pytest.raises(IntegrityError, match="window 0"):
        run_windows((Window(i, 0, 1) for i in range(1000)), body, depth=8)
    assert state["running"] == 0
    assert len(started) < 1000


def test_drain_runs_every_item_once_and_no_worker_waits_behind_a_slow_one():
    """Item 0 finishes only once every other item has run: with two workers, the second must
    take all the others meanwhile (oldest-first reaping would start none of them)."""
    n = 50
    done: list[int] = []
    lock = threading.Lock()
    rest_done = threading.Event()

    def body(i: int) -> None:
        if i == 0:
            assert rest_done.wait(HANG), "the other items waited behind item 0"
        with lock:
            done.append(i)
            if len(done) == n - 1:
                rest_done.set()

    finishes(lambda: drain(range(n), body, 2))
    assert sorted(done) == list(range(n)) and done[-1] == 0


def test_drain_stops_taking_items_after_an_error_and_waits_for_running_ones():
    running = {"n": 0}
    taken: list[int] = []
    lock = threading.Lock()

    def body(i: int) -> None:
        with lock:
            running["n"] += 1
            taken.append(i)
        try:
            if i == 3:
                raise IntegrityError("item 3 failed")
            time.sleep(0.01)
        finally:
            with lock:
                running["n"] -= 1

    with pytest.raises(IntegrityError, match="item 3"):
        drain(range(1000), body, 4)
    assert running["n"] == 0
    assert len(taken) < 100


def test_nested_runs_on_a_saturated_pool_do_not_deadlock():
    """Every pool thread runs an outer window that itself waits for inner windows on the same
    pool: the inner windows can only run because a waiting thread takes back what has not started."""
    executor()
    lock = threading.Lock()
    inside = {"n": 0}
    all_busy = threading.Event()

    def outer(w: Window) -> int:
        with lock:
            inside["n"] += 1
            if inside["n"] >= POOL_THREADS:
                all_busy.set()
        all_busy.wait(30)  # every pool thread is now in an outer window
        return sum(run_windows([Window(i, 0, 1) for i in range(6)], lambda v: v.of + w.of, depth=3))

    n = 2 * POOL_THREADS
    got = finishes(lambda: run_windows([Window(i, 0, 1) for i in range(n)], outer, depth=n))[0]
    assert got == [15 + 6 * i for i in range(n)]


def test_restores_copies_and_writes_nest_inside_pool_work(tmp_path):
    """A scatter read (which reads through LocalStore.read_into, itself windowed), a file copy and a
    file write, each run from inside a window while every pool thread is busy, complete."""
    data = payload(3 * MiB + 123, 1)
    store = LocalStore(tmp_path / "store")
    store.put_buffers("obj", [data])
    lock = threading.Lock()
    inside = {"n": 0}
    all_busy = threading.Event()

    def outer(w: Window) -> bool:
        with lock:
            inside["n"] += 1
            if inside["n"] >= POOL_THREADS:
                all_busy.set()
        all_busy.wait(30)
        dests = [bytearray(1000 + w.of), bytearray(70_000)]
        spans = [(5 + w.of, memoryview(dests[0])), (2 * MiB + 17, memoryview(dests[1]))]
        read_scatter(store, "obj", spans, window=256 * KiB, depth=2)
        ok = bytes(dests[0]) == data[5 + w.of : 1005 + 2 * w.of] and bytes(dests[1]) == data[2 * MiB + 17 : 2 * MiB + 70_017]
        if w.of % 8 == 0:
            out = tmp_path / f"copy-{w.of}"
            copy_file(store.root / "obj", out, chunk_size=256 * KiB, depth=4)
            write_file(tmp_path / f"w-{w.of}", [data[:300_001]], chunk_size=64 * KiB, depth=4)
            ok = ok and out.read_bytes() == data and (tmp_path / f"w-{w.of}").read_bytes() == data[:300_001]
        return ok

    n = 2 * POOL_THREADS
    assert all(finishes(lambda: run_windows([Window(i, 0, 1) for i in range(n)], outer, depth=n))[0])


def test_the_engine_works_in_a_forked_child(tmp_path):
    """A forked child (a DataLoader worker) gets a fresh pool: its first read does not hang."""
    path = tmp_path / "f"
    path.write_bytes(payload(2 * MiB + 5, 2))
    read_into(path, 0, bytearray(2 * MiB + 5), chunk_size=256 * KiB)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:
        try:
            buf = bytearray(2 * MiB + 5)
            read_into(path, 0, buf, chunk_size=256 * KiB)
            os._exit(0 if bytes(buf) == path.read_bytes() else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- the users run on the shared pool ------------------------------------------------------------
@pytest.fixture
def started_threads(monkeypatch):
    """Names of the threads started while the test runs (the shared pool's are tierio-io_N)."""
    names: list[str] = []
    real = threading.Thread.start

    def start(self, *a, **kw):
        names.append(self.name)
        return real(self, *a, **kw)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


def test_weight_loads_and_restores_start_no_thread_pool_of_their_own(tmp_path, started_threads):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(70_000 + i, generator=g) for i in range(6)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    got = [load(tmp_path / "m.safetensors", mapped=False, chunk_bytes=MiB),
           load(tmp_path / "m.safetensors", mapped=True, chunk_bytes=MiB)]
    into = {k: torch.zeros_like(v) for k, v in tensors.items()}
    load_into(into, tmp_path / "m.safetensors", chunk_bytes=MiB)
    store = LocalStore(tmp_path / "store")
    blob = payload(5 * MiB, 3)
    store.put_buffers("obj", [blob])
    dest = bytearray(2 * MiB)
    read_scatter(store, "obj", [(MiB + 3, memoryview(dest))])
    for out in [*got, into]:
        assert all(torch.equal(out[k], v) for k, v in tensors.items())
    assert bytes(dest) == blob[MiB + 3 : 3 * MiB + 3]
    assert all(n.startswith("tierio-io") for n in started_threads), started_threads


def test_scatter_windows_sit_on_the_mib_grid(tmp_path):
    """Scatter windows start on a MiB boundary even when the first destination does not."""
    class Recording(LocalStore):
        def read_into(self, key, offset, buf):
            asked.append((offset, len(buf)))
            return super().read_into(key, offset, buf)

    asked: list[tuple[int, int]] = []
    blob = payload(9 * MiB, 4)
    store = Recording(tmp_path / "s")
    store.put_buffers("o", [blob])
    dests = [bytearray(100), bytearray(MiB), bytearray(10)]
    spans = [(MiB + 77, memoryview(dests[0])), (2 * MiB + 4096, memoryview(dests[1])), (8 * MiB, memoryview(dests[2]))]
    assert read_scatter(store, "o", spans, window=2 * MiB, depth=2) == MiB + 110
    assert all(bytes(d) == blob[o : o + len(d)] for o, d in spans)
    assert all(off % MiB == 0 for off, _ in asked)
    assert sorted(asked) == [(MiB, 177), (2 * MiB, MiB + 4096), (8 * MiB, 10)]


def test_scatter_of_a_truncated_object_is_a_clear_error(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put_buffers("o", [payload(MiB, 5)])
    with pytest.raises(IntegrityError, match="truncated"):
        read_scatter(store, "o", [(MiB - 10, memoryview(bytearray(100)))])


def test_read_into_an_unaligned_range_into_a_congruent_buffer(tmp_path):
    """Offset and address agree modulo 4 KiB but neither is aligned: the head and tail blocks go
    through bounce buffers, the interior by DMA, windows on the 4 KiB grid below the offset."""
    data = payload(3 * MiB, 6)
    (tmp_path / "f").write_bytes(data)
    hb = HostBuffer(2 * MiB + 8192)
    view = hb.view[4096 - 100 : 4096 - 100 + 2 * MiB + 200]  # address congruent with offset 4096 - 100
    st = read_into(tmp_path / "f", 4096 - 100, view, chunk_size=MiB, depth=2)
    assert bytes(view) == data[4096 - 100 : 4096 + 2 * MiB + 100]
    assert st.requests == 3
