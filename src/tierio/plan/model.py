"""Model shapes the planner knows by name, and the byte widths of the dtypes it sizes with."""

from __future__ import annotations

from dataclasses import dataclass

from tierio.errors import ConfigError

# Bytes per element. fp8/int8 = 1, bf16/fp16 = 2, fp32 = 4, int4 = 0.5.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4, "tf32": 4,
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
    "fp8": 1, "float8": 1, "int8": 1, "e4m3": 1, "e5m2": 1,
    "int4": 0.5, "fp4": 0.5,
}


def dtype_bytes(name: str) -> float:
    """Bytes per element of a dtype name such as "bf16" or "fp8"."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        known = ", ".join(sorted({"fp32", "bf16", "fp16", "fp8", "int8", "int4"}))
        raise ConfigError(f"unknown dtype {name!r}: use one of {known}") from None


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs to know about a model.

    ``params`` is the nominal parameter count the arithmetic uses (70e9 for "70B"); the
    attention shape (layers, KV heads, head dim) sizes the KV cache; ``vocab`` tells whether
    token IDs fit in 2 bytes.
    """

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    note: str = ""


PRESETS: dict[str, ModelShape] = {
    "7b": ModelShape("7b", 7e9, layers=32, kv_heads=32, head_dim=128, vocab=32_000,
                     note="Llama-2 7B shape: multi-head attention (32 KV heads)"),
    "70b": ModelShape("70b", 70e9, layers=80, kv_heads=8, head_dim=128, vocab=32_000,
                      note="Llama-2 70B shape: grouped-query attention, 8 KV heads"),
    "405b": ModelShape("405b", 405e9, layers=126, kv_heads=8, head_dim=128, vocab=128_256,
                       note="Llama-3.1 405B shape: 126 layers, 8 KV heads"),
    "llama3-70b": ModelShape("llama3-70b", 70e9, layers=80, kv_heads=8, head_dim=128, vocab=128_256,
                             note="Llama-3 70B attention: 80 layers, 8 KV heads, head dim 128 "
                                  "(70.6e9 parameters; sized at the nominal 70e9)"),
}


def preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive), or a ConfigError listing the known ones."""
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)} "
                          "(or give --params, --layers, --kv-heads and --head-dim yourself)")
    return PRESETS[key]
