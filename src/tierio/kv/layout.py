"""What one KV block holds and how its bytes are laid out.

A block is ``tokens`` consecutive tokens of one sequence, with every layer's K and V for those
tokens in one contiguous buffer, ordered ``[layer][K, V][kv head][token][head dim]``. One buffer per
block means one slot, one I/O and one checksum per block; keeping a layer's K (or V) for a head
contiguous over the block's tokens means filling an engine's per-layer cache is a strided copy of
whole ``tokens × head_dim`` runs, never element by element.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tierio.errors import ConfigError

# Bytes per element of the KV dtypes engines use (FP8 variants are one byte).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1,
}

DEFAULT_BLOCK_TOKENS = 256


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one block: ``layers × 2 × kv_heads × tokens × head_dim`` elements of ``dtype``.

    ``kv_heads`` is the number of KV heads this process holds (its tensor-parallel share)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"block layout: {name} must be a whole number of at least 1, got {v!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"block layout: KV dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.tokens

    def describe(self) -> dict:
        """The layout as plain data (part of every key's namespace, and of an NVMe tier's header)."""
        return {**asdict(self), "order": "layer,kv,head,token,dim"}


__all__ = ["DEFAULT_BLOCK_TOKENS", "DTYPE_BYTES", "BlockLayout"]
