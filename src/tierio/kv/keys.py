"""Block keys: deterministic 128-bit chained hashes.

A block's key is ``xxh3_128(parent key || token ids)``; the first block's parent is the
namespace's root key, itself ``xxh3_128`` of a canonical description of everything that makes KV
bytes differ for the same tokens: model identity, KV dtype and layout, tensor-parallel rank and
size, adapter, and a user salt. So a key names one prefix of one model's KV exactly: the same
tokens under another model, layout, rank or tenant never hit, and the same prompt gives the same
keys in every process, on every machine, whatever ``PYTHONHASHSEED`` is (Python's ``hash()`` is
salted per process, which is why caches keyed on it never hit across processes).

Token ids are hashed as little-endian uint32, so a list, a numpy array or a torch tensor of the
same ids give the same keys. Only whole blocks get keys: the tail of a prompt shorter than a
block is recomputed, never cached.

xxh3 is fast, not collision-resistant against someone who crafts prompts on purpose: give each
tenant its own ``salt`` so one tenant's prompts can never address another's blocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import NewType

import numpy as np
from tierio.errors import ConfigError
from tierio.io.checksum import xxh3_128
from tierio.kv.layout import BlockLayout

BlockKey = NewType("BlockKey", bytes)
"""16 bytes: the xxh3-128 digest naming one block (and, through its parent, its whole prefix)."""

KEY_BYTES = 16
KEY_VERSION = 1  # bump when the key derivation changes: old tiers then simply never hit


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides a block's bytes.

    ``model``: a stable identity of the weights (a hub id with its revision, or a fingerprint, see
    ``tierio.integrations.hf_kv.model_identity``); ``adapter``: LoRA or other adapter identity
    ("" for none);
    ``salt``: isolates tenants (blocks of different salts never match)."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    adapter: str = ""
    salt: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("namespace: model identity must be a non-empty string (a hub id and revision, or a fingerprint)")
        if not (isinstance(self.tp_size, int) and isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ConfigError(f"namespace: tensor-parallel rank {self.tp_rank!r} must lie in 0..{self.tp_size!r}-1")


def root_key(namespace: Namespace, layout: BlockLayout) -> BlockKey:
    """The parent of every chain's first block: a digest of the namespace and the layout."""
    doc = {"v": KEY_VERSION, **asdict(namespace), "layout": layout.describe()}
    return BlockKey(xxh3_128(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()))


def token_array(token_ids) -> np.ndarray:
    """Token ids as a flat little-endian uint32 array (a copy only when the input is not one already)."""
    if hasattr(token_ids, "detach"):  # a torch tensor, on any device
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim == 2 and arr.shape[0] == 1:  # a batch of one, as tokenizers return it
        arr = arr[0]
    if arr.ndim != 1:
        raise ConfigError(f"token ids must be one sequence, got an array of shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ConfigError(f"token ids must be integers, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ConfigError("token ids must lie in 0..2**32-1")
    return np.ascontiguousarray(arr, dtype="<u4")


def chain_keys(root: BlockKey, token_ids, block_tokens: int) -> list[BlockKey]:
    """Keys of every whole block of ``token_ids``: key[i] = xxh3_128(key[i-1] || tokens of block i)."""
    tokens = token_array(token_ids)
    step = block_tokens * 4
    raw = tokens.tobytes()
    keys: list[BlockKey] = []
    parent = root
    digest = xxh3_128
    for start in range(0, (len(raw) // step) * step, step):
        parent = BlockKey(digest(parent + raw[start:start + step]))
        keys.append(parent)
    return keys


def hash_blocks(namespace: Namespace, layout: BlockLayout, token_ids) -> list[BlockKey]:
    """Keys of the whole blocks of one token sequence under ``namespace`` and ``layout``."""
    return chain_keys(root_key(namespace, layout), token_ids, layout.tokens)


def key_hex(key: bytes) -> str:
    return key.hex()


__all__ = ["KEY_BYTES", "BlockKey", "Namespace", "chain_keys", "hash_blocks", "key_hex", "root_key", "token_array"]
