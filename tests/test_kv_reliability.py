"""Failure is a miss: restarts in other processes, kill -9, torn and flipped slots, truncated
slabs, a full disk, injected I/O errors and hostile tier files. Real processes, real files, a
real tmpfs; nothing is mocked. After each: nothing wrong delivered, nothing left pinned or locked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kv_helpers import LAYOUT, assert_clean, cache, put_chain, read_back, tokens
from tierio.errors import ConfigError, FormatError, StorageError
from tierio.kv import KVTier
from tierio.kv.tiers.slabindex import HEADER_NAME, INDEX_NAME, RECORD_BYTES, slab_name

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}

WRITER = """
import sys
from kv_helpers import cache, put_chain, tokens
with cache(sys.argv[1], dram_blocks=4, nvme_blocks=256, admit_uses=1) as c:
    for j in range(int(sys.argv[2])):
        put_chain(c, c.hash_blocks(tokens(4, seed=j)))
        print(j, flush=True)
"""

READER = """
import json, sys
from kv_helpers import cache, read_back, tokens, assert_clean
with cache(sys.argv[1], dram_blocks=4, nvme_blocks=256, admit_uses=1) as c:
    found = [read_back(c, c.hash_blocks(tokens(4, seed=j)))[0] for j in range(int(sys.argv[2]))]
    assert_clean(c)
    print(json.dumps({"found": found, "recovered": c.stats().counters.recovered}))
"""


def _run(code: str, *args, seed: str) -> str:
    env = {**ENV, "PYTHONHASHSEED": seed}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_the_next_process_reuses_the_nvme_tier_whatever_its_hash_seed(tmp_path):
    _run(WRITER, tmp_path, 12, seed="1")
    out = json.loads(_run(READER, tmp_path, 12, seed="2"))
    assert out["found"] == [4] * 12  # close() wrote the DRAM blocks down too
    assert out["recovered"] == 48


def test_after_kill_9_committed_blocks_come_back_verified(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "100000"], env={**ENV, "PYTHONHASHSEED": "3"},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # let it write a while: blocks leave its 4 DRAM slots for NVMe all along
            if int(line) >= 40:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with cache(tmp_path, dram_blocks=4, nvme_blocks=256, admit_uses=1) as c:
        recovered = c.stats().counters.recovered
        assert recovered >= 100
        delivered = 0
        for j in range(60):
            n, tiers = read_back(c, c.hash_blocks(tokens(4, seed=j)))  # asserts every delivered byte
            delivered += n
            assert set(tiers) <= {KVTier.NVME}
        assert delivered >= recovered - 8  # at most the blocks of the last writes in flight are lost
        assert c.stats().counters.integrity_errors == 0
        assert_clean(c)


def _nvme_only(tmp_path, n_chains=6):
    """A closed tier holding ``n_chains`` chains of 4 blocks; returns their keys."""
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        chains = [c.hash_blocks(tokens(4, seed=j)) for j in range(n_chains)]
        for keys in chains:
            put_chain(c, keys)
    return chains


def _slot_of(tmp_path, key: bytes) -> int:
    raw = (tmp_path / INDEX_NAME).read_bytes()
    for slot in range(len(raw) // RECORD_BYTES):
        if raw[slot * RECORD_BYTES + 8: slot * RECORD_BYTES + 24] == key:
            return slot
    raise AssertionError("key not in the index")


def _slot_offset(slot: int) -> tuple[Path, int]:
    per = 16  # kv_helpers.config: slabs of 16 blocks
    return Path(slab_name(slot // per)), (slot % per) * LAYOUT.block_bytes


def _flip(tmp_path, key: bytes, at: int = 1000) -> None:
    name, off = _slot_offset(_slot_of(tmp_path, key))
    with open(tmp_path / name, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_flipped_byte_is_a_miss_and_its_record_is_cleared(tmp_path, caplog):
    chains = _nvme_only(tmp_path)
    _flip(tmp_path, chains[2][1])
    _flip(tmp_path, chains[5][0], at=7)
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        assert c.lookup(chains[2]).blocks == 4  # the index still names it: only a read can tell
        n, _ = read_back(c, chains[2])
        assert n == 1  # the prefix stops at the damaged block: nothing after it is delivered
        assert read_back(c, chains[5]) == (0, [])
        st = c.stats().counters
        assert st.integrity_errors == 2 and st.missed == 7
        assert caplog.text.count("does not match its checksum") == 1  # warned once, counted each time
        assert c.lookup(chains[2]).blocks == 1
        for keys in chains[:2] + chains[3:5]:  # serving goes on
            assert read_back(c, keys)[0] == 4
        assert_clean(c)
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:  # the record went with it
        assert c.lookup(chains[2]).blocks == 1 and c.stats().counters.discarded == 0


def test_torn_records_are_discarded_when_the_tier_opens(tmp_path):
    chains = _nvme_only(tmp_path)
    slot = _slot_of(tmp_path, chains[4][0])
    with open(tmp_path / INDEX_NAME, "r+b") as f:  # a record half written when the machine died
        f.seek(slot * RECORD_BYTES + 30)
        f.write(os.urandom(20))
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        st = c.stats().counters
        assert st.discarded == 1 and st.recovered == 23
        assert c.lookup(chains[4]).blocks == 0
        assert all(read_back(c, k)[0] == 4 for i, k in enumerate(chains) if i != 4)
        assert_clean(c)


def test_a_truncated_slab_loses_only_the_slots_past_its_end(tmp_path):
    chains = _nvme_only(tmp_path, n_chains=8)  # 32 blocks: two slabs of 16
    os.truncate(tmp_path / slab_name(0), 10 * LAYOUT.block_bytes + 100)
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        st = c.stats().counters
        assert st.discarded == 6 and st.recovered == 26
        total = sum(read_back(c, k)[0] for k in chains)
        assert c.stats().counters.integrity_errors == 0 and total >= 20
        assert (tmp_path / slab_name(0)).stat().st_size == 16 * LAYOUT.block_bytes  # allocated again
        assert_clean(c)


def test_a_full_disk_shrinks_the_tier_and_serving_goes_on(small_tmpfs, caplog):
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f:
        f.truncate(0)
        os.posix_fallocate(f.fileno(), 0, 52 << 20)  # leaves ~12 MiB of the 64 MiB mount
    tier = small_tmpfs / "kv"
    with cache(tier, dram_blocks=8, nvme_blocks=4096, admit_uses=1) as c:  # asks for 32 MiB
        st = c.stats()
        assert st.counters.disk_full == 1 and 0 < st.tiers[1].slots < 4096
        assert any("no space" in n for n in st.notes) and "no space" in caplog.text
        chains = [c.hash_blocks(tokens(4, seed=j)) for j in range(400)]  # more than fits: evicts
        for keys in chains:
            put_chain(c, keys)
        assert read_back(c, chains[-1])[0] == 4
        assert_clean(c)
    for p in tier.iterdir():
        p.unlink()
    with open(filler, "ab", buffering=0) as f:  # now nothing at all is left
        for size in (1 << 20, 4096):
            try:
                while f.write(b"\0" * size):
                    pass
            except OSError:
                pass
    with cache(tier, dram_blocks=8, nvme_blocks=64, admit_uses=1) as c:
        assert c.nvme is None and c.stats().counters.disk_full == 1  # not even its header fits: DRAM only
        keys = c.hash_blocks(tokens(4))
        put_chain(c, keys)
        assert read_back(c, keys)[0] == 4
        assert_clean(c)


def test_an_io_error_on_a_slab_is_a_miss_and_serving_goes_on(tmp_path):
    chains = _nvme_only(tmp_path, n_chains=8)
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        assert c.nvme is not None
        broken = c.nvme.files[0]
        elsewhere = tmp_path.parent / "write-only"
        elsewhere.write_bytes(bytes(1 << 20))
        wfd = os.open(elsewhere, os.O_WRONLY)
        os.dup2(wfd, broken.fd)  # reads of slab 0 now fail in the kernel (EBADF)
        os.close(wfd)
        delivered = [read_back(c, keys)[0] for keys in chains]
        st = c.stats().counters
        assert st.io_errors >= 1 and sum(delivered) < 32
        # blocks in the other slab still come back; new blocks are still stored and served
        assert max(delivered) == 4
        fresh = [c.hash_blocks(tokens(4, seed=100 + j)) for j in range(10)]
        for keys in fresh:
            put_chain(c, keys)
        assert read_back(c, fresh[-1])[0] == 4
        c.wait()
        assert_clean(c)


def test_hostile_or_damaged_tier_files(tmp_path):
    chains = _nvme_only(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(os.urandom(64 * 96))  # garbage records
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        assert c.stats().counters.recovered == 0 and c.stats().counters.discarded > 0
        assert c.lookup(chains[0]).blocks == 0
        put_chain(c, chains[0])
        assert read_back(c, chains[0])[0] == 4
    for header in ("not json", json.dumps({"format": "tierio-kv-slab", "version": 1, "block_bytes": 10**40}),
                   json.dumps({"format": "tierio-kv-slab", "version": 1, "block_bytes": 8192, "slot_bytes": 8192,
                               "slots_per_slab": 1 << 30, "slabs": 1 << 30})):
        (tmp_path / HEADER_NAME).write_text(header)
        with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:  # a damaged header: the tier starts afresh
            assert c.stats().counters.recovered == 0 and any("afresh" in n for n in c.stats().notes)
            put_chain(c, chains[1])
    other = cache(tmp_path, dram_blocks=8, admit_uses=1)
    try:
        with pytest.raises(StorageError, match="in use by another process"):
            cache(tmp_path, dram_blocks=8)
    finally:
        other.close()
    from tierio.kv import BlockLayout, KVCache, KVConfig, Namespace

    big = BlockLayout(layers=4, kv_heads=2, head_dim=32, dtype="float16", tokens=16)
    with pytest.raises(ConfigError, match="own NVMe directory"):
        KVCache(big, Namespace("another"), KVConfig(dram_bytes=1 << 20, nvme_dir=tmp_path, nvme_bytes=1 << 20))


def test_a_symlink_planted_as_a_slab_is_not_followed(tmp_path):
    _nvme_only(tmp_path)
    outside = tmp_path.parent / "outside-target"
    outside.write_bytes(b"precious")
    (tmp_path / slab_name(0)).unlink()
    (tmp_path / slab_name(0)).symlink_to(outside)
    with pytest.raises(FormatError, match="symbolic link"):
        cache(tmp_path, dram_blocks=8)
    assert outside.read_bytes() == b"precious"
    # and the directory is free again for the next try
    (tmp_path / slab_name(0)).unlink()
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        assert c.nvme is not None


def test_a_block_leased_while_its_copy_leaves_keeps_it_when_the_write_below_fails(tmp_path):
    """The window a stress run once hit: a DRAM copy already leaving (its write to NVMe in flight)
    when a lease pins the block, then that write fails (a full disk). The lease still gets it."""
    from tierio.kv.entries import State

    with cache(tmp_path / "nvme", admit_uses=1) as c:
        keys = c.hash_blocks(tokens(1))
        put_chain(c, keys)
        led = c._ledger
        with c._lock:
            e = led._entries[keys[0]]
            job = led.start_write_down(e, KVTier.DRAM, evict=True)
            assert job is not None and e.dram.state is State.LEAVING
        with c.lease(keys) as n:
            assert n == 1
            with c._lock:
                led.finish_write_down(job, False, None, LAYOUT.block_bytes)  # the write below failed
            assert read_back(c, keys)[0] == 1
        assert_clean(c)


def test_a_block_leased_after_its_leaving_copy_was_written_keeps_it_while_a_reader_finishes(tmp_path):
    """The window behind the stress run's 'a leased prefix of N blocks delivered 0': a DRAM copy's
    write-down finished while a get still read it (so the copy stayed, to be freed by that reader),
    its NVMe copy was evicted, then a lease pinned the block on that leaving copy alone. The
    reader's end must not free the copy the lease was promised."""
    from tierio.kv.entries import State

    with cache(tmp_path / "nvme", admit_uses=1) as c:
        keys = c.hash_blocks(tokens(1))
        put_chain(c, keys)
        led = c._ledger
        with c._lock:
            e = led._entries[keys[0]]
            job = led.start_write_down(e, KVTier.DRAM, evict=True)
            _, read, _ = led.reader(keys[0])  # a get copying the leaving DRAM copy out
            assert read is e.dram and read.state is State.LEAVING
        c._write_down(job)  # lands on NVMe; the DRAM copy waits for its reader
        assert e.nvme is not None and e.dram is read
        assert c.evict(keys, KVTier.NVME) == 1  # not pinned yet: the NVMe copy may go
        with c.lease(keys) as n:
            assert n == 1
            with c._lock:
                led.unread(e, read)  # the get finishes
            assert read_back(c, keys)[0] == 1
        assert_clean(c)


def test_a_device_block_leased_after_its_write_down_found_no_dram_slot_keeps_it(tmp_path):
    """The same window in the device tier: a device copy's write-down found no DRAM slot (so the
    copy was to go once its reader finished) and a lease pinned the block before that reader did."""
    from tierio.kv.entries import State

    with cache(tmp_path / "nvme", admit_uses=1, device_bytes=4 * LAYOUT.block_bytes, device="cpu") as c:
        keys = c.hash_blocks(tokens(1))
        put_chain(c, keys)
        led = c._ledger
        with c._lock:
            e = led._entries[keys[0]]
            job = led.start_write_down(e, KVTier.DEVICE, evict=True)
            _, read, _ = led.reader(keys[0])
            assert read is e.device and read.state is State.LEAVING and e.dram is None
            led.finish_write_down(job, False, None, LAYOUT.block_bytes)  # no DRAM slot to be had
        with c.lease(keys) as n:
            assert n == 1
            with c._lock:
                led.unread(e, read)
            assert read_back(c, keys)[0] == 1
        assert_clean(c)
