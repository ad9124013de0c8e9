"""KV-cache tiering for inference: block keys, a DRAM slot pool, NVMe slabs, a shared store, and the
router that moves blocks between them (see docs/kv.md). The transformers integration is
``tierio.kv.hf`` (imported on its own: it needs torch and transformers)."""

from tierio.kv.config import KVConfig, Watermarks
from tierio.kv.keys import BlockKey, Namespace, hash_blocks, root_key
from tierio.kv.layout import BlockLayout
from tierio.kv.results import GetResult, Lookup, Pending, PrefetchResult, PutResult
from tierio.kv.router import KVCache
from tierio.kv.rule import DecodeSLA, FetchRule, fetch_rule
from tierio.kv.stats import Counters, KVStats, Tier, TierStats

__all__ = [
    "BlockKey", "BlockLayout", "Counters", "DecodeSLA", "FetchRule", "GetResult", "KVCache", "KVConfig", "KVStats",
    "Lookup", "Namespace", "Pending", "PrefetchResult", "PutResult", "Tier", "TierStats", "Watermarks", "fetch_rule",
    "hash_blocks", "root_key",
]
