"""`tierio bench data`: sequence packing, the loader and shard streaming, each against its peer.

One run, four figures (each a median of --repeat runs where it is timed):

  pack_fill               real tokens / slots when 1,000,000 documents with log-normal lengths
                          (mean ~400, clipped to 4,096) are packed best-fit-decreasing into 4,096
  pack_docs_per_s         documents planned per second (kept under "ratios" with the others)
  loader_vs_memmap        tokens/s through TokenWindowDataset + a 2-worker DataLoader, divided by
                          tokens/s of a plain numpy.memmap loop building the same int64 batches
  stream_cached_vs_local  second-epoch tokens/s of StreamingDataset from a local SeaweedFS S3
                          server through the NVMe cache, divided by tokens/s reading the same
                          shards from local disk in place; the first (downloading) epoch is
                          reported as stream_first_epoch_vs_local

and, against the streaming libraries (``bench_peers``, in tierio.bench.data_peers): the same
--peer-samples samples of 1,024 uint16 tokens written to one SeaweedFS bucket per library and
streamed back through a local cache in batches of 64, one process, no DataLoader workers:

  stream_vs_litdata_first_epoch, stream_vs_litdata_cached_epoch, stream_vs_mosaic_first_epoch
                          tierio samples/s / the peer's, first (downloading) and second epoch
  shard_bytes_overhead    bytes tierio stores in the bucket / raw sample bytes
  first_epoch_disk_read_ratio
                          bytes read from the local disk during tierio's first epoch (by the
                          reader and by the S3 server, /proc/PID/io read_bytes, with the
                          bucket's files dropped from the page cache first) / raw sample bytes
  workers2_vs_workers0    tierio's first epoch (``build_loader``) with 2 DataLoader workers / with
                          none, the medians of five interleaved rounds a side
  plain_dataloader_workers2_vs_workers0
                          the same through a plain ``DataLoader(ds, batch_size=64, num_workers=k)``
  workers0_first_epoch_cpu_busy
                          the share of the machine's cores busy (/proc/stat) while that plain
                          loader's first epoch ran with no worker: near 1, the reader and the S3
                          server already used every core, so workers can add only their overhead
  workers2_first_epoch_cpu_busy
                          the same with two workers (the median of the rounds of each side)
  write_vs_mds_write_upload
                          MDSWriter writing the shards locally and uploading them (seconds) /
                          tierio's ShardWriter writing them to the bucket

and a Megatron .bin/.idx read straight from S3 (``bench_s3_indexed``, in tierio.bench.data_s3):

  s3_indexed_vs_local     second-epoch samples/s from S3 through the node cache / from local disk

and the cluster figures (``tierio.bench.data_cluster``: the Ray build against the in-process builder,
datatrove and litdata, its finishing step's bytes, a 3-source blend against one source; --no-cluster
skips them).

Peers are found if installed and named when missing: ``pip install mosaicml-streaming`` and
``pip install --no-deps litdata tifffile obstore`` (litdata's release requires torchvision, which
would pull another torch build; nothing measured here uses it).
With --skip-peers tierio's part of that comparison still runs (shard_bytes_overhead,
first_epoch_disk_read_ratio, workers2_vs_workers0), without the peers.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tierio.bench import common
from tierio.bench.data_cluster import TARGETS as CLUSTER_TARGETS
from tierio.units import parse_size

TARGETS = {
    "pack_fill": (">=", 0.99),
    "pack_docs_per_s": (">=", 1_000_000),
    "loader_vs_memmap": (">=", 0.9),
    "stream_cached_vs_local": (">=", 0.9),
    "stream_vs_litdata_first_epoch": (">=", 1.2),
    "stream_vs_litdata_cached_epoch": (">=", 1.2),
    "stream_vs_mosaic_first_epoch": (">=", 3.0),
    "shard_bytes_overhead": ("<=", 1.05),
    "first_epoch_disk_read_ratio": ("<=", 1.1),
    "workers2_vs_workers0": (">=", 1.0),
    "write_vs_mds_write_upload": (">=", 1.0),
    "plain_dataloader_workers2_vs_workers0": (">=", 1.0),
    "s3_indexed_vs_local": (">=", 0.9),
    **CLUSTER_TARGETS,
}


# -- packing ---------------------------------------------------------------------------------

def lognormal_lengths(n: int, mean: float = 400.0, sigma: float = 1.0, clip: int = 4096, seed: int = 0) -> np.ndarray:
    mu = np.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma))] = mean
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, clip).astype(np.int64)


def bench_pack(n: int, seq_len: int, repeat: int) -> dict[str, Any]:
    from tierio.data.packing import plan_packing

    lens = lognormal_lengths(n, clip=seq_len)
    out: dict[str, Any] = {"docs": n, "seq_len": seq_len, "doc_len_mean": float(lens.mean()),
                           "padding_fraction_unpacked": float(1 - lens.mean() / seq_len)}
    for algo in ("bfd", "ffd"):
        times = []
        plan = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            plan = plan_packing(lens, seq_len, algorithm=algo, batch_size=8)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out[algo] = {**plan.stats.to_dict(), "seconds_median": med, "seconds": times, "docs_per_s": n / med}  # type: ignore[union-attr]
    return out


# -- loader vs memmap ----------------------------------------------------------------------------

def _token_file(work: Path, nbytes: int) -> Path:
    from tierio.data.indexed import IndexedDatasetWriter

    prefix = work / "tokens"
    rng = np.random.default_rng(1)
    per_doc = 1 << 20
    total = nbytes // 2
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for start in range(0, total, per_doc):
            w.add_document(rng.integers(0, 50000, min(per_doc, total - start), dtype=np.uint16))
    return prefix


def _memmap_loop(bin_path: Path, seq_len: int, batch: int, windows: int, passes: int = 1) -> float:
    """The peer: a plain numpy.memmap loop building the same int64 (input, label) batches."""
    mm = np.memmap(bin_path, dtype=np.uint16, mode="r")
    import torch

    t0 = time.perf_counter()
    tokens = 0
    for _ in range(passes):
        for b0 in range(0, windows - batch + 1, batch):
            rows = np.empty((batch, seq_len + 1), dtype=np.int64)
            for r in range(batch):
                s = (b0 + r) * seq_len
                rows[r] = mm[s : s + seq_len + 1]
            t = torch.from_numpy(rows)
            x, _y = t[:, :-1], t[:, 1:]  # both views, as a training step takes them
            tokens += x.numel()
    dt = time.perf_counter() - t0
    del mm
    return tokens / dt


def _loader_loop(prefix: Path, seq_len: int, batch: int, passes: int = 1) -> float:
    """tierio: TokenWindowDataset through a 2-worker DataLoader with the production settings."""
    from tierio.data.loader import build_loader, loader_settings
    from tierio.data.window import TokenWindowDataset

    ds = TokenWindowDataset(prefix, seq_len)
    loader = build_loader(ds, batch, settings=loader_settings(num_workers=2))
    it = iter(loader)
    next(it)  # worker start-up is not throughput: the clock starts after the first batch
    tokens = 0
    t0 = time.perf_counter()
    for b in it:
        tokens += b["input_ids"].numel()
    for _ in range(passes - 1):  # persistent workers: later epochs reuse them
        for b in loader:
            tokens += b["input_ids"].numel()
    dt = time.perf_counter() - t0
    return tokens / dt


def bench_loader(work: Path, nbytes: int, seq_len: int, batch: int, repeat: int, passes: int = 4) -> dict[str, Any]:
    from tierio.data.indexed import bin_path

    prefix = _token_file(work, nbytes)
    bpath = bin_path(prefix)
    windows = (bpath.stat().st_size // 2 - 1) // seq_len
    _memmap_loop(bpath, seq_len, batch, windows)  # warm the page cache: both read from memory
    mem, tio = [], []
    for _ in range(repeat):  # interleaved, so drift on a shared machine hits both alike
        mem.append(_memmap_loop(bpath, seq_len, batch, windows, passes))
        tio.append(_loader_loop(prefix, seq_len, batch, passes))
    return {"prefix": str(prefix), "bytes": bpath.stat().st_size, "windows": windows, "batch_size": batch, "workers": 2, "passes": passes,
            "memmap_tokens_per_s": statistics.median(mem), "loader_tokens_per_s": statistics.median(tio),
            "memmap_runs": mem, "loader_runs": tio}


# -- streaming: S3 through the cache vs local disk ------------------------------------------------

def _packed_samples(nbytes: int, seq_len: int):
    """Packed samples {tokens uint16, seqlens int32} totalling about ``nbytes`` of tokens."""
    from tierio.data.packing import plan_packing

    rng = np.random.default_rng(2)
    per = seq_len * 2
    count = max(1, nbytes // per)
    lens = lognormal_lengths(count * 12, clip=seq_len, seed=3)
    plan = plan_packing(lens, seq_len)
    pool = rng.integers(0, 50000, seq_len, dtype=np.uint16)
    for i in range(min(count, len(plan))):
        _, dl = plan.pack(i)
        n = int(dl.sum())
        yield {"tokens": pool[:n], "seqlens": dl.astype(np.int32)}


def _epoch(ds) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    for s in ds:
        tokens += len(s["tokens"])
    return tokens / (time.perf_counter() - t0), tokens


def bench_stream(work: Path, nbytes: int, seq_len: int, shard_size: int, repeat: int) -> dict[str, Any]:
    from tierio.data.shards import ShardWriter
    from tierio.data.streaming import StreamingDataset
    from tierio.storage import S3Store, open_store
    from tierio.storage.seaweed import SeaweedServer

    local_dir = work / "shards-local"
    with ShardWriter(open_store(str(local_dir)), ["tokens", "seqlens"], shard_bytes=shard_size) as w:
        w.write_all(_packed_samples(nbytes, seq_len))
    man = w.manifest
    assert man is not None
    with SeaweedServer(data_dir=work / "seaweed", volume_size_mb=max(256, shard_size * 4 >> 20)) as server:
        with common.environ(server.env()):
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            S3Store(bucket, endpoint=server.endpoint).create_bucket()
            url = server.url(f"{bucket}/packed")
            remote = open_store(url)
            t0 = time.perf_counter()
            for key in sorted(local_dir.iterdir()):
                if key.is_file() and not key.name.startswith("."):
                    remote.put_file(key.name, key)
            upload_s = time.perf_counter() - t0
            kw = dict(seed=0, shuffle_buffer=1024, prefetch=2)
            local_runs, cached_runs, first_runs = [], [], []
            tokens = 0
            for r in range(repeat):
                cache_dir = work / f"cache-{r}"
                stream = StreamingDataset(url, cache_dir, 4 * man.total_bytes + 1, **kw)
                first, tokens = _epoch(stream)  # epoch 0 downloads (prefetching ahead)
                cached, _ = _epoch(stream)  # epoch 1 reads the verified local copies
                local, _ = _epoch(StreamingDataset(str(local_dir), None, **kw))
                first_runs.append(first)
                cached_runs.append(cached)
                local_runs.append(local)
                shutil.rmtree(cache_dir, ignore_errors=True)
    return {"bytes": man.total_bytes, "shards": len(man.shards), "samples": man.num_samples, "tokens": tokens,
            "upload_s": upload_s,
            "local_tokens_per_s": statistics.median(local_runs),
            "cached_tokens_per_s": statistics.median(cached_runs),
            "first_epoch_tokens_per_s": statistics.median(first_runs),
            "local_runs": local_runs, "cached_runs": cached_runs, "first_epoch_runs": first_runs}


def run(args: argparse.Namespace) -> dict[str, Any]:
    own = args.dir is None
    work = common.work_dir(args.dir, "data")  # --dir is created if it does not exist
    try:
        pack = bench_pack(args.docs, args.seq_len, args.repeat)
        loader = bench_loader(work, parse_size(args.loader_size), args.seq_len, args.batch_size, args.repeat, args.passes)
        stream = peers = indexed = None
        cluster = None if args.no_cluster else _cluster(work, args)
        if not args.skip_s3:
            stream = bench_stream(work, parse_size(args.stream_size), args.seq_len, parse_size(args.shard_size), args.repeat)
            from tierio.bench.data_peers import bench_peers

            peers = bench_peers(work, args.peer_samples, with_peers=not args.skip_peers)
            from tierio.bench.data_s3 import bench_s3_indexed

            indexed = bench_s3_indexed(work, Path(loader["prefix"]), args.seq_len, args.batch_size, args.repeat)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    ratios: dict[str, Any] = {
        "pack_fill": round(pack["bfd"]["fill"], 5),
        "pack_docs_per_s": round(pack["bfd"]["docs_per_s"]),
        "loader_vs_memmap": common.ratio(loader["loader_tokens_per_s"], loader["memmap_tokens_per_s"]),
    }
    if stream is not None:
        ratios["stream_cached_vs_local"] = common.ratio(stream["cached_tokens_per_s"], stream["local_tokens_per_s"])
        ratios["stream_first_epoch_vs_local"] = common.ratio(stream["first_epoch_tokens_per_s"], stream["local_tokens_per_s"])
    if peers is not None:
        ratios.update(peers["ratios"])
    if indexed is not None:
        ratios.update(indexed["ratios"])
    for part in (cluster or {}).values():
        ratios.update(part.get("ratios", {}))
    return {
        "benchmark": "data",
        "machine": common.machine_facts(),
        "ratios": ratios,
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "met": common.check_targets(ratios, TARGETS),
        "pack": pack,
        "loader": loader,
        "stream": stream,
        "peers": peers,
        "indexed_s3": indexed,
        "cluster": cluster,
    }


def _cluster(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from tierio.bench.data_cluster import bench_blend, bench_build

    out: dict[str, Any] = {"blend": bench_blend(work, args.repeat)}
    try:
        import ray  # noqa: F401
    except ImportError:
        out["build"] = {"missing": "pip install 'tierio[ray]'"}
        return out
    out["build"] = bench_build(work, parse_size(args.build_size), args.repeat, with_peers=not args.skip_peers)
    return out
