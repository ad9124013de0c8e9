"""Block keys: deterministic across processes and hash seeds, different for anything that makes
KV bytes differ, identical for every way of passing the same token ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tierio.errors import ConfigError
from tierio.kv import BlockLayout, Namespace, hash_blocks, root_key
from tierio.kv.keys import chain_keys

SRC = Path(__file__).resolve().parents[1] / "src"
LAYOUT = BlockLayout(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", tokens=16)
NS = Namespace("org/model@rev1")


def test_keys_cover_whole_blocks_only_and_chain():
    toks = list(range(16 * 3 + 5))
    keys = hash_blocks(NS, LAYOUT, toks)
    assert len(keys) == 3 and all(len(k) == 16 for k in keys) and len(set(keys)) == 3
    # a chain: each key is its prefix's, so a longer prompt starts with the same keys
    assert hash_blocks(NS, LAYOUT, toks + [7] * 40)[:3] == keys
    # and a different earlier block changes every later key
    other = hash_blocks(NS, LAYOUT, [1] + toks[1:])
    assert not set(other) & set(keys)


def test_same_ids_in_any_container_give_the_same_keys():
    toks = list(range(100, 164))
    want = hash_blocks(NS, LAYOUT, toks)
    for form in (np.array(toks, dtype=np.int64), np.array(toks, dtype=np.int32), torch.tensor(toks),
                 torch.tensor([toks]), tuple(toks)):
        assert hash_blocks(NS, LAYOUT, form) == want


@pytest.mark.parametrize("change", [
    lambda ns, lay: (replace(ns, model="org/model@rev2"), lay),
    lambda ns, lay: (replace(ns, tp_rank=1, tp_size=2), lay),
    lambda ns, lay: (replace(ns, tp_size=2), lay),
    lambda ns, lay: (replace(ns, adapter="lora-a"), lay),
    lambda ns, lay: (replace(ns, salt="tenant-b"), lay),
    lambda ns, lay: (ns, replace(lay, dtype="float8_e4m3fn")),
    lambda ns, lay: (ns, replace(lay, kv_heads=4)),
    lambda ns, lay: (ns, replace(lay, layers=5)),
])
def test_anything_that_changes_kv_bytes_changes_every_key(change):
    toks = list(range(64))
    ns, lay = change(NS, LAYOUT)
    assert root_key(ns, lay) != root_key(NS, LAYOUT)
    assert not set(hash_blocks(ns, lay, toks)) & set(hash_blocks(NS, LAYOUT, toks))


def test_key_derivation_is_pinned():
    """Changing the derivation silently would make every persisted tier miss: this golden value
    must only change together with KEY_VERSION."""
    keys = chain_keys(root_key(NS, LAYOUT), list(range(32)), 16)
    assert root_key(NS, LAYOUT).hex() == GOLDEN_ROOT
    assert [k.hex() for k in keys] == GOLDEN_KEYS


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, np.zeros((2, 16), dtype=np.int64), [0.5] * 16])
def test_bad_token_ids_are_a_config_error(bad):
    with pytest.raises(ConfigError):
        hash_blocks(NS, LAYOUT, bad)


def test_bad_namespaces_and_layouts_are_config_errors():
    with pytest.raises(ConfigError):
        Namespace("")
    with pytest.raises(ConfigError):
        Namespace("m", tp_rank=2, tp_size=2)
    with pytest.raises(ConfigError):
        BlockLayout(layers=0, kv_heads=1, head_dim=1, dtype="float16")
    with pytest.raises(ConfigError):
        BlockLayout(layers=1, kv_heads=1, head_dim=1, dtype="float13")


def _keys_in_child(seed: str) -> list[str]:
    code = ("import json, sys; from tierio.kv import BlockLayout, Namespace, hash_blocks; "
            "lay = BlockLayout(layers=4, kv_heads=2, head_dim=64, dtype='bfloat16', tokens=16); "
            "print(json.dumps([k.hex() for k in hash_blocks(Namespace('org/model@rev1'), lay, list(range(80)))]))")
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_processes_with_different_hash_seeds_compute_identical_keys():
    here = [k.hex() for k in hash_blocks(NS, LAYOUT, list(range(80)))]
    assert _keys_in_child("0") == here
    assert _keys_in_child("12345") == here
    assert _keys_in_child("random") == here


GOLDEN_ROOT = "b2b382066a1cdba391d32e3f9fae06c3"
GOLDEN_KEYS = ["83bcb308c38b9a59110e9338853cc1f8", "4f3e6b20e2d3bc9a44f215f55e060638"]
