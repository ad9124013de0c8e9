"""The byte engine on real files: alignment edge cases, fallback, durability, limiter, checksums."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from payloads import payload

from tierio.errors import (
    DiskFullError,
    IntegrityError,
    NotFoundError,
    PermissionDeniedError,
)
from tierio.io import (
    ALIGN,
    BufferPool,
    FileWriter,
    HostBuffer,
    TokenBucket,
    atomic_copy,
    atomic_write,
    copy_file,
    read_file,
    read_into,
    verify,
    write_file,
    xxh3,
)
from tierio.io.buffers import address_of
from tierio.io.stats import recent

SIZES = [0, 1, 511, 4095, 4096, 4097, 3 * 1024 * 1024 + 17]


def test_host_buffer_is_aligned_and_writable():
    b = HostBuffer(10_000)
    assert b.capacity % ALIGN == 0 and address_of(b.view) % ALIGN == 0
    b.view[:3] = b"abc"
    assert bytes(b.array[:3]) == b"abc"
    assert b.tensor().data_ptr() == address_of(b.view)


@pytest.mark.parametrize("size", SIZES)
def test_write_then_read_every_alignment(tmp_path, size):
    data = payload(size)
    path = tmp_path / "f"
    # Unaligned pieces force the bounce path; the chunk size forces several requests in flight.
    stats = write_file(path, [data[: size // 3], data[size // 3 :]], chunk_size=64 * 1024, depth=4)
    assert stats.bytes == size and os.path.getsize(path) == size
    assert path.read_bytes() == data
    buf, n = read_file(path)
    assert n == size and bytes(buf.view[:n]) == data


def test_aligned_source_is_written_in_place(tmp_path):
    size = 5 * 1024 * 1024 + 123  # unaligned tail is padded then truncated away
    hb = HostBuffer(size)
    hb.array[:size] = np.frombuffer(payload(size, 1), dtype=np.uint8)
    st = write_file(tmp_path / "f", [hb.view[:size]], chunk_size=1 << 20)
    assert st.direct, "ext4/xfs accept O_DIRECT; this engine must use it"
    assert (tmp_path / "f").read_bytes() == bytes(hb.view[:size])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300_000), st.integers(0, 300_000), st.integers(0, 4095))
def test_read_any_range_into_any_address(tmp_path_factory, a, b, shift):
    path = tmp_path_factory.getbasetemp() / "ranges.bin"
    if not path.exists():
        path.write_bytes(payload(300_001, 7))
    data = path.read_bytes()
    lo, hi = min(a, b), max(a, b)
    hb = HostBuffer(hi - lo + 4096)
    view = hb.view[shift : shift + hi - lo]  # congruent or not with the file offset
    read_into(path, lo, view, chunk_size=64 * 1024)
    assert bytes(view) == data[lo:hi]


def test_read_past_end_is_a_clear_error(tmp_path):
    p = tmp_path / "short"
    p.write_bytes(b"x" * 100)
    with pytest.raises(IntegrityError, match="truncated"):
        read_into(p, 50, bytearray(100))


def test_buffered_fallback_where_o_direct_is_refused(ramfs_dir):
    data = payload(100_000, 3)
    st = write_file(ramfs_dir / "f", [data])
    assert not st.direct  # ramfs refuses O_DIRECT: buffered, and the stats say so
    out = bytearray(len(data))
    assert not read_into(ramfs_dir / "f", 0, out).direct
    assert bytes(out) == data
    assert (ramfs_dir / "f").read_bytes() == data


def test_full_disk_is_typed_and_leaves_no_file(small_tmpfs):
    target = small_tmpfs / "big.bin"
    with pytest.raises(DiskFullError, match="no space left"):
        atomic_write(target, [payload(1 << 20)] * 80)  # 80 MiB into 64 MiB
    assert not target.exists()
    assert [p.name for p in small_tmpfs.iterdir()] == []  # temp file removed too


def test_missing_and_unwritable_paths(tmp_path, readonly_dir):
    with pytest.raises(NotFoundError, match="nope"):
        read_file(tmp_path / "nope")
    with pytest.raises(PermissionDeniedError, match="permission denied"):
        atomic_write(readonly_dir / "x", [b"abc"])
    assert list(readonly_dir.iterdir()) == []


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    p = tmp_path / "m.json"
    atomic_write(p, [b"old"])

    class Boom(Exception):
        pass

    def pieces():
        yield b"new-partial"
        raise Boom

    with pytest.raises(Boom):
        atomic_write(p, pieces())
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.json"]


def test_copy_sees_every_chunk(tmp_path):
    data = payload(1_000_003, 5)
    (tmp_path / "a").write_bytes(data)
    seen = {}
    copy_file(tmp_path / "a", tmp_path / "b", chunk_size=65536, on_chunk=lambda off, b: seen.__setitem__(off, xxh3(b)))
    assert (tmp_path / "b").read_bytes() == data
    assert all(seen[off] == xxh3(data[off : off + 65536]) for off in seen) and len(seen) == -(-len(data) // 65536)
    atomic_copy(tmp_path / "a", tmp_path / "sub" / "c")
    assert (tmp_path / "sub" / "c").read_bytes() == data


def test_writer_abort_removes_file(tmp_path):
    w = FileWriter(tmp_path / "x")
    w.write(b"abc" * 10000)
    w.abort()
    assert not (tmp_path / "x").exists()


def test_checksum_mismatch_names_the_place():
    verify(b"hello", xxh3(b"hello"), "file f chunk 0")
    with pytest.raises(IntegrityError, match="file f chunk 3"):
        verify(b"hellp", xxh3(b"hello"), "file f chunk 3")


def test_buffer_pool_reuses_and_respects_budget():
    pool = BufferPool(budget_bytes=3 * 4096)
    a = pool.acquire(4096)
    b = pool.acquire(8192)
    with pytest.raises(TimeoutError):
        pool.acquire(4096, timeout=0.05)
    pool.release(a)
    assert pool.acquire(100) is a  # the same pages, already faulted in
    pool.release(b)
    with pytest.raises(Exception, match="budget"):
        pool.acquire(1 << 20)


def test_shared_pools_are_per_process():
    """A forked child must not inherit a pool whose buffers a parent thread holds (it would wait forever)."""
    from tierio.io.buffers import shared_pool

    pool = shared_pool("test", 4096)
    assert shared_pool("test", 4096) is pool
    held = pool.acquire(4096)  # the whole budget, held by "a parent thread"
    pid = os.fork()
    if pid == 0:  # the child gets a fresh pool and its acquire returns at once
        fresh = shared_pool("test", 4096)
        os._exit(0 if fresh is not pool and fresh.acquire(4096, timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    pool.release(held)
    assert os.waitstatus_to_exitcode(status) == 0


def test_token_bucket_limits_long_run_rate():
    tb = TokenBucket(rate=10e6, burst=1e6)
    t0 = time.monotonic()
    for _ in range(5):
        tb.consume(1_000_000)
    # 5 MB at 10 MB/s with a 1 MB burst needs at least ~0.4 s of waiting in total.
    assert time.monotonic() - t0 >= 0.35
    assert TokenBucket(None).consume(10**12) == 0.0


def test_stats_are_recorded(tmp_path):
    write_file(tmp_path / "s", [b"x" * 10])
    assert recent("write")[-1].target.endswith("/s")
