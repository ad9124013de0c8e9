"""A KV prefix cache for Hugging Face ``transformers`` causal language models.

Before a prompt's prefill, the longest cached prefix (in whole blocks) is looked up, leased so it
cannot be evicted while it is read, fetched into a staging tensor and turned into the model's
``DynamicCache``; only the rest of the prompt is prefilled; then the prompt's new whole blocks are
cut out of the cache and stored. The model computes exactly what it would without the cache on
top of bit-identical K and V, so greedy generations are the same token for token.

At least one prompt token is always prefilled (the first new token needs its logits), and only
whole blocks are cached: the tail of a prompt shorter than a block is recomputed.

Works with models whose every layer keeps a full (not sliding-window) cache of shape
``[batch, kv_heads, tokens, head_dim]``, batch 1, on CPU or one accelerator. Imports torch and
transformers; ``tierio.kv`` itself does not (``tierio.kv.hf`` is this module's old name).
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass
from typing import Any, Self

import torch

from tierio.errors import ConfigError
from tierio.io.checksum import xxh3_128_hex
from tierio.kv import BlockLayout, DecodeSLA, KVCache, KVConfig, Namespace, Pending, PrefetchResult
from tierio.kv.layout import DEFAULT_BLOCK_TOKENS

_SAMPLE_WINDOWS = 16  # windows sampled from each tensor, spread over all of its bytes
_WINDOW_BYTES = 256


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_for(model: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> BlockLayout:
    """The block layout of ``model``'s KV cache (refuses caches tierio cannot cut into blocks)."""
    cfg = _text_config(model)
    if getattr(cfg, "sliding_window", None) or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        raise ConfigError(f"{type(model).__name__} keeps sliding-window caches; tierio's prefix cache needs full-attention layers")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return BlockLayout(layers=cfg.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim,
                       dtype=_dtype_name(next(model.parameters()).dtype), tokens=block_tokens)


def _tensor_sample(t: torch.Tensor) -> bytes:
    """A strided sample of a tensor's bytes: ``_SAMPLE_WINDOWS`` windows from its start to its end
    (all of it when small), so a change spread over a tensor (a merged LoRA) is seen."""
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    n = raw.numel()
    if n <= _SAMPLE_WINDOWS * _WINDOW_BYTES:
        return raw.cpu().numpy().tobytes()
    step = (n - _WINDOW_BYTES) // (_SAMPLE_WINDOWS - 1)
    at = torch.arange(_SAMPLE_WINDOWS, device=raw.device).mul_(step).unsqueeze(1) + torch.arange(_WINDOW_BYTES, device=raw.device)
    return raw[at.reshape(-1)].cpu().numpy().tobytes()


def model_identity(model: Any) -> str:
    """A stable name for ``model``'s weights: its hub name (or type), a digest of its config and of
    every parameter and buffer (name, shape, dtype and a strided sample of its bytes). A fine-tune
    of a base model (every projection changed, as a merged LoRA does) gets its own identity. The
    layout (block size, KV dtype, tensor-parallel rank and size) enters every key's root beside it
    (``kv.keys.root_key``). In production pass ``model_id`` (a hub id and revision): a sample is a
    sample, and reading it costs one small copy per tensor."""
    cfg = model.config
    doc = {k: v for k, v in cfg.to_dict().items() if k != "transformers_version"}
    parts = [json.dumps(doc, sort_keys=True, default=str).encode()]  # hashed as one run: samples are small
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        parts.append(_tensor_sample(t))
    name = getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "model")
    return f"{name}@{xxh3_128_hex(b''.join(parts))}"


def namespace_for(model: Any, *, model_id: str | None = None, adapter: str = "", salt: str = "",
                  tp_rank: int = 0, tp_size: int = 1) -> Namespace:
    return Namespace(model_id or model_identity(model), tp_rank=tp_rank, tp_size=tp_size, adapter=adapter, salt=salt)


# -- the model's side ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Calling:
    """How this transformers version names the forward arguments that matter here."""

    cache: str
    logits: str | None

    @classmethod
    def of(cls, model: Any) -> _Calling:
        params = inspect.signature(model.forward).parameters
        cache = "cache" if "cache" in params else "past_key_values"
        logits = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
        return cls(cache, logits)


def _forward(model: Any, calling: _Calling, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Last position's logits of ``ids`` run on top of ``cache`` (which grows by ``ids``)."""
    kw: dict[str, Any] = {calling.cache: cache, "use_cache": True}
    if calling.logits:
        kw[calling.logits] = 1
    return model(input_ids=ids, **kw).logits[:, -1, :]


def new_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` holding ``layers`` (one (K, V) pair per layer), empty when there are none."""
    from transformers import DynamicCache

    if not layers:
        return DynamicCache()
    try:
        return DynamicCache(ddp_cache_data=layers)
    except TypeError:  # transformers before the cache-layer rewrite
        return DynamicCache.from_legacy_cache(tuple(layers))


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _ids(input_ids: Any) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ConfigError(f"expected one non-empty sequence of token ids (batch 1), got shape {tuple(ids.shape)}")
    return ids


@dataclass(frozen=True)
class Generation:
    tokens: list[int]        # generated token ids
    cached_tokens: int       # prompt tokens whose K and V came from tierio
    ttft_s: float            # time to the first generated token
    seconds: float           # whole call


def _decode(model: Any, calling: _Calling, cache: Any, logits: torch.Tensor, n: int, eos: int | None,
            device: torch.device) -> list[int]:
    out: list[int] = []
    tok = int(logits[0].argmax())
    while True:
        out.append(tok)
        if len(out) >= n or tok == eos:
            return out
        logits = _forward(model, calling, torch.tensor([[tok]], device=device), cache)
        tok = int(logits[0].argmax())


@torch.no_grad()
def greedy_generate(model: Any, input_ids: Any, max_new_tokens: int, *, eos_token_id: int | None = None) -> Generation:
    """The reference loop without tierio: prefill the whole prompt, then decode greedily."""
    t0 = time.perf_counter()
    ids = _ids(input_ids).to(model.device)
    calling = _Calling.of(model)
    cache = new_cache([])
    logits = _forward(model, calling, ids, cache)
    ttft = time.perf_counter() - t0
    tokens = _decode(model, calling, cache, logits, max_new_tokens, eos_token_id, ids.device)
    return Generation(tokens, 0, ttft, time.perf_counter() - t0)


# -- the prefix cache ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefill:
    cache: Any               # the model's DynamicCache, holding the whole prompt
    logits: torch.Tensor     # the last prompt position's logits, [1, vocab]
    cached_tokens: int       # prompt tokens loaded from tierio
    computed_tokens: int     # prompt tokens the model ran
    stored_blocks: int       # the prompt's new whole blocks now in the cache


class PrefixCache:
    """Prefix caching for one model through a ``KVCache`` (see the module docstring)."""

    def __init__(self, model: Any, kv: KVCache, *, sla: DecodeSLA | None = None, owns_kv: bool = False) -> None:
        want = layout_for(model, kv.layout.tokens)
        if want != kv.layout:
            raise ConfigError(f"the KV cache holds blocks of layout {kv.layout}, the model's is {want}")
        self.model = model
        self.kv = kv
        self.sla = sla
        self._calling = _Calling.of(model)
        self._owns_kv = owns_kv

    @classmethod
    def open(cls, model: Any, config: KVConfig | None = None, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
             model_id: str | None = None, adapter: str = "", salt: str = "", sla: DecodeSLA | None = None) -> PrefixCache:
        """A prefix cache with its own ``KVCache`` (closed with it)."""
        kv = KVCache(layout_for(model, block_tokens), namespace_for(model, model_id=model_id, adapter=adapter, salt=salt),
                     config)
        return cls(model, kv, sla=sla, owns_kv=True)

    @property
    def layout(self) -> BlockLayout:
        return self.kv.layout

    def _staging(self, device: torch.device) -> torch.device:
        """Where blocks are gathered on their way to and from the cache: on the model's device when
        the cache has a device tier there (copies stay device-to-device), else in host memory."""
        tier = self.kv.device
        if tier is not None and tier.device.type == device.type and tier.device.type != "cpu":
            return device
        return torch.device("cpu")

    def _load(self, keys: list[bytes], device: torch.device) -> tuple[Any, int]:
        """A DynamicCache of the longest cached prefix of ``keys`` and its length in blocks."""
        found = self.kv.lookup(keys, self.sla).blocks
        if not found:
            return new_cache([]), 0
        lay = self.layout
        with self.kv.lease(keys[:found]) as leased:
            staging = torch.empty((leased, *lay.shape), dtype=next(self.model.parameters()).dtype,
                                  device=self._staging(device))
            got = self.kv.get(keys[:leased], staging).result().blocks if leased else 0
        if not got:
            return new_cache([]), 0
        blocks, t = staging[:got], got * lay.tokens
        layers = []
        for layer in range(lay.layers):
            k, v = (blocks[:, layer, i].permute(1, 0, 2, 3).reshape(1, lay.kv_heads, t, lay.head_dim).to(device)
                    for i in (0, 1))
            layers.append((k, v))
        return new_cache(layers), got

    def store_blocks(self, cache: Any, keys: list[bytes], start: int = 0) -> int:
        """Put blocks ``start..len(keys)`` of a prompt (its keys), cut out of the model's cache
        holding it, and wait for the copy: a few milliseconds, and a copy left running would compete
        with the decode steps that follow for the same cores. Returns the blocks stored."""
        n = len(keys) - start
        if n <= 0:
            return 0
        lay = self.layout
        layers = cache_layers(cache)
        blocks = torch.empty((n, *lay.shape), dtype=layers[0][0].dtype, device=self._staging(layers[0][0].device))
        lo, hi = start * lay.tokens, len(keys) * lay.tokens
        for layer, (k, v) in enumerate(layers):
            for i, t in ((0, k), (1, v)):
                part = t[0, :, lo:hi, :].reshape(lay.kv_heads, n, lay.tokens, lay.head_dim)
                blocks[:, layer, i].copy_(part.permute(1, 0, 2, 3))
        return self.kv.put(keys[start:], blocks, parent=keys[start - 1] if start else None).result().stored

    @torch.no_grad()
    def prefill(self, input_ids: Any, *, store: bool = True) -> Prefill:
        """Run the prompt's prefill on top of its cached prefix and store its new whole blocks."""
        ids = _ids(input_ids).to(self.model.device)
        n = ids.shape[1]
        keys = self.kv.hash_blocks(ids[0])
        usable = keys[: (n - 1) // self.layout.tokens]  # at least one token is computed
        cache, hit = self._load(usable, ids.device)
        done = hit * self.layout.tokens
        logits = _forward(self.model, self._calling, ids[:, done:], cache)
        stored = self.store_blocks(cache, keys, hit) if store else 0
        return Prefill(cache, logits, done, n - done, stored)

    def prefetch(self, input_ids: Any, deadline_s: float | None = None) -> Pending[PrefetchResult]:
        """Bring the cached prefix of a prompt up into DRAM in the background: call it when a paused
        conversation is about to resume (its next prompt starts with this one); its prefill then
        uses the first blocks while later ones are still arriving."""
        ids = _ids(input_ids)
        keys = self.kv.hash_blocks(ids[0])[: (ids.shape[1] - 1) // self.layout.tokens]
        return self.kv.prefetch(keys, deadline_s)

    @torch.no_grad()
    def generate(self, input_ids: Any, max_new_tokens: int, *, eos_token_id: int | None = None) -> Generation:
        """Greedy generation with the prompt's prefix from tierio: the same tokens as
        ``greedy_generate`` (and as ``model.generate(do_sample=False)``)."""
        t0 = time.perf_counter()
        pre = self.prefill(input_ids)
        ttft = time.perf_counter() - t0
        device = pre.logits.device
        tokens = _decode(self.model, self._calling, pre.cache, pre.logits, max_new_tokens, eos_token_id, device)
        return Generation(tokens, pre.cached_tokens, ttft, time.perf_counter() - t0)

    def close(self) -> None:
        if self._owns_kv:
            self.kv.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Generation", "Prefill", "PrefixCache", "cache_layers", "greedy_generate", "layout_for", "model_identity",
           "namespace_for", "new_cache"]
