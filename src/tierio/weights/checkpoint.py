"""The one place that knows how to find model weights inside a tierio checkpoint.

A tierio checkpoint is a directory (or key prefix) ``step_<9 digits>/`` holding ``manifest.json``
and safetensors shard files; a checkpoint root holds several steps and the newest committed one
(the one with a manifest) is used. The shard files are read through their own safetensors headers,
so this module only has to name the files and map tensor names of the model subtree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tierio.errors import FormatError

MANIFEST = "manifest.json"
_STEP = re.compile(r"^(?:(?P<root>.*)/)?step_(?P<step>\d{9})/manifest\.json$")
MODEL_PREFIXES = ("model.", "model/")


def checkpoint_dir(keys: list[str]) -> str | None:
    """The key prefix ('' or 'step_000000100/') of the newest committed checkpoint in ``keys``."""
    steps = [(int(m["step"]), k[: -len(MANIFEST)]) for k in keys if (m := _STEP.match(k)) and m["root"] is None]
    if steps:
        return max(steps)[1]
    return "" if MANIFEST in keys else None


def _files_named_in(doc: Any, found: set[str]) -> None:
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k in ("file", "path") and isinstance(v, str) and v.endswith(".safetensors"):
                found.add(v)
            else:
                _files_named_in(v, found)
    elif isinstance(doc, list):
        for v in doc:
            _files_named_in(v, found)


def checkpoint_shards(keys: list[str], read_json: Callable[[str], Any]) -> tuple[str, list[str]]:
    """(step prefix, shard keys) of the newest checkpoint; FormatError when there is none."""
    prefix = checkpoint_dir(keys)
    if prefix is None:
        raise FormatError("no manifest.json found: not a tierio checkpoint")
    manifest = read_json(prefix + MANIFEST)
    if not isinstance(manifest, dict):
        raise FormatError(f"{prefix}{MANIFEST} is not a JSON object")
    named: set[str] = set()
    _files_named_in(manifest, named)
    if named:
        shards = sorted(prefix + n.lstrip("/") for n in named)
    else:  # a manifest that does not list files: every shard of that step
        shards = sorted(k for k in keys if k.startswith(prefix) and k.endswith(".safetensors") and "/" not in k[len(prefix) :])
    if not shards:
        raise FormatError(f"checkpoint {prefix or '.'} lists no safetensors shard files")
    return prefix, shards


def model_names(names: list[str]) -> dict[str, str]:
    """Map stored tensor names to the names of the model subtree ('model.w' -> 'w').

    When no name starts with a model prefix the checkpoint holds only the model: names are kept.
    """
    picked = {n: n[len(p) :] for n in names for p in MODEL_PREFIXES if n.startswith(p)}
    return picked if picked else {n: n for n in names}
