"""KV-cache tiering for inference: block keys, a DRAM slot pool, NVMe slabs, a shared store, and the
cache that moves blocks between them (see docs/kv.md). The transformers integration is
``tierio.integrations.hf_kv`` (imported on its own: it needs torch and transformers)."""

import warnings
from typing import Any

from tierio.kv.cache import KVCache
from tierio.kv.config import KVConfig, Watermarks
from tierio.kv.keys import BlockKey, Namespace, hash_blocks, root_key
from tierio.kv.layout import BlockLayout
from tierio.kv.results import GetResult, Lookup, Move, Pending, PrefetchResult, PutResult
from tierio.kv.rule import DecodeSLA, FetchRule, fetch_rule
from tierio.kv.stats import Counters, KVStats, KVTier, TierStats

__all__ = [
    "BlockKey", "BlockLayout", "Counters", "DecodeSLA", "FetchRule", "GetResult", "KVCache", "KVConfig", "KVStats",
    "KVTier", "Lookup", "Move", "Namespace", "Pending", "PrefetchResult", "PutResult", "TierStats", "Watermarks",
    "fetch_rule", "hash_blocks", "root_key",
]

_RENAMED = {"Tier": "KVTier"}  # one release: the tier enum's name before it was unique across tierio


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'tierio.kv' has no attribute {name!r}")
    warnings.warn(f"tierio.kv.{name} is deprecated, use tierio.kv.{new}", DeprecationWarning, stacklevel=2)
    return globals()[new]
