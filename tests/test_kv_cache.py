"""The KV router on real DRAM slots and real slab files: puts, lookups, gets, write-downs,
admission, prefix-aware eviction, pins, prefetch, the decode-latency rule, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_helpers import LAYOUT, NS, assert_clean, block_of, cache, config, put_chain, read_back, tokens
from tierio.errors import ConfigError, StorageError
from tierio.kv import DecodeSLA, KVCache, KVConfig, KVTier

DRAM, NVME = KVTier.DRAM, KVTier.NVME


def test_put_lookup_get_in_dram():
    with cache() as c:
        keys = c.hash_blocks(tokens(4))
        assert c.lookup(keys).blocks == 0
        put_chain(c, keys)
        hit = c.lookup(keys)
        assert (hit.blocks, hit.tokens, hit.tiers) == (4, 4 * LAYOUT.tokens, [DRAM] * 4)
        assert read_back(c, keys) == (4, [DRAM] * 4)
        again = c.put(keys, [block_of(k) for k in keys]).result()
        assert (again.stored, again.already_cached) == (0, 4)
        # a longer prompt with the same start hits its prefix only
        longer = c.hash_blocks(np.concatenate([tokens(4), tokens(2, seed=9)]))
        assert c.lookup(longer).blocks == 4
        assert read_back(c, longer) == (4, [DRAM] * 4)
        assert_clean(c)


def test_blocks_accept_tensors_of_any_dtype_and_one_buffer_for_many():
    with cache() as c:
        keys = c.hash_blocks(tokens(3))
        src = torch.randn(3, *LAYOUT.shape).to(torch.float16)
        assert c.put(keys, src).result().stored == 3
        out = torch.zeros_like(src)
        assert c.get(keys, out).result().blocks == 3
        assert torch.equal(out, src)
        per_block = [torch.zeros(LAYOUT.shape, dtype=torch.float16) for _ in keys]
        assert c.get(keys, per_block).result().blocks == 3
        assert all(torch.equal(a, b) for a, b in zip(per_block, src, strict=True))


def test_blocks_leaving_dram_go_to_nvme_and_come_back_verified(tmp_path):
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(20))
        put_chain(c, keys)
        c.wait()
        tiers = c.lookup(keys).tiers
        assert len(tiers) == 20 and NVME in tiers and DRAM in tiers
        n, got = read_back(c, keys)
        assert n == 20 and got.count(NVME) >= 12
        st = c.stats()
        assert st.counters.written_down >= 12 and st.counters.integrity_errors == 0
        assert [t.tier for t in st.tiers] == [DRAM, NVME]
        assert_clean(c)


def test_frequency_filter_keeps_one_off_blocks_off_the_nvme(tmp_path):
    with cache(tmp_path, dram_blocks=8, admit_uses=2) as c:
        once = c.hash_blocks(tokens(20, seed=1))
        put_chain(c, once)  # stored once, never read: one-off blocks
        c.wait()
        st = c.stats()
        assert st.counters.written_down == 0 and st.counters.not_admitted >= 12
        assert st.tiers[1].used == 0
        # the same blocks, computed and stored again: their second use admits them
        put_chain(c, once)
        c.flush()
        assert c.stats().counters.written_down > 0
        assert c.lookup(once).blocks == 20


def test_eviction_takes_the_tail_of_a_chain_before_its_head():
    with cache(dram_blocks=8) as c:
        a = c.hash_blocks(tokens(6, seed=1))
        b = c.hash_blocks(tokens(4, seed=2))
        put_chain(c, a)
        put_chain(c, b)  # 2 slots short: two of a's blocks must go
        assert c.lookup(a).blocks == 4  # a's head survives, its last two blocks left
        assert c.lookup(b).blocks == 4
        assert_clean(c)


def test_leased_blocks_are_not_evicted():
    with cache(dram_blocks=8) as c:
        a = c.hash_blocks(tokens(6, seed=1))
        b = c.hash_blocks(tokens(8, seed=2))
        put_chain(c, a)
        with c.lease(a) as n:
            assert n == 6
            res = c.put(b, [block_of(k) for k in b]).result()
            assert (res.stored, res.dropped) == (2, 6)  # only the free slots: the rest of b is dropped
            assert c.lookup(a).blocks == 6
        assert c.stats().pinned == 0
        put_chain(c, b)
        assert c.lookup(b).blocks == 8
        assert_clean(c)


def test_a_lease_is_released_when_its_block_raises():
    with cache() as c:
        keys = c.hash_blocks(tokens(2))
        put_chain(c, keys)
        with pytest.raises(RuntimeError), c.lease(keys):
            raise RuntimeError("engine failed")
        assert_clean(c)


def test_watermarks_write_down_in_the_background(tmp_path):
    cfg = config(tmp_path, dram_blocks=10, admit_uses=1)
    from dataclasses import replace

    from tierio.kv import Watermarks

    with KVCache(LAYOUT, NS, replace(cfg, watermarks=Watermarks(high=0.8, low=0.5))) as c:
        keys = c.hash_blocks(tokens(9))
        put_chain(c, keys)
        c.wait()
        dram, nvme = c.stats().tiers
        assert dram.used <= 5 and nvme.used >= 4
        assert c.lookup(keys).blocks == 9
        assert_clean(c)


def test_prefetch_brings_a_chain_up_from_nvme(tmp_path):
    with cache(tmp_path, dram_blocks=16, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(10))
        put_chain(c, keys)
        c.flush()
        assert c.evict(keys, DRAM) == 10
        assert c.lookup(keys).tiers == [NVME] * 10
        late = c.prefetch(keys, deadline_s=0.0).result()
        assert late.late == 10 and late.moved == 0
        res = c.prefetch(keys, deadline_s=60).result()
        assert (res.moved, res.present, res.failed) == (10, 0, 0)
        assert c.lookup(keys).tiers == [DRAM] * 10
        assert read_back(c, keys) == (10, [DRAM] * 10)
        assert c.prefetch(keys).result().present == 10
        assert c.stats().counters.prefetched == 10
        assert_clean(c)


def test_gets_racing_a_prefetch_get_every_block_once(tmp_path):
    with cache(tmp_path, dram_blocks=32, nvme_blocks=64, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(24))
        put_chain(c, keys)
        c.flush()
        c.evict(keys, DRAM)
        pending = c.prefetch(keys)
        n, tiers = read_back(c, keys)  # uses early blocks while later ones may still be arriving
        assert n == 24 and set(tiers) <= {DRAM, NVME}
        assert pending.result().failed == 0
        assert_clean(c)


def test_decode_sla_decides_whether_nvme_serves(tmp_path):
    with cache(tmp_path, dram_blocks=8, admit_uses=1, fetch_latency_s=200e-6) as c:
        keys = c.hash_blocks(tokens(6))
        put_chain(c, keys)
        c.flush()
        c.evict(keys[2:], DRAM)
        assert c.lookup(keys).tiers == [DRAM, DRAM, NVME, NVME, NVME, NVME]
        relaxed = c.lookup(keys, DecodeSLA(decode_latency_s=30e-3))
        assert relaxed.blocks == 6 and relaxed.rule is not None and relaxed.rule.viable
        tight = c.lookup(keys, DecodeSLA(decode_latency_s=1e-6))
        assert tight.blocks == 2 and tight.rule is not None and not tight.rule.viable


def test_flush_and_close_persist_and_evict_drops(tmp_path):
    with cache(tmp_path, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(5))
        put_chain(c, keys)
        assert c.flush() == 5
        assert c.flush() == 0
        assert c.evict(keys) == 10  # a DRAM and an NVMe copy each
        assert c.lookup(keys).blocks == 0
        assert_clean(c)


def test_bad_arguments_are_config_errors(tmp_path):
    with cache() as c:
        keys = c.hash_blocks(tokens(2))
        put_chain(c, keys)
        with pytest.raises(ConfigError, match="read-only"):
            c.get(keys, bytes(2 * LAYOUT.block_bytes))
        with pytest.raises(ConfigError, match="holds"):
            c.get(keys, np.zeros(LAYOUT.block_bytes, np.uint8))
        with pytest.raises(ConfigError, match="buffers for"):
            c.put(keys, [block_of(keys[0])])
        with pytest.raises(ConfigError, match="non-contiguous"):
            c.put(keys[:1], torch.zeros(LAYOUT.shape, dtype=torch.float16).transpose(0, 4))
    with pytest.raises(StorageError, match="closed"):
        c.get(keys, np.zeros(2 * LAYOUT.block_bytes, np.uint8))
    with pytest.raises(ConfigError, match="at least"):
        KVCache(LAYOUT, NS, KVConfig(dram_bytes=0, nvme_dir=tmp_path, nvme_bytes=1 << 20))
    with pytest.raises(ConfigError):
        KVConfig(nvme_bytes=1 << 20)
    with pytest.raises(ConfigError):
        KVConfig(dram_bytes=-1)


def test_sizes_take_text_and_the_cache_takes_overrides(tmp_path) -> None:
    from tierio.kv import Move, PrefetchResult

    assert KVConfig(dram_bytes="64KiB").dram_bytes == 64 << 10
    with KVCache(LAYOUT, NS, KVConfig(dram_bytes=1 << 20), dram_bytes="128KiB") as c:
        assert c.config.dram_bytes == 128 << 10
        keys = c.hash_blocks(tokens(2))
        pending = c.put(keys, [block_of(k) for k in keys])
        assert pending.wait(timeout=30).stored == 2 and pending.done() and pending.result().stored == 2
        d = c.stats().to_dict()
        assert d["tiers"][0]["tier"] == "dram" and d["tiers"][0]["capacity_bytes"] == d["tiers"][0]["slots"] * \
            d["tiers"][0]["slot_bytes"]
    assert PrefetchResult.of([Move.MOVED, Move.LATE, Move.MOVED]) == PrefetchResult(2, 0, 1, 0)
