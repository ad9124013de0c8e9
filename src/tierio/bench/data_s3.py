"""A Megatron ``.bin``/``.idx`` dataset read straight from S3, against the same file on local disk.

One token file (--loader-size) is copied to a SeaweedFS bucket; each side reads one epoch of
``seq_len`` windows in a shuffled order, as GPT pretraining samples them, in batches gathered by
``TokenWindowDataset.__getitems__`` (no DataLoader workers: the dataset's own read path is timed):

  local       the pair on local disk, mapped (the page cache warm: the reference)
  s3_cache    from S3 through the node cache: the first epoch fetches the whole .bin, the second
              reads the cached copy (a fresh cache every round)
  s3_ranges   from S3 by ranged GETs (bin_reads="ranges": what a .bin larger than the cache gets),
              one GET per shuffled window; the first 2,048 windows of its epoch are timed

  s3_indexed_vs_local                second-epoch samples/s from S3 through the cache / local
  s3_indexed_first_epoch_vs_local    the same for the first (fetching) epoch
  s3_ranges_vs_local                 samples/s by ranged GETs / local

Rounds are interleaved (``common.alternate``), at least MIN_ROUNDS of them; each figure is the
median over the rounds.
"""

from __future__ import annotations

import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tierio.bench import common


RANGES_SAMPLES = 2048  # by ranges every window is a GET: time this many, not a whole epoch
# An epoch of the benchmark's file takes a fraction of a second, and the VM's pauses are as long:
# with three rounds a side the same code measured 0.865 and 1.143 (the blend has the same rule)
MIN_ROUNDS = 5


def _epoch(ds, seq_len: int, batch: int, seed: int, limit: int | None = None) -> float:
    """Samples/s of one shuffled epoch of windows (its first ``limit``), gathered a batch at a time."""
    from tierio.data.window import TokenWindowDataset

    win = TokenWindowDataset(ds, seq_len)
    order = np.random.default_rng(seed).permutation(len(win))[:limit]
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        win.__getitems__(order[b : b + batch].tolist())
    return len(order) / (time.perf_counter() - t0)


def bench_s3_indexed(work: Path, prefix: Path, seq_len: int, batch: int, rounds: int) -> dict[str, Any]:
    from tierio.data.indexed import IndexedDataset
    from tierio.data.remote_pair import RemoteOptions
    from tierio.storage import S3Store, open_store
    from tierio.storage.seaweed import SeaweedServer

    nbytes = prefix.with_suffix(".bin").stat().st_size
    with SeaweedServer(data_dir=work / "seaweed-indexed", volume_size_mb=max(256, nbytes * 2 >> 20)) as server:
        with common.environ(server.env()):
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            S3Store(bucket, endpoint=server.endpoint).create_bucket()
            store_url = server.url(bucket)
            store = open_store(store_url)
            for suffix in (".bin", ".idx"):
                store.put_file(f"{prefix.name}{suffix}", prefix.with_suffix(suffix))
            base, _, query = store_url.partition("?")
            url = f"{base.rstrip('/')}/{prefix.name}?{query}"
            local = IndexedDataset(prefix)
            _epoch(local, seq_len, batch, 0)  # the page cache warm for the reference
            firsts: list[float] = []

            def cached() -> float:
                cache = work / "indexed-cache"
                shutil.rmtree(cache, ignore_errors=True)
                ds = IndexedDataset(url, remote=RemoteOptions(cache_dir=cache))
                try:
                    firsts.append(_epoch(ds, seq_len, batch, 1))
                    return _epoch(ds, seq_len, batch, 2)
                finally:
                    ds.close()

            def ranges() -> float:
                ds = IndexedDataset(url, remote=RemoteOptions(cache_dir=work / "indexed-cache-r", bin_reads="ranges"))
                try:
                    return _epoch(ds, seq_len, batch, 1, RANGES_SAMPLES)
                finally:
                    ds.close()

            runs = common.alternate({"local": lambda: _epoch(local, seq_len, batch, 2), "s3_cache": cached,
                                     "s3_ranges": ranges}, max(rounds, MIN_ROUNDS))
            local.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"bin_bytes": nbytes, "seq_len": seq_len, "batch": batch,
            "local_samples_per_s": med["local"], "s3_cached_samples_per_s": med["s3_cache"],
            "s3_first_epoch_samples_per_s": statistics.median(firsts), "s3_ranges_samples_per_s": med["s3_ranges"],
            "runs": {**runs, "s3_first_epoch": firsts},
            "ratios": {"s3_indexed_vs_local": common.ratio(med["s3_cache"], med["local"]),
                       "s3_indexed_first_epoch_vs_local": common.ratio(statistics.median(firsts), med["local"]),
                       "s3_ranges_vs_local": common.ratio(med["s3_ranges"], med["local"])}}
