"""The optional accelerator tier, with ``device="cpu"`` standing in for accelerator memory: the
same slot pool, routing, eviction into DRAM, prefetch up into it and ledger rules as on a GPU.
(The CUDA side-stream copies themselves need a GPU; see docs/kv.md.)"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from kv_helpers import LAYOUT, NS, assert_clean, block_of, config, put_chain, read_back, tokens
from tierio.errors import ConfigError
from tierio.kv import KVCache, KVConfig, KVTier

DEVICE, DRAM, NVME = KVTier.DEVICE, KVTier.DRAM, KVTier.NVME
B = LAYOUT.block_bytes  # 8 KiB: slots are the block size, so budgets below are whole blocks
NO_CUDA = not torch.cuda.is_available()


@contextmanager
def failing_copies(after=None):
    """What a device tier's copies meet when the accelerator faults: torch raises RuntimeError."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    yield


def dcache(nvme=None, *, device_blocks: int = 4, dram_blocks: int = 16, **kw) -> KVCache:
    return KVCache(LAYOUT, NS, config(nvme, dram_blocks=dram_blocks, device_bytes=device_blocks * B, device="cpu",
                                      **kw))


def test_puts_land_in_the_device_tier_and_gets_copy_out_of_it():
    with dcache(device_blocks=8) as c:
        keys = c.hash_blocks(tokens(4))
        put_chain(c, keys)
        assert c.lookup(keys).tiers == [DEVICE] * 4
        assert read_back(c, keys) == (4, [DEVICE] * 4)
        per_block = [torch.zeros(LAYOUT.shape, dtype=torch.float16) for _ in keys]
        assert c.get(keys, per_block).result().tiers == [DEVICE] * 4
        assert all(np.array_equal(t.view(torch.uint8).reshape(-1).numpy(), block_of(k))
                   for t, k in zip(per_block, keys, strict=True))
        st = c.stats()
        assert [t.tier for t in st.tiers] == [DEVICE, DRAM] and st.device == "cpu"
        assert (st.tiers[0].slots, st.tiers[0].used, st.tiers[1].used) == (8, 4, 0)
        assert st.counters.served_device == 8 and st.counters.served_dram == 0
        assert "device=8 blocks" in repr(c)
        assert_clean(c)


def test_a_full_device_tier_writes_its_least_recently_used_blocks_down_into_dram():
    with dcache(device_blocks=4, dram_blocks=16) as c:
        keys = c.hash_blocks(tokens(10))
        put_chain(c, keys)  # longer than the device tier: its own first blocks go down, none is lost
        c.wait()
        st = c.stats()
        device, dram = st.tiers
        assert device.used <= 4 and device.used + dram.used >= 10
        assert st.counters.demoted >= 6 and st.counters.dropped == 0 and st.counters.put_dropped == 0
        tiers = c.lookup(keys).tiers
        assert len(tiers) == 10 and set(tiers) == {DEVICE, DRAM}
        assert read_back(c, keys)[0] == 10
        assert_clean(c)


def test_pinned_device_blocks_are_never_written_down():
    with dcache(device_blocks=4, dram_blocks=16) as c:
        a = c.hash_blocks(tokens(2, seed=1))
        put_chain(c, a)
        with c.lease(a) as n:
            assert n == 2
            for seed in range(2, 6):
                put_chain(c, c.hash_blocks(tokens(4, seed=seed)))
            c.wait()
            assert c.lookup(a).tiers == [DEVICE, DEVICE]
        assert_clean(c)


def test_without_dram_room_a_device_tier_is_refused():
    with pytest.raises(ConfigError, match="device tier moves blocks through DRAM"):
        KVCache(LAYOUT, NS, KVConfig(dram_bytes=B, device_bytes=4 * B, device="cpu"))


def test_device_blocks_reach_nvme_on_close_and_the_next_process_finds_them(tmp_path):
    keys = None
    with dcache(tmp_path, device_blocks=8, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(4))
        put_chain(c, keys)
        assert c.lookup(keys).tiers == [DEVICE] * 4
    with KVCache(LAYOUT, NS, config(tmp_path, dram_blocks=8)) as c:  # a process without a device tier
        assert c.lookup(keys).tiers == [NVME] * 4
        assert read_back(c, keys) == (4, [NVME] * 4)


def test_flush_copies_device_blocks_down_and_keeps_them_on_the_device(tmp_path):
    with dcache(tmp_path, device_blocks=8, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(4))
        put_chain(c, keys)
        assert c.flush() == 4
        st = c.stats()
        assert [t.used for t in st.tiers] == [4, 4, 4] and st.counters.demoted == 4
        assert c.lookup(keys).tiers == [DEVICE] * 4
        assert_clean(c)


def test_prefetch_lifts_a_chain_from_nvme_through_dram_into_the_device_tier(tmp_path):
    with dcache(tmp_path, device_blocks=8, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(4))
        put_chain(c, keys)
        c.flush()
        assert c.evict(keys, DEVICE) == 4 and c.evict(keys, DRAM) == 4
        assert c.lookup(keys).tiers == [NVME] * 4
        res = c.prefetch(keys, into=DEVICE).result()
        assert (res.moved, res.failed) == (4, 0)
        assert c.lookup(keys).tiers == [DEVICE] * 4
        assert read_back(c, keys)[0] == 4
        again = c.prefetch(keys, into=DEVICE).result()
        assert again.present == 4
        assert c.evict(keys, DEVICE) == 4 and c.evict(keys, DRAM) == 4
        assert c.prefetch(keys).result().moved == 4  # the default stops in DRAM
        assert c.lookup(keys).tiers == [DRAM] * 4
        with pytest.raises(ConfigError, match="into DRAM or the device tier"):
            c.prefetch(keys, into=NVME)
        assert_clean(c)


def test_without_a_device_tier_a_prefetch_into_it_stops_in_dram(tmp_path):
    with KVCache(LAYOUT, NS, config(tmp_path, dram_blocks=8, admit_uses=1)) as c:
        keys = c.hash_blocks(tokens(3))
        put_chain(c, keys)
        c.flush()
        c.evict(keys, DRAM)
        assert c.prefetch(keys, into=DEVICE).result().moved == 3
        assert c.lookup(keys).tiers == [DRAM] * 3


def test_a_host_destination_reads_dram_before_the_device_tier(tmp_path):
    with dcache(tmp_path, device_blocks=8, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(3))
        put_chain(c, keys)
        c.flush()  # now on the device, in DRAM and on NVMe
        assert read_back(c, keys) == (3, [DRAM] * 3)
        assert c.lookup(keys).tiers == [DEVICE] * 3


@pytest.mark.skipif(not NO_CUDA, reason="checks the machine without CUDA")
def test_without_cuda_the_default_device_tier_is_off_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tierio.kv"):
        c = KVCache(LAYOUT, NS, KVConfig(dram_bytes=8 * B, device_bytes=4 * B))
    with c:
        assert c.device is None
        keys = c.hash_blocks(tokens(2))
        put_chain(c, keys)
        assert c.lookup(keys).tiers == [DRAM, DRAM]
        st = c.stats()
        assert st.device is None and [t.tier for t in st.tiers] == [DRAM]
        assert any("CUDA is not available" in n for n in st.notes)
    assert sum("CUDA is not available" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("device, match", [
    pytest.param("cuda:7", "sees .* CUDA device", marks=pytest.mark.skipif(
        not NO_CUDA and torch.cuda.device_count() > 7, reason="this machine has a cuda:7")),
    ("nonsense", "not a torch device name"),
    ("meta", "runs on CUDA devices"),
    ("", "must name a torch device"),
])
def test_a_device_that_is_not_there_is_a_config_error(device, match):
    with pytest.raises(ConfigError, match=match):
        KVCache(LAYOUT, NS, KVConfig(dram_bytes=8 * B, device_bytes=4 * B, device=device))


def test_bad_device_budgets_are_config_errors():
    with pytest.raises(ConfigError, match="device_bytes"):
        KVConfig(device_bytes=-1)
    with pytest.raises(ConfigError, match="device_bytes"):
        KVConfig(device_bytes=True)
    # a budget smaller than one block asks for nothing: no tier, no warning
    with KVCache(LAYOUT, NS, KVConfig(dram_bytes=8 * B, device_bytes=B - 1, device="cpu")) as c:
        assert c.device is None and c.stats().notes == []


def test_a_failed_copy_into_or_out_of_the_device_tier_is_a_miss_and_nothing_leaks():
    with dcache(device_blocks=4, dram_blocks=8) as c:
        assert c.device is not None
        keys = c.hash_blocks(tokens(2))
        put_chain(c, keys)
        working = c.device.copying
        c.device.copying = failing_copies  # every copy to or from a slot now fails
        assert read_back(c, keys) == (0, [])
        fresh = c.hash_blocks(tokens(3, seed=5))
        res = c.put(fresh, [block_of(k) for k in fresh]).result()
        assert (res.stored, res.dropped) == (0, 3)
        st = c.stats()
        assert st.counters.io_errors >= 2 and st.counters.missed == 2 and st.counters.put_dropped == 3
        assert c.lookup(fresh).blocks == 0
        assert_clean(c)
        c.device.copying = working  # the device works again: serving goes on
        assert read_back(c, keys) == (2, [DEVICE, DEVICE])
        put_chain(c, fresh)
        assert read_back(c, fresh) == (3, [DEVICE] * 3)
        assert_clean(c)


def test_a_device_write_down_that_fails_keeps_the_device_copy_and_the_bookkeeping(tmp_path):
    with dcache(tmp_path, device_blocks=8, dram_blocks=8, admit_uses=1) as c:
        keys = c.hash_blocks(tokens(3))
        put_chain(c, keys)
        assert c.device is not None
        working = c.device.copying
        c.device.copying = failing_copies
        assert c.flush() == 0  # each copy down into DRAM fails: counted, its DRAM slot given back
        st = c.stats()
        assert st.counters.io_errors >= 1 and st.counters.demoted == 0
        assert [t.used for t in st.tiers] == [3, 0, 0]
        assert_clean(c)
        c.device.copying = working
        assert c.flush() == 3
        assert read_back(c, keys)[0] == 3
        assert_clean(c)


@pytest.mark.skipif(not NO_CUDA, reason="checks the machine without CUDA")
def test_the_benchmark_names_why_it_skips_the_device_tier():
    from tierio.bench.kv import device_unavailable

    assert device_unavailable() == "CUDA is not available: there is no device tier to measure"


def test_a_prefix_cache_with_a_device_tier_generates_the_same_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tierio.integrations.hf_kv import PrefixCache, greedy_generate, layout_for

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024)).eval()
    block = layout_for(model, 16).block_bytes
    ids = torch.randint(0, 500, (1, 100), generator=torch.Generator().manual_seed(1))
    cfg = KVConfig(dram_bytes=4 * block, device_bytes=3 * block, device="cpu", nvme_dir=tmp_path,
                   nvme_bytes=1 << 20, slab_bytes=64 << 10, admit_uses=1)
    reference = greedy_generate(model, ids, 12).tokens
    with PrefixCache.open(model, cfg, block_tokens=16) as pc:
        cold, warm = pc.generate(ids, 12), pc.generate(ids, 12)
        assert (cold.cached_tokens, warm.cached_tokens) == (0, 96)
        assert cold.tokens == warm.tokens == reference
        c = pc.kv.stats().counters
        assert c.demoted > 0 and c.served == 6
    with PrefixCache.open(model, cfg, block_tokens=16) as pc:  # restarted: the blocks come back from NVMe
        again = pc.generate(ids, 12)
        assert again.cached_tokens == 96 and again.tokens == reference
        assert pc.kv.stats().counters.served_nvme == 6
