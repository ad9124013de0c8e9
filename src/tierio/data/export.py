"""Copy a shard dataset into another container: ``tierio data export SRC DST --webdataset``.

The compact container is what tierio reads fastest; the WebDataset layout (plain tar files of
``.npy`` members) is what other tools read. Export reads the source shard by shard, in order,
through a local cache (or in place for a local store), and writes every sample, with the
manifest's ``meta``, through a ShardWriter of the chosen format: the copy is checksummed and
committed by its manifest like any dataset tierio writes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tierio.data.options import ShardOptions
from tierio.data.reader import ReaderOptions, ShardReader
from tierio.data.shards import ShardManifest, ShardWriter, load_manifest
from tierio.storage.base import Store
from tierio.storage import LocalStore
from tierio.storage.url import as_store

CHUNK = 1024  # samples taken from a shard at once


def export_dataset(src: str | Path | Store, dst: str | Path | Store, *, cache_dir: str | Path | None = None,
                   options: ShardOptions | None = None, **overrides: Any) -> ShardManifest:
    """Write every sample of the dataset at ``src``, in order, to ``dst`` in ``format``.

    ``options``/``overrides`` are the ShardWriter's (``format`` defaults to "tar" here, the
    layout other tools read; ``shard_bytes``). A remote source is read through ``cache_dir``
    (a temporary directory when not given)."""
    opts = (options or ShardOptions(format="tar")).with_overrides(overrides)
    store = as_store(src)
    manifest = load_manifest(store, store.url)
    scratch = None
    if cache_dir is None and not isinstance(store, LocalStore):
        cache_dir = scratch = tempfile.mkdtemp(prefix="tierio-export-")
    limit = 2 * max(manifest.max_shard_size, 1)  # one shard read at a time
    reader = ShardReader(store, manifest, ReaderOptions(None if cache_dir is None else Path(cache_dir), limit,
                                                        max_open_shards=1, prefetch=0))
    try:
        with ShardWriter(dst, manifest.fields, meta=manifest.meta, options=opts) as w:
            for s, info in enumerate(manifest.shards):
                for a in range(0, info.samples, CHUNK):
                    batch = reader.shard(s).take(np.arange(a, min(a + CHUNK, info.samples)), copy=False)
                    for i in range(min(CHUNK, info.samples - a)):
                        w.write(_row(batch, i))
                reader.keep_only(set())
        return w.manifest  # type: ignore[return-value]
    finally:
        reader.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _row(batch: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: v[i] for k, v in batch.items()}


__all__ = ["export_dataset"]
