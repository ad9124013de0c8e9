"""KV identity (issue 25, item 11): a fine-tune never gets its base model's blocks, and a writer to
the shared store without the deployment's secret cannot serve other nodes its blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_helpers import assert_clean, cache, put_chain, read_back, tokens
from tierio.errors import ConfigError
from tierio.kv import KVTier
from tierio.kv.config import KVConfig
from tierio.kv.tiers.shared import HEADER_BYTES, block_checksum, object_key, pack_header

transformers = pytest.importorskip("transformers")

SECRET = "a-deployment-secret-of-32-bytes!"


def _llama() -> torch.nn.Module:
    # 16 layers of 9 tensors and tied embeddings: 146 parameters, where sampling every 9th lands
    # only on the embedding and the norms (the identity's old blind spot).
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=16,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_a_merged_lora_changes_the_model_identity():
    from tierio.integrations.hf_kv import model_identity

    base, tuned = _llama(), _llama()
    assert model_identity(base) == model_identity(tuned)  # same weights: same identity
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if any(f"{n}.weight" in name for n in projections):
                a, b = torch.randn(p.shape[0], 2), torch.randn(2, p.shape[1])
                p.add_(1e-3 * a @ b)  # what merging a rank-2 LoRA does
    assert model_identity(base) != model_identity(tuned)


def test_a_change_in_the_last_bytes_of_one_tensor_changes_the_identity():
    from tierio.integrations.hf_kv import model_identity

    model = _llama()
    before = model_identity(model)
    with torch.no_grad():
        model.model.layers[7].mlp.down_proj.weight.view(-1)[-1] += 1.0
    assert model_identity(model) != before


def test_blocks_without_a_valid_mac_are_misses(tmp_path):
    shared = tmp_path / "shared"
    writer = cache(tmp_path / "trusted", dram_blocks=8, admit_uses=1, shared_url=str(shared), shared_secret=SECRET)
    attacker = cache(tmp_path / "attacker", dram_blocks=8, admit_uses=1, shared_url=str(shared))
    try:
        good, forged = writer.hash_blocks(tokens(2, seed=1)), attacker.hash_blocks(tokens(2, seed=2))
        put_chain(writer, good)
        writer.flush()
        put_chain(attacker, forged)  # well-formed objects, right checksums, no MAC
        attacker.flush()
        assert attacker.stats().counters.uploaded == 2
        # the attacker also replaces one trusted block by a well-formed object of its own bytes
        data = np.frombuffer((shared / object_key(forged[1])).read_bytes()[HEADER_BYTES:], dtype=np.uint8)
        head = pack_header(good[1], data.nbytes, block_checksum(data))
        (shared / object_key(good[1])).write_bytes(head + data.tobytes())
    finally:
        writer.close()
        attacker.close()
    reader = cache(tmp_path / "reader", dram_blocks=8, shared_url=str(shared), shared_secret=SECRET)
    try:
        assert read_back(reader, good) == (1, [KVTier.SHARED])  # the first block, MAC'd, is served
        assert read_back(reader, forged) == (0, [])
        assert reader.stats().counters.unauthenticated == 2
        assert reader.stats().counters.integrity_errors == 0
        assert_clean(reader)
    finally:
        reader.close()


def test_the_secret_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.setenv("TIERIO_KV_SECRET", SECRET)
    assert KVConfig().secret() == SECRET.encode()
    assert SECRET not in repr(KVConfig(shared_secret=SECRET))
    monkeypatch.setenv("TIERIO_KV_SECRET", "short")
    with pytest.raises(ConfigError, match="16 to 64 bytes"):
        KVConfig()
