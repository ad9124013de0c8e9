"""Shared pieces of the KV tests: a small layout, blocks whose bytes derive from their key (so
any block read back can be checked without remembering it), and caches over real directories."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tierio.kv import BlockLayout, KVCache, KVConfig, Namespace

LAYOUT = BlockLayout(layers=2, kv_heads=2, head_dim=32, dtype="float16", tokens=16)  # 8 KiB blocks
NS = Namespace("kv-test-model")


def block_of(key: bytes, nbytes: int = LAYOUT.block_bytes) -> np.ndarray:
    """The bytes a test stores under ``key``: the key repeated."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), nbytes)


def tokens(n_blocks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * LAYOUT.tokens)


def config(nvme: Path | None = None, *, dram_blocks: int = 8, nvme_blocks: int = 64, **kw) -> KVConfig:
    b = LAYOUT.block_bytes
    extra = {"nvme_dir": nvme, "nvme_bytes": nvme_blocks * b, "slab_bytes": 16 * b} if nvme is not None else {}
    return KVConfig(dram_bytes=dram_blocks * b, **{**extra, **kw})


def cache(nvme: Path | None = None, **kw) -> KVCache:
    return KVCache(LAYOUT, NS, config(nvme, **kw))


def put_chain(c: KVCache, keys: list[bytes]) -> None:
    res = c.put(keys, [block_of(k) for k in keys]).result()
    assert res.dropped == 0, res


def read_back(c: KVCache, keys: list[bytes]) -> tuple[int, list]:
    """(blocks delivered, their tiers), asserting every delivered block holds its own bytes."""
    out = np.zeros(len(keys) * LAYOUT.block_bytes, dtype=np.uint8)
    res = c.get(keys, out).result()
    for i in range(res.blocks):
        got = out[i * LAYOUT.block_bytes:(i + 1) * LAYOUT.block_bytes]
        assert np.array_equal(got, block_of(keys[i])), f"block {i} holds the wrong bytes"
    return res.blocks, res.tiers


def assert_clean(c: KVCache) -> None:
    """No broken invariant, no pin, no reader, no lock left behind (once write-downs finish)."""
    c.wait()
    assert c.check() == []
    st = c.stats()
    assert st.pinned == 0 and st.reading == 0, st
