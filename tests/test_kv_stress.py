"""Eight threads on one cache under a small budget: puts, gets, lookups, prefetches, evictions,
leases and flushes at once, for a bounded time. Every invariant holds throughout (checked while
they run), every delivered block holds its own bytes, nothing deadlocks, and the resident set does
not grow over 100,000 operations."""

from __future__ import annotations

import functools
import random
import threading
import time

import numpy as np
import pytest
import torch  # noqa: F401 - the I/O bounce pool's first buffer asks torch whether CUDA exists: import it before timing

from kv_helpers import assert_clean
from tierio.bench.common import rss_bytes
from tierio.kv import BlockLayout, KVCache, KVConfig, Namespace, KVTier

LAYOUT = BlockLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", tokens=4)  # 128-byte blocks, 4 KiB slots
THREADS = 8


def _cache(tmp_path, dram_blocks: int = 12, device_blocks: int = 0) -> KVCache:
    slot = 4096
    return KVCache(LAYOUT, Namespace("stress"), KVConfig(
        dram_bytes=dram_blocks * slot, nvme_dir=tmp_path, nvme_bytes=40 * slot, slab_bytes=8 * slot, admit_uses=2,
        io_timeout_s=10.0, device_bytes=device_blocks * slot, device="cpu"))


@functools.cache
def _block(key: bytes) -> np.ndarray:
    return np.resize(np.frombuffer(key, dtype=np.uint8), LAYOUT.block_bytes)


class Worker:
    """One thread's random mix of every call; records anything wrong it sees."""

    def __init__(self, c: KVCache, chains: list[list[bytes]], seed: int) -> None:
        self.c, self.chains, self.rng = c, chains, random.Random(seed)
        self.out = np.zeros(4 * LAYOUT.block_bytes, dtype=np.uint8)
        self.errors: list[str] = []
        self.ops = 0

    def verify(self, keys: list[bytes], n: int) -> None:
        for i in range(n):
            if not np.array_equal(self.out[i * LAYOUT.block_bytes:(i + 1) * LAYOUT.block_bytes], _block(keys[i])):
                self.errors.append(f"wrong bytes for block {i}")

    def step(self) -> None:
        keys = self.rng.choice(self.chains)
        op = self.rng.random()
        c = self.c
        if op < 0.3:
            c.put(keys, [_block(k) for k in keys]).result()
        elif op < 0.6:
            self.verify(keys, c.get(keys, self.out[:len(keys) * LAYOUT.block_bytes]).result().blocks)
        elif op < 0.75:
            c.lookup(keys)
        elif op < 0.85:
            c.prefetch(keys, deadline_s=1.0, into=self.rng.choice((KVTier.DRAM, KVTier.DEVICE))).result()
        elif op < 0.93:
            with c.lease(keys) as n:
                got = c.get(keys[:n], self.out[:n * LAYOUT.block_bytes]).result().blocks
                if got != n:
                    self.errors.append(f"a leased prefix of {n} blocks delivered {got}")
                self.verify(keys, got)
        elif op < 0.995:
            c.evict(keys)
        else:
            c.flush()
        self.ops += 1

    def run(self, until: float, max_ops: int) -> None:
        try:
            while time.monotonic() < until and self.ops < max_ops:
                self.step()
        except Exception as exc:  # noqa: BLE001 - reported by the test, with its type
            self.errors.append(f"{type(exc).__name__}: {exc}")


def _chains(c: KVCache) -> list[list[bytes]]:
    rng = np.random.default_rng(0)
    heads = [rng.integers(0, 1000, 4 * LAYOUT.tokens) for _ in range(24)]
    # chains share heads, as conversations share system prompts
    return [c.hash_blocks(heads[i % 24][: (1 + i % 4) * LAYOUT.tokens]) for i in range(64)]


def _run(c: KVCache, seconds: float, max_ops: int, watch) -> list[Worker]:
    workers = [Worker(c, _chains(c), seed) for seed in range(THREADS)]
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=w.run, args=(until, max_ops), daemon=True) for w in workers]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        watch()
        time.sleep(0.01)
        if time.monotonic() > until + 60:
            break
    for t in threads:
        t.join(timeout=1)
    assert not any(t.is_alive() for t in threads), "a thread is stuck: deadlock"
    return workers


def test_eight_threads_keep_every_invariant(small_tmpfs):
    c = _cache(small_tmpfs)
    seen: list[str] = []

    def watch():
        seen.extend(c.check())  # while the threads run: slots, counts, states all consistent

    workers = _run(c, seconds=3.0, max_ops=10**9, watch=watch)
    assert seen == []
    assert [e for w in workers for e in w.errors] == []
    assert sum(w.ops for w in workers) > 1000
    st = c.stats()
    assert all(t.used <= t.slots for t in st.tiers)
    assert st.counters.written_down > 0 and st.counters.served > 0 and st.counters.prefetched > 0
    assert_clean(c)
    c.close()


def test_eight_threads_with_a_device_tier_keep_every_invariant(small_tmpfs):
    # the device tier ("cpu" standing in for accelerator memory) above a DRAM tier it writes down to
    c = _cache(small_tmpfs, dram_blocks=10, device_blocks=6)
    seen: list[str] = []

    def watch():
        seen.extend(c.check())

    workers = _run(c, seconds=3.0, max_ops=10**9, watch=watch)
    assert seen == []
    assert [e for w in workers for e in w.errors] == []
    st = c.stats()
    assert [t.tier for t in st.tiers] == [KVTier.DEVICE, KVTier.DRAM, KVTier.NVME]
    assert all(t.used <= t.slots for t in st.tiers)
    assert st.counters.demoted > 0 and st.counters.served_device > 0 and st.counters.written_down > 0
    assert_clean(c)
    c.close()


@pytest.mark.slow
def test_resident_memory_does_not_grow_over_100k_operations(small_tmpfs):
    # a memory-backed filesystem and more DRAM (still less than the blocks in play): 100,000
    # operations in seconds, not minutes, through every path
    c = _cache(small_tmpfs, dram_blocks=48)
    samples: list[int] = []
    warm = _run(c, seconds=120, max_ops=20_000 // THREADS, watch=lambda: None)
    samples.append(rss_bytes())
    rest = _run(c, seconds=240, max_ops=80_000 // THREADS, watch=lambda: None)
    samples.append(rss_bytes())
    assert [e for w in warm + rest for e in w.errors] == []
    assert sum(w.ops for w in warm + rest) == 100_000
    assert samples[1] - samples[0] < 16 << 20, samples
    assert_clean(c)
    c.close()
