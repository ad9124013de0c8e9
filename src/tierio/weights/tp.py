"""Tensor-parallel slices: which part of every tensor one rank of a tensor-parallel group holds.

A *rule* says how one tensor splits over the ``size`` ranks of the group; a ``TensorParallel``
spec is the rank, the group size and an ordered list of (name pattern, rule), the first pattern
that matches (``re.search``) deciding. Tensors no pattern matches are replicated (loaded whole).

* ``Split(0)`` column-parallel (and vocabulary-parallel embeddings, lm_head); ``Split(1)``
  row-parallel; ``Replicate()``.
* ``Split(0, sections=(H, K, K), shared=(1, 2))``: a fused tensor whose dimension holds several
  sections (q, k, v heads; gate and up rows), each split on its own and the rank's parts
  concatenated. A section's length is ``count`` units (heads): with fewer units than ranks, a
  ``shared`` section (grouped-query k/v heads) gives each unit to ``size / count`` ranks.
* ``torch.distributed.tensor`` placements ``Shard(d)`` and ``Replicate()`` are accepted as rules.

Presets for the Llama family (Llama, Mistral, Qwen2/3, Mixtral, Gemma, Phi-3) are built from the
model's ``config.json`` fields (``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``), not from one model's shapes. A split that does not divide a tensor
evenly is a ConfigError naming the tensor and its shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierio.errors import ConfigError


@dataclass(frozen=True)
class Take:
    """What a rank takes of one tensor: index ranges [start, stop) along ``dim``, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        n = sum(b - a for a, b in self.ranges)
        return shape[: self.dim] + (n,) + shape[self.dim + 1 :]

    def contiguous(self, shape: tuple[int, ...]) -> bool:
        """One byte range of the stored tensor (a dim-0 slice, or leading dimensions of one)."""
        return len(self.ranges) == 1 and math.prod(shape[: self.dim]) <= 1


class Rule(Protocol):
    def take(self, name: str, shape: tuple[int, ...], rank: int, size: int) -> Take | None: ...


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor (norms, biases added after a row-parallel reduction)."""

    def take(self, name: str, shape: tuple[int, ...], rank: int, size: int) -> Take | None:
        return None


@dataclass(frozen=True)
class Split:
    """Split dimension ``dim`` evenly (by ``sections`` of units when given; see the module docstring)."""

    dim: int = 0
    sections: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()

    def take(self, name: str, shape: tuple[int, ...], rank: int, size: int) -> Take | None:
        what = f"tensor {name!r} of shape {list(shape)}"
        if self.dim >= len(shape):
            raise ConfigError(f"{what}: a split along dimension {self.dim} needs {self.dim + 1} dimensions; fix the rule for it")
        n = shape[self.dim]
        sections = self.sections or (n,)
        if n % sum(sections):
            raise ConfigError(f"{what}: dimension {self.dim} of {n} is not a whole number of {sum(sections)} units "
                              f"(sections {list(sections)}); check the rule's head counts against config.json")
        unit = n // sum(sections)
        ranges, at = [], 0
        for i, count in enumerate(sections):
            lo, hi = _part(count, rank, size, i in self.shared, what, self.dim)
            ranges.append(((at + lo) * unit, (at + hi) * unit))
            at += count
        return Take(self.dim, tuple(ranges))


def _part(count: int, rank: int, size: int, shared: bool, what: str, dim: int) -> tuple[int, int]:
    """The units [lo, hi) of ``count`` that ``rank`` of ``size`` takes."""
    if count % size == 0:
        per = count // size
        return rank * per, (rank + 1) * per
    if shared and size % count == 0:  # more ranks than kv heads: each head serves size/count ranks
        h = rank // (size // count)
        return h, h + 1
    raise ConfigError(f"{what}: {count} units along dimension {dim} do not split evenly over {size} ranks; "
                      "choose a tensor-parallel degree that divides it (or a rule that replicates the tensor)")


RuleList = Sequence[tuple[str, Any]]


def as_rule(rule: Any) -> Rule:
    """A rule, or a DTensor placement (``Shard(d)``, ``Replicate()``) as one."""
    if hasattr(rule, "take"):
        return rule
    kind = type(rule).__name__
    if kind == "Shard" and hasattr(rule, "dim"):
        return Split(int(rule.dim))
    if kind == "Replicate":
        return Replicate()
    raise ConfigError(f"{rule!r} is not a tensor-parallel rule; use Split(dim), Replicate() "
                      "or a DTensor Shard/Replicate placement")


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of a tensor-parallel group of ``size``. ``rules``: None chooses the preset from
    the model's config.json; otherwise (pattern, rule) pairs, first match wins, unmatched replicated."""

    rank: int
    size: int
    rules: RuleList | None = None
    _compiled: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} of {self.size}: the rank must be in 0..size-1 and size >= 1")
        if self.rules is not None:
            object.__setattr__(self, "_compiled", tuple((re.compile(p), as_rule(r)) for p, r in self.rules))

    @classmethod
    def from_mesh(cls, mesh: Any, rules: RuleList | None = None) -> TensorParallel:
        """This process's place on a one-dimensional ``torch.distributed`` DeviceMesh."""
        return cls(int(mesh.get_local_rank()), int(mesh.size()), rules)

    def with_rules(self, rules: RuleList) -> TensorParallel:
        return TensorParallel(self.rank, self.size, rules)

    def take(self, name: str, shape: tuple[int, ...]) -> Take | None:
        """The part of tensor ``name`` this rank holds (None: the whole tensor)."""
        if self.rules is None:
            raise ConfigError("TensorParallel without rules: resolve them with tp.for_model(spec, config) first")
        for pattern, rule in self._compiled:
            if pattern.search(name):
                return None if self.size == 1 else rule.take(name, tuple(shape), self.rank, self.size)
        return None


# -- presets -------------------------------------------------------------------------------------
LLAMA_FAMILY = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
})


def _field(config: Mapping[str, Any], name: str, default: Any = None) -> int:
    v = config.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"config.json: {name!r} is {v!r}, expected a positive integer; pass rules= explicitly")
    return v


def llama_rules(config: Mapping[str, Any]) -> list[tuple[str, Rule]]:
    """Megatron-style rules for the Llama family's tensor names, from the config's head counts."""
    heads = _field(config, "num_attention_heads")
    kv = _field(config, "num_key_value_heads", heads)
    inter = config.get("intermediate_size")
    rules: list[tuple[str, Rule]] = [
        (r"(^|\.)(embed_tokens|lm_head)\.weight$", Split(0)),  # vocabulary-parallel
        (r"\.q_proj\.(weight|bias)$", Split(0, (heads,))),
        (r"\.(k_proj|v_proj)\.(weight|bias)$", Split(0, (kv,), shared=(0,))),
        (r"\.qkv_proj\.(weight|bias)$", Split(0, (heads, kv, kv), shared=(1, 2))),
        (r"\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$", Split(0)),  # column-parallel (w1/w3: Mixtral experts)
        (r"\.(o_proj|down_proj|w2)\.weight$", Split(1)),  # row-parallel; their biases are replicated
    ]
    if inter is not None:  # Phi-3's fused gate and up halves
        rules.append((r"\.gate_up_proj\.(weight|bias)$", Split(0, (_field(config, "intermediate_size"),) * 2)))
    return rules


def preset(config: Mapping[str, Any]) -> list[tuple[str, Rule]]:
    """The rules for a model from its config.json (chosen by "architectures")."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json is not a JSON object; pass rules= explicitly")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConfigError("config.json has no 'architectures' list to choose tensor-parallel rules by; pass rules= explicitly")
    if any(isinstance(a, str) and a in LLAMA_FAMILY for a in archs):
        return llama_rules(config)
    raise ConfigError(f"no tensor-parallel preset for architectures {str(archs[:3])[:200]} "
                      f"(known: {', '.join(sorted(LLAMA_FAMILY))}); "
                      "pass rules=[(pattern, Split(dim) | Replicate()), ...]")


__all__ = ["LLAMA_FAMILY", "Replicate", "Rule", "Split", "Take", "TensorParallel", "as_rule", "llama_rules", "preset"]
