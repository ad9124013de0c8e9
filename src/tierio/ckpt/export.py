"""Whole-model export: a checkpoint of any world size as one Hugging Face style model directory.

``export(url, out)`` writes ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` ({"metadata": {"total_size"}, "weight_map": {name: file}}): every
global tensor assembled whole from the chunks of all ranks, and the plain tensors rank 0 saved.
Only the tensors under ``prefix`` (default ``model/`` when the checkpoint has it) are exported,
named by their path below it with ``.`` between parts, as ``state_dict()`` names them. Every chunk
is verified on the way; one output shard is in memory at a time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierio.errors import ConfigError, NotFoundError
from tierio.format.safetensors import build_header, torch_dtype
from tierio.format.shard import manifest_key
from tierio.format.slices import Box
from tierio.storage.base import Store
from tierio.storage.local import LocalStore
from tierio.storage.url import open_store
from tierio.stats import Stats

from tierio.ckpt.steps.reader import committed_steps, read_manifest
from tierio.ckpt.restore.reshard import Stored, Target, global_tensors, own_tensors
from tierio.ckpt.restore.load import read_all
from tierio.ckpt.restore.plan import Loaded
from tierio.ckpt.restore.source import Source

INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # the Hugging Face default


@dataclass
class ExportReport(Stats):
    step: int
    out: str
    tensors: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)


def _names(stored: dict[str, Stored], prefix: str | None) -> dict[str, str]:
    """Exported name -> checkpoint name, for the tensors under ``prefix``."""
    if prefix is None:
        prefix = "model/" if any(n.startswith("model/") for n in stored) else ""
    out: dict[str, str] = {}
    for name in sorted(stored):
        if name.startswith(prefix):
            new = name[len(prefix):].replace("/", ".")
            if new in out:
                raise ConfigError(f"checkpoint tensors {out[new]!r} and {name!r} would both be exported as {new!r}")
            out[new] = name
    if not out:
        raise NotFoundError(f"no tensor of the checkpoint is under {prefix!r}; pass another --prefix ('' exports all)")
    return out


def _groups(names: dict[str, str], stored: dict[str, Stored], limit: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for new, old in names.items():
        s = stored[old]
        n = math.prod(s.shape) * torch_dtype(s.dtype).itemsize
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(new)
        size += n
    return groups


def export(source: str | Path | Store, out: str | Path, *, step: int | None = None, prefix: str | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> ExportReport:
    """Write ``step`` (default: latest) of the checkpoint tier ``source`` as a model directory ``out``."""
    store = source if isinstance(source, Store) else open_store(source)
    if step is None:
        steps = committed_steps(store)
        if not steps:
            raise NotFoundError(f"no committed checkpoint in {store.url}")
        step = steps[-1]
    if not store.exists(manifest_key(step)):
        raise NotFoundError(f"no committed checkpoint of step {step} in {store.url}; `tierio ckpt ls` lists them")
    man = read_manifest(store, step)
    loaded = Loaded(man, [Source(store)])
    stored = {**own_tensors(loaded.entry(0)), **global_tensors(loaded.all())}
    names = _names(stored, prefix)
    dst = LocalStore(out)
    groups = _groups(names, stored, max_shard_bytes)
    report = ExportReport(step, str(dst.root))
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {new: torch.empty(stored[names[new]].shape, dtype=torch_dtype(stored[names[new]].dtype)) for new in group}
        wanted = [(stored[names[new]], Target(names[new], t, Box((0,) * t.dim(), tuple(t.shape)))) for new, t in tensors.items()]
        read_all(man, loaded, wanted, loaded.sources)
        header_bytes, header = build_header(((n, stored[names[n]].dtype, tuple(t.shape)) for n, t in tensors.items()),
                                            {"format": "pt"})
        parts = [memoryview(header_bytes)] + [memoryview(tensors[n].reshape(-1).view(torch.uint8).numpy())
                                              for n in header.tensors if tensors[n].numel()]
        report.bytes += dst.put_buffers(fname, parts)
        report.files.append(fname)
        weight_map.update({n: fname for n in group})
        report.tensors += len(group)
    index = {"metadata": {"total_size": sum(math.prod(stored[names[n]].shape) * torch_dtype(stored[names[n]].dtype).itemsize
                                            for n in weight_map)}, "weight_map": weight_map}
    dst.put_buffers(INDEX, [json.dumps(index, indent=2).encode()])  # last: the directory is complete
    report.files.append(INDEX)
    return report
