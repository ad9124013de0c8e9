"""tierio against litdata and MosaicML Streaming: the same samples, one SeaweedFS server.

Every library writes the same ``n`` samples of 1,024 uint16 tokens (row ``i`` of one seeded
array) to its own bucket on one local SeaweedFS server, then streams them back through a fresh
local cache in batches of 64, shuffled, in one process without DataLoader workers, the way each
library's documentation shows: tierio ``ShardWriter`` + ``StreamingDataset`` + ``build_loader``,
litdata ``optimize`` + ``StreamingDataset`` + ``StreamingDataLoader``, MosaicML ``MDSWriter`` +
``StreamingDataset`` + ``DataLoader``. Each gets a first (downloading) and a second (cached)
epoch. A library that is not installed is named in ``missing`` and its ratios are left out.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tierio.bench import common

TOKENS = 1024
BATCH = 64
SHARD_BYTES = 64 << 20  # every library cuts its shards at 64 MiB (MDS and litdata defaults too)
PLAIN_ROUNDS = 5  # a first epoch here lasts ~1.3 s and swings by 10-20 % between runs of either side
INSTALL = "pip install mosaicml-streaming; pip install --no-deps litdata tifffile obstore"


def samples(n: int) -> np.ndarray:
    """The benchmark's data: ``n`` rows of TOKENS uint16 tokens, the same for every library."""
    return np.random.default_rng(17).integers(0, 50_000, (n, TOKENS), dtype=np.uint16)


@dataclass
class Streamed:
    """One library's run: seconds to write to its bucket, bytes there, and samples/s per epoch."""

    library: str
    write_s: float
    bucket_bytes: int
    first_epoch: float
    cached_epoch: float
    first_epoch_disk_read: int | None = None  # bytes, reader + S3 server, page cache dropped first
    workers: int = 0
    first_epoch_cpu_busy: float | None = None  # the machine's cores busy during the first epoch (0..1)


@dataclass(frozen=True)
class ServerRef:
    """What a library's run needs of the S3 server (it runs in a process of its own)."""

    endpoint: str
    access_key: str
    secret_key: str
    pid: int
    data_dir: str

    def url(self, bucket_and_prefix: str) -> str:
        return f"s3://{bucket_and_prefix.strip('/')}?endpoint={self.endpoint}"

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                "S3_ENDPOINT_URL": self.endpoint}  # MosaicML reads its endpoint from S3_ENDPOINT_URL


# -- finding the peers ----------------------------------------------------------------------------
def import_litdata() -> types.ModuleType | None:
    try:
        import litdata
        from litdata.streaming import downloader  # noqa: F401 - the S3 client options live there
    except ImportError:
        return None
    return litdata


def installed_peers() -> list[str]:
    """The peers that look installed (not imported yet: importing them changes process-wide
    settings, such as litdata's multiprocessing start method, so each is imported in its turn)."""
    return [name for name, module in (("litdata", "litdata"), ("mosaic", "streaming"))
            if importlib.util.find_spec(module) is not None]


def _import_mosaic() -> types.ModuleType | None:
    try:
        return importlib.import_module("streaming")
    except ImportError as exc:
        if "torchvision" not in str(exc):
            return None
    except RuntimeError:  # a torchvision built for another torch fails while registering its operators
        pass
    # ``import streaming`` imports its image datasets, which need torchvision (absent, or not
    # loadable beside a CPU build of torch); nothing here uses them: an empty package stands in.
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith(("torchvision.", "streaming"))]:
        sys.modules.pop(name, None)
    sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")
    try:
        return importlib.import_module("streaming")
    except (ImportError, RuntimeError):
        return None


# -- measuring ------------------------------------------------------------------------------------
def _read_bytes(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
        except (OSError, StopIteration, ValueError):
            pass
    return total


def _tree(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid, *(q for c in out for q in _tree(int(c)))]


def _epoch(batches: Iterable[Any], rows: Callable[[Any], int]) -> float:
    t0 = time.perf_counter()
    n = 0
    for b in batches:
        n += rows(b)
    return n / (time.perf_counter() - t0)


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, *rest = (int(x) for x in f.readline().split()[1:])
    return user + nice + system + sum(rest[:3]), user + nice + system + idle + iowait + sum(rest[:3])


def _epochs(loader: Any, rows: Callable[[Any], int], server: ServerRef | None, measure_disk: bool
            ) -> tuple[float, float, int | None, float]:
    """(first, second epoch samples/s, bytes read from the disk during the first, the share of
    the machine's cores busy during the first: near 1, no core was left for more workers)."""
    measure_disk = measure_disk and server is not None  # no server: nothing of its reads to count
    pids = [os.getpid(), *_tree(server.pid)] if measure_disk else []
    if measure_disk:
        common.drop_caches([server.data_dir])
    before, cpu0 = _read_bytes(pids), _cpu_jiffies()
    first = _epoch(loader, rows)
    cpu1 = _cpu_jiffies()
    disk = _read_bytes(pids) - before if measure_disk else None
    busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    return first, _epoch(loader, rows), disk, busy


def _bucket(server: ServerRef) -> tuple[str, Any]:
    from tierio.storage import S3Store

    name = f"peers-{uuid.uuid4().hex[:8]}"
    store = S3Store(name, endpoint=server.endpoint)
    store.create_bucket()
    store.put_buffers(".warm", [b"x"])  # a new bucket's first write waits for its volumes
    return name, store


def _bytes_under(store: Any, prefix: str) -> int:
    return sum(store.stat(k).size for k in store.list(prefix))


def _batch_rows(b: Any) -> int:
    if isinstance(b, dict):
        return len(next(iter(b.values())))
    return len(b)


# -- the libraries ----------------------------------------------------------------------------------
def run_tierio(server: ServerRef, data: np.ndarray, work: Path, workers: tuple[int, ...] = (0, 2)) -> list[Streamed]:
    from tierio.data.loader import build_loader, loader_settings
    from tierio.data.shards import ShardWriter
    from tierio.data.streaming import StreamingDataset

    bucket, store = _bucket(server)
    url = server.url(f"{bucket}/tierio")
    t0 = time.perf_counter()
    with ShardWriter(url, ["tokens"], shard_bytes=SHARD_BYTES) as w:
        for row in data:
            w.write({"tokens": row})
    write_s = time.perf_counter() - t0
    stored = _bytes_under(store, "tierio")
    seen: dict[int, list[Streamed]] = {k: [] for k in workers}

    def run(k: int) -> float:
        cache = work / f"tierio-cache-{k}"
        ds = StreamingDataset(url, cache, 4 * data.nbytes + (1 << 30), batch_size=BATCH, seed=0)
        loader = build_loader(ds, BATCH, settings=loader_settings(num_workers=k, drop_last=False))
        # from the server's disk, as the peers' first epochs (its files dropped from the page cache);
        # the reads are counted without workers (their processes' reads are not in the count)
        first, cached, disk, busy = _epochs(loader, _batch_rows, server, measure_disk=True)
        seen[k].append(Streamed("tierio", write_s, stored, first, cached, disk if k == 0 else None, k, busy))
        del loader, ds
        shutil.rmtree(cache, ignore_errors=True)
        return first

    # with and without workers compare within a few percent: interleaved rounds, as the plain loader's
    common.alternate({str(k): (lambda k=k: run(k)) for k in workers}, PLAIN_ROUNDS if len(workers) > 1 else 1)
    return [_median(seen[k]) for k in workers] + _plain_dataloader(url, data, work, write_s, stored)


def _median(runs: list[Streamed]) -> Streamed:
    """One side's rounds as one run: the median of each figure it has."""
    def median(values: list[Any]) -> Any:
        got = [v for v in values if v is not None]
        return statistics.median(got) if got else None

    return replace(runs[0], first_epoch=median([r.first_epoch for r in runs]),
                   cached_epoch=median([r.cached_epoch for r in runs]),
                   first_epoch_disk_read=median([r.first_epoch_disk_read for r in runs]),
                   first_epoch_cpu_busy=median([r.first_epoch_cpu_busy for r in runs]))


def _plain_dataloader(url: str, data: np.ndarray, work: Path, write_s: float, stored: int) -> list[Streamed]:
    """The same dataset in a plain ``DataLoader(ds, batch_size=64, num_workers=k)``, as a user drops
    it into the loader their code already has: k = 0 and 2 in PLAIN_ROUNDS interleaved rounds
    (``common.alternate``), each from a fresh cache; the median of each side's rounds."""
    from torch.utils.data import DataLoader

    from tierio.data.streaming import StreamingDataset

    seen: dict[int, list[Streamed]] = {0: [], 2: []}

    def run(k: int) -> float:
        cache = work / f"tierio-plain-cache-{k}"
        loader = DataLoader(StreamingDataset(url, cache, 4 * data.nbytes + (1 << 30), seed=0), batch_size=BATCH,
                            num_workers=k)
        first, cached, _, busy = _epochs(loader, _batch_rows, None, measure_disk=False)
        seen[k].append(Streamed("tierio-plain", write_s, stored, first, cached, None, k, busy))
        del loader
        shutil.rmtree(cache, ignore_errors=True)
        return first

    common.alternate({"0": lambda: run(0), "2": lambda: run(2)}, PLAIN_ROUNDS)
    return [_median(seen[k]) for k in (0, 2)]


def run_mosaic(streaming: types.ModuleType, server: ServerRef, data: np.ndarray, work: Path) -> Streamed:
    from torch.utils.data import DataLoader

    bucket, store = _bucket(server)
    remote = f"s3://{bucket}/mds"
    local = work / "mds-local"
    t0 = time.perf_counter()
    with streaming.MDSWriter(out=(str(local), remote), columns={"tokens": f"ndarray:uint16:{TOKENS}"},
                             size_limit=SHARD_BYTES) as w:
        for row in data:
            w.write({"tokens": row})
    write_s = time.perf_counter() - t0
    shutil.rmtree(local, ignore_errors=True)
    streaming.base.util.clean_stale_shared_memory()
    ds = streaming.StreamingDataset(remote=remote, local=str(work / "mds-cache"), batch_size=BATCH, shuffle=True,
                                    shuffle_seed=0)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0)
    first, cached, disk, _ = _epochs(loader, _batch_rows, server, measure_disk=True)
    del loader, ds
    streaming.base.util.clean_stale_shared_memory()
    return Streamed("mosaic", write_s, _bytes_under(store, "mds"), first, cached, disk)


def _litdata_item(item: tuple[int, int]) -> np.ndarray:
    """litdata's optimize workers run in fresh processes: row ``i`` of the same seeded data."""
    i, n = item
    rows = _LITDATA_ROWS.get(n)
    if rows is None:
        rows = _LITDATA_ROWS[n] = samples(n)
    return rows[i]


_LITDATA_ROWS: dict[int, np.ndarray] = {}


def run_litdata(litdata: types.ModuleType, server: ServerRef, data: np.ndarray, work: Path) -> Streamed:
    from litdata.streaming import downloader

    # litdata's S3 reads go through obstore, which refuses a plain-http endpoint unless told
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    bucket, store = _bucket(server)
    opts = {"endpoint_url": server.endpoint, "aws_access_key_id": server.access_key,
            "aws_secret_access_key": server.secret_key}
    n = len(data)
    t0 = time.perf_counter()
    litdata.optimize(fn=_litdata_item, inputs=[(i, n) for i in range(n)], output_dir=f"s3://{bucket}/lit",
                     chunk_bytes=SHARD_BYTES, num_workers=1, storage_options=opts, mode="overwrite")
    write_s = time.perf_counter() - t0
    ds = litdata.StreamingDataset(f"s3://{bucket}/lit", cache_dir=str(work / "lit-cache"), storage_options=opts,
                                  shuffle=True, seed=0)
    loader = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=0)
    first, cached, disk, _ = _epochs(loader, _batch_rows, server, measure_disk=True)
    return Streamed("litdata", write_s, _bytes_under(store, "lit"), first, cached, disk)


RUNS: dict[str, Callable[[ServerRef, np.ndarray, Path], list[Streamed]]] = {
    "tierio": lambda server, data, work: run_tierio(server, data, work),
    "mosaic": lambda server, data, work: [run_mosaic(_import_mosaic(), server, data, work)],  # type: ignore[arg-type]
    "litdata": lambda server, data, work: [run_litdata(import_litdata(), server, data, work)],  # type: ignore[arg-type]
}


def _run_apart(library: str, server: ServerRef, n: int, work: Path) -> list[Streamed]:
    """One library's run in a fresh interpreter: the peers change process-wide state when imported
    (start methods, runtimes, shared memory), which must not leak into each other's figures."""
    env = {**os.environ, **server.env(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    args = [sys.executable, "-m", "tierio.bench.data_peers", library, str(n), str(work), json.dumps(asdict(server))]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode or not lines:
        raise RuntimeError(f"the {library} run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return [Streamed(**r) for r in json.loads(lines[-1][len(RESULT):])]


RESULT = "tierio-bench-result: "


def bench_peers(work: Path, n: int, with_peers: bool = True) -> dict[str, Any]:
    """The comparison; ``with_peers=False`` runs tierio's part alone (its own ratios: bytes in the
    bucket, disk reads, 2 workers vs none)."""
    from tierio.storage.seaweed import SeaweedServer

    present = installed_peers() if with_peers else []
    missing = [name for name, key in (("litdata", "litdata"), ("mosaicml-streaming", "mosaic"))
               if key not in present] if with_peers else []
    raw = n * TOKENS * 2
    runs: list[Streamed] = []
    with SeaweedServer(data_dir=work / "seaweed-peers", volume_size_mb=1024) as server:
        ref = ServerRef(server.endpoint, server.access_key, server.secret_key, server._proc.pid,  # type: ignore[union-attr]
                        str(server.data_dir))
        for library in ["tierio", *present]:
            runs += _run_apart(library, ref, n, work)
    by = {(r.library, r.workers): r for r in runs}
    tio, tio2 = by[("tierio", 0)], by.get(("tierio", 2))
    ratios: dict[str, float] = {
        "shard_bytes_overhead": common.ratio(tio.bucket_bytes, raw),
        "first_epoch_disk_read_ratio": common.ratio(tio.first_epoch_disk_read or 0, raw),
    }
    if tio2 is not None:
        ratios["workers2_vs_workers0"] = common.ratio(tio2.first_epoch, tio.first_epoch)
    plain0, plain2 = by.get(("tierio-plain", 0)), by.get(("tierio-plain", 2))
    if plain0 is not None and plain2 is not None:
        ratios["plain_dataloader_workers2_vs_workers0"] = common.ratio(plain2.first_epoch, plain0.first_epoch)
        # the machine's bound on both workers ratios: with no worker, how busy its cores already were
        ratios["workers0_first_epoch_cpu_busy"] = round(plain0.first_epoch_cpu_busy or 0.0, 3)
        ratios["workers2_first_epoch_cpu_busy"] = round(plain2.first_epoch_cpu_busy or 0.0, 3)
    if ("litdata", 0) in by:
        lit = by[("litdata", 0)]
        ratios["stream_vs_litdata_first_epoch"] = common.ratio(tio.first_epoch, lit.first_epoch)
        ratios["stream_vs_litdata_cached_epoch"] = common.ratio(tio.cached_epoch, lit.cached_epoch)
    if ("mosaic", 0) in by:
        mds = by[("mosaic", 0)]
        ratios["stream_vs_mosaic_first_epoch"] = common.ratio(tio.first_epoch, mds.first_epoch)
        ratios["write_vs_mds_write_upload"] = common.ratio(mds.write_s, tio.write_s)
    return {"samples": n, "tokens_per_sample": TOKENS, "batch_size": BATCH, "raw_bytes": raw,
            "runs": [asdict(r) for r in runs], "missing": missing,
            "install_missing": INSTALL if missing else None, "ratios": ratios}


def main(argv: list[str]) -> None:
    library, n, work, server = argv[0], int(argv[1]), Path(argv[2]), ServerRef(**json.loads(argv[3]))
    os.environ.update(server.env())
    runs = RUNS[library](server, samples(n), work)
    print(RESULT + json.dumps([asdict(r) for r in runs]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
