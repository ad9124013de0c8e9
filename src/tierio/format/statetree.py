"""State trees without pickle: nested dicts/lists/tuples with tensor leaves <-> JSON + named tensors.

``flatten(state)`` turns a training state (model and optimizer state dicts, scheduler state, RNG
states, step counters, user extras) into a JSON-able tree whose tensor leaves are references
``{"__tensor__": name}`` plus a dict of the distinct tensors. ``unflatten`` builds the state back.

Encoding of what JSON cannot hold directly (every marker is a one-key object):

    {"__tensor__": name}     torch tensor            {"__ndarray__": name}   numpy array
    {"__tuple__": [...]}     tuple                   {"__dict__": [[k, v]]}  dict with non-str keys
    {"__float__": "nan"}     nan / inf / -inf        {"__bytes__": base64}   bytes
    {"__dtype__": "float32"} torch.dtype             {"__np__": [dtype, v]}  numpy scalar
    {"__global__": name}     DTensor / TensorSlice: a slice of a global tensor (format.slices)

Plain tensors belong to the rank that saves them; a global tensor is one tensor across ranks,
named by its path, of which each rank stores only the slice it writes.

Tensors that are views of the same memory with the same shape, stride and dtype (tied weights)
are stored once and come back as one shared tensor; so is a global tensor met twice as the same
object (``ckpt.replicated.spread`` gives tied weights one ``TensorSlice``). Nothing here executes code from the data.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierio.errors import FormatError, UnstorableError
from tierio.format.slices import GlobalLeaf, TensorSlice, global_leaf, is_dtensor
from tierio.io.untrusted import MAX_INT_DIGITS, brief

MARKERS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__", "__np__",
           "__global__")
MAX_DEPTH = 200
# JSON nesting of a tree of MAX_DEPTH levels: a non-str-key dict level is 3 JSON levels
# ({"__dict__": [[k, v]]}), and a numpy scalar leaf adds 3 more ({"__np__": [dt, {"__float__": ..}]}).
MAX_JSON_DEPTH = 3 * MAX_DEPTH + 4
# torch dtypes by name, read without getattr(torch, name) (which may import submodules)
_TORCH_DTYPES = {name: obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}


@dataclass
class FlatState:
    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's own tensors
    globals: dict[str, GlobalLeaf] = field(default_factory=dict)  # slices of global tensors


def _scalar(x: Any, where: str) -> Any:
    """Encode a JSON-able scalar (also used for dict keys)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):  # io.untrusted.loads refuses longer integers: refuse them when saving
        if abs(x) >= 10**MAX_INT_DIGITS:
            raise UnstorableError(f"integer at {where!r} has more than {MAX_INT_DIGITS} digits; store it as a string", where)
        return int(x)
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        return {"__float__": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
    if isinstance(x, tuple):
        return {"__tuple__": [_scalar(v, where) for v in x]}
    raise UnstorableError(f"dict key {x!r} of type {type(x).__name__} at {where!r} cannot be stored; use str or int keys", where)


def flatten(state: Any) -> FlatState:
    """Split ``state`` into a JSON tree and its distinct tensors (named by their path in the tree)."""
    out = FlatState(None)
    seen: dict[tuple, str] = {}
    seen_globals: dict[int, str] = {}  # id of a TensorSlice/DTensor met before (a tied global tensor)

    def name_for(path: list[str]) -> str:
        base = "/".join(path) or "tensor"
        name, i = base, 1
        while name in out.tensors or name in out.globals or name == "__metadata__":
            name, i = f"{base}~{i}", i + 1
        return name

    def tensor_leaf(t: torch.Tensor, path: list[str]) -> str:
        if t.layout != torch.strided:
            raise UnstorableError(f"tensor at {'/'.join(path)!r} has layout {t.layout}; convert it to a dense tensor first", "/".join(path))
        t = t.detach()
        key = alias_key(t)
        if key is not None:
            if key in seen:
                return seen[key]
        name = name_for(path)
        out.tensors[name] = t
        if key is not None:
            seen[key] = name
        return name

    def walk(obj: Any, path: list[str], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnstorableError(f"state is nested deeper than {MAX_DEPTH} levels at {'/'.join(path)!r}", "/".join(path))
        if isinstance(obj, TensorSlice) or is_dtensor(obj):
            if id(obj) in seen_globals:  # the same slice object under a second name: stored once
                return {"__global__": seen_globals[id(obj)]}
            name = seen_globals[id(obj)] = name_for(path)
            leaf = global_leaf(obj, "/".join(path))
            if leaf.local.layout != torch.strided:
                raise UnstorableError(f"tensor at {'/'.join(path)!r} has layout {leaf.local.layout}; convert it to a dense tensor first",
                                      "/".join(path))
            out.globals[name] = leaf
            return {"__global__": name}
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": tensor_leaf(obj, path)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise UnstorableError(f"numpy array at {'/'.join(path)!r} has dtype {obj.dtype}; only numeric arrays can be stored", "/".join(path))
            arr = np.ascontiguousarray(obj)
            if not arr.flags.writeable:
                arr = arr.copy()
            return {"__ndarray__": tensor_leaf(torch.from_numpy(arr), path)}
        if isinstance(obj, np.generic):
            return {"__np__": [obj.dtype.str, _scalar(obj.item(), "/".join(path))]}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: walk(v, path + [k], depth + 1) for k, v in obj.items()}
            return {"__dict__": [[_scalar(k, "/".join(path)), walk(v, path + [str(k)], depth + 1)] for k, v in obj.items()]}
        if isinstance(obj, list):
            return [walk(v, path + [str(i)], depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):  # torch.Size and namedtuples come back as plain tuples
            return {"__tuple__": [walk(v, path + [str(i)], depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return _scalar(obj, "/".join(path))
        raise UnstorableError(
            f"cannot store {type(obj).__name__} at {'/'.join(path) or '<root>'!r} without pickle; "
            "convert it to tensors, numbers, strings, lists or dicts (e.g. call .state_dict())",
            "/".join(path),
        )

    out.tree = walk(state, [], 0)
    return out


def alias_key(t: torch.Tensor) -> tuple | None:
    """Tensors with one key are the same memory seen twice (tied weights: ``lm_head.weight`` is
    ``wte.weight``); None for an empty tensor, which aliases nothing."""
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def tensor_refs(tree: Any, markers: tuple[str, ...] = ("__tensor__", "__ndarray__")) -> list[str]:
    """Every tensor name the tree references with one of ``markers`` (default: this rank's own
    tensors; ``("__global__",)``: global tensors), in walk order, with repeats for tied leaves.

    Iterative, so a tree read from a file cannot exhaust the stack."""
    refs: list[str] = []
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise FormatError(f"state tree is nested deeper than {MAX_JSON_DEPTH} JSON levels")
        if isinstance(node, dict):
            if len(node) == 1:
                (k, v), = node.items()
                if k in markers:
                    if not isinstance(v, str):
                        raise FormatError(f"tensor reference {brief(v)} is not a string")
                    refs.append(v)
                    continue
            stack.extend((v, depth + 1) for v in reversed(node.values()))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in reversed(node))
    return refs


def _decode_scalar(node: Any) -> Any:
    if isinstance(node, dict):
        if set(node) == {"__float__"} and node["__float__"] in ("nan", "inf", "-inf"):
            return float(node["__float__"])
        if set(node) == {"__tuple__"} and isinstance(node["__tuple__"], list):
            return tuple(_decode_scalar(v) for v in node["__tuple__"])
        raise FormatError(f"invalid dict key encoding {brief(node)} in the state tree")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise FormatError(f"invalid dict key {brief(node)} in the state tree")


def _np_scalar(v: Any) -> Any:
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and len(v[0]) <= 16):
        raise FormatError("__np__ must hold [dtype, value]")
    try:
        dt = np.dtype(v[0])
    except (TypeError, ValueError):
        raise FormatError(f"unknown numpy dtype {brief(v[0])} in the state tree") from None
    if dt.kind not in "biufc":
        raise FormatError(f"numpy dtype {v[0]!r} is not numeric")
    value = _decode_scalar(v[1])
    try:
        return dt.type(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"numpy scalar {brief(value)} does not fit {dt} in the state tree ({exc})") from None


def unflatten(tree: Any, get_tensor: Callable[[str, Any], torch.Tensor], into: Any = None,
              get_global: Callable[[str, Any], Any] | None = None) -> Any:
    """Rebuild a state from its JSON tree. ``get_tensor(name, target)`` returns the tensor for a
    reference; ``target`` is the tensor found at the same place in ``into`` (or None).
    ``get_global(name, target)`` does the same for global tensors (``target``: whatever ``into``
    holds there: a DTensor, a TensorSlice, a tensor, or None)."""

    def sub(x: Any, key: Any) -> Any:
        try:
            if isinstance(x, dict):
                return x.get(key)
            if isinstance(x, (list, tuple)) and isinstance(key, int) and 0 <= key < len(x):
                return x[key]
        except TypeError:
            pass
        return None

    def walk(node: Any, target: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise FormatError(f"state tree is nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, list):
            return [walk(v, sub(target, i), depth + 1) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            if node is None or isinstance(node, (bool, int, float, str)):
                return node
            raise FormatError(f"invalid value {brief(node)} in the state tree")
        if len(node) == 1:
            (k, v), = node.items()
            if k == "__tensor__":
                return get_tensor(v, target if isinstance(target, torch.Tensor) else None)
            if k == "__global__":
                if get_global is None:
                    raise FormatError(f"the state tree refers to global tensor {brief(v)} where none is expected")
                return get_global(v, target if isinstance(target, (torch.Tensor, TensorSlice)) else None)
            if k == "__ndarray__":
                t = get_tensor(v, torch.from_numpy(target) if isinstance(target, np.ndarray) and target.flags.writeable else None)
                return target if isinstance(target, np.ndarray) and target.flags.writeable and target.shape == tuple(t.shape) else t.numpy()
            if k == "__tuple__":
                if not isinstance(v, list):
                    raise FormatError("__tuple__ must hold a list")
                return tuple(walk(x, sub(target, i), depth + 1) for i, x in enumerate(v))
            if k == "__dict__":
                if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
                    raise FormatError("__dict__ must hold [key, value] pairs")
                result = {}
                for kk, vv in v:
                    key = _decode_scalar(kk)
                    result[key] = walk(vv, sub(target, key), depth + 1)
                return result
            if k == "__float__":
                return _decode_scalar(node)
            if k == "__bytes__":
                if not isinstance(v, str):
                    raise FormatError("__bytes__ must hold a base64 string")
                try:
                    return base64.b64decode(v, validate=True)
                except ValueError:
                    raise FormatError("__bytes__ holds invalid base64") from None
            if k == "__dtype__":
                dt = _TORCH_DTYPES.get(v) if isinstance(v, str) else None
                if dt is None:
                    raise FormatError(f"unknown torch dtype {brief(v)} in the state tree")
                return dt
            if k == "__np__":
                return _np_scalar(v)
        for k in node:
            if k.startswith("__") and k in MARKERS:
                raise FormatError(f"marker {k!r} mixed with other keys in the state tree")
        return {k: walk(v, sub(target, k), depth + 1) for k, v in node.items()}

    return walk(tree, into, 0)
