"""The transformers integration on tiny random-initialised Llama models (built from a config, never
downloaded): greedy generations are token-for-token identical with and without tierio, prefixes
are reused across turns and processes, and another model's blocks never hit."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from tierio.errors import ConfigError
from tierio.integrations.hf_kv import PrefixCache, greedy_generate, layout_for, model_identity, namespace_for
from tierio.kv import KVCache, KVConfig, KVTier

transformers = pytest.importorskip("transformers")

BLOCK = 16


def tiny_llama(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def test_greedy_generations_are_identical_with_and_without_tierio():
    model = tiny_llama()
    ids = prompt(100)
    reference = greedy_generate(model, ids, 24).tokens
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=24, do_sample=False)[0, 100:].tolist()
    assert reference == hf
    with PrefixCache.open(model, KVConfig(dram_bytes=1 << 20), block_tokens=BLOCK) as pc:
        cold = pc.generate(ids, 24)
        warm = pc.generate(ids, 24)
        assert (cold.cached_tokens, warm.cached_tokens) == (0, 96)  # whole blocks, last token recomputed
        assert cold.tokens == warm.tokens == reference
        longer = torch.cat([ids, prompt(40, seed=2)], dim=1)
        more = pc.generate(longer, 24)
        assert more.cached_tokens == 96 and more.tokens == greedy_generate(model, longer, 24).tokens
        exact = pc.generate(longer[:, :128], 8)  # a prompt of whole blocks: its last block is recomputed
        assert exact.cached_tokens == 112 and exact.tokens == greedy_generate(model, longer[:, :128], 8).tokens


def test_bfloat16_models_round_trip_bit_exact():
    model = tiny_llama(dtype=torch.bfloat16)
    ids = prompt(70)
    with PrefixCache.open(model, KVConfig(dram_bytes=1 << 20), block_tokens=BLOCK) as pc:
        assert pc.layout.dtype == "bfloat16"
        pc.generate(ids, 4)
        pre = pc.prefill(ids, store=False)
        assert pre.cached_tokens == 64
        ref = transformers.DynamicCache()
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.no_grad():
            model(ids[:, :64], use_cache=True, **{name: ref})
        from tierio.integrations.hf_kv import cache_layers

        for (k, v), (rk, rv) in zip(cache_layers(pre.cache), cache_layers(ref), strict=True):
            assert torch.equal(k[:, :, :64], rk) and torch.equal(v[:, :, :64], rv)


def test_conversations_resume_from_nvme_in_a_new_cache(tmp_path):
    model = tiny_llama()
    cfg = KVConfig(dram_bytes=2 * layout_for(model, BLOCK).block_bytes, nvme_dir=tmp_path,
                   nvme_bytes=1 << 20, slab_bytes=64 << 10, admit_uses=1)
    system = prompt(48, seed=7)
    turn1 = torch.cat([system, prompt(20, seed=8)], dim=1)
    with PrefixCache.open(model, cfg, block_tokens=BLOCK) as pc:
        a1 = pc.generate(turn1, 12)
        turn2 = torch.cat([turn1, torch.tensor([a1.tokens]), prompt(10, seed=9)], dim=1)
        a2 = pc.generate(turn2, 12)
        assert a2.cached_tokens == 64  # turn 1's whole blocks
        assert a2.tokens == greedy_generate(model, turn2, 12).tokens
    turn3 = torch.cat([turn2, torch.tensor([a2.tokens]), prompt(10, seed=10)], dim=1)
    with PrefixCache.open(model, cfg, block_tokens=BLOCK) as pc:  # a restarted server: DRAM empty
        a3 = pc.generate(turn3, 12)
        assert a3.cached_tokens == 80  # the 5 whole blocks of turn 2's prompt
        assert pc.kv.stats().counters.served_nvme == 5
        assert a3.tokens == greedy_generate(model, turn3, 12).tokens
    big = replace(cfg, dram_bytes=16 * layout_for(model, BLOCK).block_bytes)
    with PrefixCache.open(model, big, block_tokens=BLOCK) as pc:  # the user is back: bring the chain up first
        assert pc.prefetch(turn3).result().moved == 6  # turn 3 stored its sixth block
        again = pc.generate(turn3, 12)
        c = pc.kv.stats().counters
        assert again.cached_tokens == 96 and (c.served_dram, c.served_nvme) == (6, 0)
        assert again.tokens == a3.tokens


def test_another_model_never_hits_the_same_tier(tmp_path):
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)  # same config, different weights
    assert model_identity(a) != model_identity(b)
    assert model_identity(a) == model_identity(tiny_llama(seed=0))
    cfg = KVConfig(dram_bytes=1 << 20, nvme_dir=tmp_path, nvme_bytes=1 << 20, slab_bytes=64 << 10, admit_uses=1)
    ids = prompt(80)
    with PrefixCache.open(a, cfg, block_tokens=BLOCK) as pc:
        pc.generate(ids, 2)
    with PrefixCache.open(b, cfg, block_tokens=BLOCK) as pc:
        assert pc.kv.lookup(pc.kv.hash_blocks(ids[0])).blocks == 0
        assert pc.generate(ids, 2).cached_tokens == 0
    with PrefixCache.open(a, cfg, block_tokens=BLOCK, salt="tenant-2") as pc:  # nor another tenant
        assert pc.generate(ids, 2).cached_tokens == 0
    with PrefixCache.open(a, cfg, block_tokens=BLOCK) as pc:
        hit = pc.kv.lookup(pc.kv.hash_blocks(ids[0]))
        assert hit.blocks == 5 and set(hit.tiers) == {KVTier.NVME}


def test_layouts_that_do_not_fit_are_refused():
    model = tiny_llama()
    lay = layout_for(model, BLOCK)
    assert (lay.layers, lay.kv_heads, lay.head_dim, lay.dtype) == (2, 2, 16, "float32")
    other = KVCache(replace(lay, kv_heads=4), namespace_for(model), KVConfig(dram_bytes=1 << 20))
    with pytest.raises(ConfigError, match="layout"):
        PrefixCache(model, other)
    other.close()
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=8))
    with pytest.raises(ConfigError, match="sliding-window"):
        layout_for(mistral)


def test_old_import_paths_warn_and_still_work() -> None:
    import tierio.integrations.hf_kv as hf_kv
    import tierio.kv
    import tierio.kv.hf as old

    with pytest.warns(DeprecationWarning, match="tierio.integrations.hf_kv"):
        assert old.PrefixCache is hf_kv.PrefixCache
    with pytest.warns(DeprecationWarning, match="KVTier"):
        assert tierio.kv.Tier is KVTier
    assert "Tier" not in tierio.kv.__all__
