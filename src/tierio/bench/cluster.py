"""`tierio bench ckpt --ranks N`: multi-rank checkpoints with real gloo processes on one disk.

One run, on one directory, page cache dropped before every read; every comparison alternates its
sides over ``--repeat`` (at most 5) rounds and takes medians, fio included (this disk's speed
moves by 2x within minutes):

  multirank_persist_vs_fio            aggregate write-phase GB/s of N ranks saving at once (each rank's
                                      staged -> committed, first start to last commit) / fio O_DIRECT
                                      write with N jobs of the same total size
  reshard_restore_vs_dcp_load         dcp.load (FileSystemReader) seconds of an N-rank FSDP2 checkpoint
                                      on N/2 ranks / CheckpointManager.restore seconds of the same
  dcp_tierio_writer_vs_filesystem_writer   dcp.save seconds with FileSystemWriter (sync_files) / with
                                      TierioWriter, N ranks, the same FSDP2 state
  dcp_tierio_reader_vs_filesystem_reader   the same for dcp.load on N ranks
  replicated_bytes_written            bytes written / unique bytes, for a state half of whose bytes are
                                      replicated DTensors

``--commit-scale 1,64,1024`` measures the commit instead: threads write the shards and records of
that many simulated ranks into a real directory (and a SeaweedFS bucket with ``--s3``), then the time
from the last one being durable to the manifest being committed, and the files and requests per rank.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tierio.bench import common
from tierio.errors import ConfigError
from tierio.units import human_bytes, parse_size

TARGETS = {
    "multirank_persist_vs_fio": (">=", 0.85),
    "reshard_restore_vs_dcp_load": (">=", 1.5),
    "dcp_tierio_writer_vs_filesystem_writer": (">=", 1.3),
    "dcp_tierio_reader_vs_filesystem_reader": (">=", 1.0),
    "replicated_bytes_written": ("<=", 1.01),
}
LAYER = (4096, 4096)  # fp32 Linear weights of the FSDP2 model: 64 MiB each


def _log(msg: str) -> None:
    print(f"bench ckpt: {msg}", file=sys.stderr, flush=True)


# -- inside each rank ------------------------------------------------------------------------------
def _fsdp_model(mesh: Any, layers: int) -> torch.nn.Module:
    """A stack of Linear layers sharded with FSDP2, built on the meta device and filled locally
    (no rank ever holds the whole model)."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(LAYER[1], LAYER[0], bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(1234 + mesh.get_coordinate()[0])
    with torch.no_grad():
        for p in model.parameters():
            p._local_tensor.view(torch.int32).random_(generator=g)  # noqa: SLF001 - a DTensor's local shard
            p._local_tensor.nan_to_num_()  # noqa: SLF001
    return model


def _timed(fn: Any, group: Any = None, cpu: dict[str, list[float]] | None = None, key: str = "") -> float:
    """Seconds for ``fn`` on every rank of ``group``: first start to last end (a barrier each side).
    With ``cpu``, ``cpu[key]`` gets the CPU seconds all ranks spent (every thread) appended: on a
    machine with fewer cores than ranks, it tells a CPU-bound phase from one that waits for the disk."""
    import torch.distributed as dist

    dist.barrier(group=group)
    t0, c0 = time.time(), time.process_time()
    fn()
    end, c1 = time.time(), time.process_time()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (t0, end, c1 - c0), group=group)
    if cpu is not None:
        cpu.setdefault(key, []).append(sum(c for _, _, c in out))
    return max(e for _, e, _ in out) - min(s for s, _, _ in out)


def _drop(paths: list[Path], rank: int, group: Any = None) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)
    if rank == 0:
        common.drop_caches(paths)
    dist.barrier(group=group)


def _persist(work: Path, rank: int, world: int, size: int, tensors: int, repeat: int) -> dict[str, Any]:
    """Every rank saves its share of ``size`` at once, ``repeat`` times after a warm-up; before
    each save rank 0 runs fio's O_DIRECT write with ``world`` jobs of the same total size, so the
    two sides alternate on the same disk (its speed moves by 2x within minutes)."""
    import torch.distributed as dist

    from tierio.bench.state import make_state, state_nbytes
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    state = make_state(size // world, max(1, tensors // world), seed=rank)
    spans, walls, cpus, fio = [], [], [], []
    with CheckpointManager([Tier(str(work / "persist"), KeepLast(2))], min_keep=1) as mgr:
        for step in range(1, repeat + 2):
            state["step"] = step
            if step > 1 and rank == 0:
                fio.append(common.run_fio(work / "fio-write", "write", size // world, jobs=world)["bytes_per_s"])
            dist.barrier()
            t0, c0 = time.time(), time.process_time()
            h = mgr.save(step, state)
            t1 = time.time()
            h.persisted.result()
            t2, c2 = time.time(), time.process_time()
            got: list[Any] = [None] * world
            dist.all_gather_object(got, (t0, t1, t2, c2 - c0))
            if step > 1:  # the first save allocates and faults the staging buffer
                spans.append(max(g[2] for g in got) - min(g[1] for g in got))
                walls.append(max(g[2] for g in got) - min(g[0] for g in got))
                cpus.append(sum(g[3] for g in got))
    return {"bytes": state_nbytes(state) * world, "write_s": statistics.median(spans), "persist_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus),  # CPU seconds of all ranks per save, staging to durable
            "write_s_samples": spans, "fio_write_bytes_per_s": statistics.median(fio) if fio else None, "fio_samples": fio}


def _buddy(work: Path, rank: int, world: int, size: int, repeat: int) -> dict[str, Any]:
    """Two "nodes" of world/2 ranks, node-local tier 0, buddy=True: how long each rank's exchange
    with its partner takes once its shard is durable (it runs behind save, on its own thread)."""
    import torch.distributed as dist

    from tierio.bench.state import make_state, state_nbytes
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    node = rank // (world // 2)
    state = make_state(size // world, 4, seed=rank)
    tiers = [Tier(str(work / f"buddy-node{node}"), KeepLast(2), scope="node"), Tier(str(work / "buddy-shared"), KeepLast(2))]
    spans, blocks = [], []
    with CheckpointManager(tiers, min_keep=1, node=f"node{node}", buddy=True, buddy_bandwidth=0) as mgr:
        for step in range(1, repeat + 2):
            state["step"] = step
            dist.barrier()
            h = mgr.save(step, state)
            h.persisted.result()
            t1 = time.time()
            h.buddied.result()
            got: list[Any] = [None] * world
            dist.all_gather_object(got, (t1, time.time(), h.blocking_seconds))
            h.wait()
            if step > 1:
                spans.append(max(g[1] for g in got) - min(g[0] for g in got))
                blocks.append(max(g[2] for g in got))
    nbytes = state_nbytes(state) * world
    return {"bytes": nbytes, "exchange_s": statistics.median(spans), "exchange_bytes_per_s": nbytes / statistics.median(spans),
            "save_blocking_s": statistics.median(blocks)}  # every rank sends its shard and receives its source's


def _replicated(work: Path, rank: int, world: int, size: int) -> dict[str, Any]:
    """Half the bytes Shard(0), half Replicate: bytes written / unique bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tierio.ckpt import CheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, size // 2 // (1024 * 4))
    g = torch.Generator().manual_seed(7)
    sharded = distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
    replicated = distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Replicate()])
    root = work / "replicated"
    with CheckpointManager([str(root)]) as mgr:
        mgr.save(1, {"sharded": sharded, "replicated": replicated}).wait()
    written = sum(f.stat().st_size for f in (root / "step_000000001").glob("*.safetensors"))
    return {"written": written, "unique": 2 * rows * 1024 * 4}


def _dcp_phase(work: Path, rank: int, world: int, layers: int, rounds: int) -> dict[str, Any]:
    """DCP save and load with FileSystemWriter/Reader and TierioWriter/Reader on ``world`` ranks, then
    the resharding load onto ``world // 2`` ranks: dcp.load against CheckpointManager.restore, with
    fio's O_DIRECT read of the same bytes by as many jobs as readers. Each comparison runs in
    ``rounds`` interleaved rounds (common.alternate); seconds are medians, samples in ``samples``."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh

    from tierio.ckpt import CheckpointManager
    from tierio.ckpt.dcp import TierioReader, TierioWriter

    warnings.simplefilter("ignore")
    half = world // 2
    sub = dist.new_group(list(range(half)))
    mesh = DeviceMesh("cpu", list(range(world)))
    mesh_half = DeviceMesh("cpu", list(range(half)))
    nbytes = layers * LAYER[0] * LAYER[1] * 4
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def timed(key: str, fn: Any, group: Any = None) -> Any:
        return lambda: _timed(fn, group, cpu, key)

    def drop(paths: list[Path], group: Any = None) -> Any:
        return lambda: _drop(paths, rank, group)

    def fio_read(jobs: int, **how: Any) -> Any:
        """The disk reading the same bytes with ``jobs`` fio jobs, one per reader (``how``: fio's
        queue depth, buffered): rank 0 runs it, and its figure is the one reported."""
        def run() -> float:
            if rank:
                return 0.0
            # fio's own runtime, without its start-up
            return common.run_fio(work / f"fio-read-{jobs}", "read", nbytes // jobs, jobs=jobs, keep=True, **how)["seconds"]
        return run

    model = _fsdp_model(mesh, layers)
    sd = {"model": get_model_state_dict(model)}
    fs, tio, native = work / "dcp-fs", work / "dcp-tierio", work / "tierio-native"
    fs_saves = iter(range(rounds))
    with CheckpointManager([str(tio)]) as mgr:
        steps = iter(range(1, rounds + 1))
        samples |= common.alternate({
            "dcp_fs_save_s": timed("dcp_fs_save_s", lambda: dcp.save(
                sd, storage_writer=dcp.FileSystemWriter(str(fs / str(next(fs_saves))), sync_files=True))),
            "dcp_tierio_save_s": timed("dcp_tierio_save_s", lambda: dcp.save(sd, storage_writer=TierioWriter(mgr, step=next(steps)))),
        }, rounds)
        mgr.wait()
    with CheckpointManager([str(native)]) as mgr:
        samples["tierio_save_s"] = [timed("tierio_save_s", lambda: mgr.save(1, sd).wait())()]
    last_fs = fs / str(rounds - 1)
    fio_read(world)()  # lays the files out, untimed, before the rounds
    samples |= common.alternate({
        "dcp_fs_load_s": timed("dcp_fs_load_s", lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(str(last_fs)))),
        "dcp_tierio_load_s": timed("dcp_tierio_load_s", lambda: dcp.load(sd, storage_reader=TierioReader(str(tio)))),
        "fio_read_s": fio_read(world),  # O_DIRECT, 8 MiB, depth 8, a job per rank
    }, rounds, drop([fs, tio, work / f"fio-read-{world}"]))
    model = sd = None  # free the full-world state before the half-world one
    # the resharding: the same checkpoints onto half the ranks
    if rank < half:
        small = _fsdp_model(mesh_half, layers)
        sd2 = {"model": get_model_state_dict(small)}
        fio_read(half)()  # lays the files out, untimed, before the rounds
        with CheckpointManager([str(native)], process_group=sub) as mgr:
            samples |= common.alternate({
                "reshard_dcp_load_s": timed("reshard_dcp_load_s", lambda: dcp.load(
                    sd2, storage_reader=dcp.FileSystemReader(str(last_fs)), process_group=sub), sub),
                "reshard_tierio_restore_s": timed("reshard_tierio_restore_s", lambda: mgr.restore(into=sd2), sub),
                "reshard_fio_read_s": fio_read(half),  # the job the targets name: O_DIRECT, 8 MiB, depth 8
                # the disk's best: deeper queues, and the page cache with readahead (as dcp.load reads)
                "reshard_fio_read_qd32_s": fio_read(half, iodepth=32),
                "reshard_fio_read_buffered_s": fio_read(half, direct=False),
            }, rounds, drop([last_fs, native, work / f"fio-read-{half}"], sub))
    dist.barrier()
    if rank == 0:
        for jobs in (world, half):
            shutil.rmtree(work / f"fio-read-{jobs}", ignore_errors=True)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    out["samples"] = samples
    out["cpu_s"] = {k: statistics.median(v) for k, v in cpu.items()}  # CPU seconds of all ranks in each timed phase
    out["state_bytes"] = nbytes
    return out


def rank_main(rank: int, world: int, cfg: dict[str, Any], init: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        work = Path(cfg["work"])
        result: dict[str, Any] = {}
        if rank == 0:
            _log(f"{world} ranks: concurrent saves of {human_bytes(cfg['size'])}")
        result["persist"] = _persist(work, rank, world, cfg["size"], cfg["tensors"], cfg["repeat"])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work / "persist", ignore_errors=True)
        if rank == 0:
            _log("FSDP2 state: DCP FileSystemWriter/Reader, TierioWriter/Reader, resharding onto half the ranks")
        result["dcp"] = _dcp_phase(work, rank, world, cfg["layers"], cfg["repeat"])
        if rank == 0:
            _log("half-replicated state")
        result["replicated"] = _replicated(work, rank, world, cfg["size"] // 4)
        if rank == 0:
            _log("buddy copies: two nodes of half the ranks, each rank's shard to the other node")
        result["buddy"] = _buddy(work, rank, world, cfg["size"] // 4, cfg["repeat"])
        if rank == 0:
            (work / "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------
def run_ranks(args: Any) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    world = args.ranks
    if world < 2 or world % 2:
        raise ConfigError("--ranks must be an even number of at least 2 (the resharding runs on half of them)")
    size = parse_size(args.size)
    layers = max(world, -(-size // (LAYER[0] * LAYER[1] * 4)))
    work = common.work_dir(args.dir, "cluster")
    load = {"start": os.getloadavg()[0]}  # other work on the machine competes for its cores
    try:
        cfg = {"work": str(work), "size": size, "tensors": args.tensors, "repeat": max(1, min(args.repeat, 5)), "layers": layers}
        tmp.start_processes(rank_main, args=(world, cfg, f"file://{work}/pg"), nprocs=world, start_method="spawn")
        r = json.loads((work / "result.json").read_text())
        load["end"] = os.getloadavg()[0]
    finally:
        if not getattr(args, "keep", False):
            shutil.rmtree(work, ignore_errors=True)
    p, d, rep = r["persist"], r["dcp"], r["replicated"]
    fio = p["fio_write_bytes_per_s"]
    d["reshard_fio_best_s"] = min(d[k] for k in ("reshard_fio_read_s", "reshard_fio_read_qd32_s", "reshard_fio_read_buffered_s"))
    fio_read = {f"{n}_jobs{how}": d["state_bytes"] / d[key] for n, how, key in (
        (world, "", "fio_read_s"), (world // 2, "", "reshard_fio_read_s"),
        (world // 2, "_qd32", "reshard_fio_read_qd32_s"), (world // 2, "_buffered", "reshard_fio_read_buffered_s"))}
    ratios = {
        "multirank_persist_vs_fio": p["bytes"] / p["write_s"] / fio,
        "reshard_restore_vs_dcp_load": d["reshard_dcp_load_s"] / d["reshard_tierio_restore_s"],
        "dcp_tierio_writer_vs_filesystem_writer": d["dcp_fs_save_s"] / d["dcp_tierio_save_s"],
        "dcp_tierio_reader_vs_filesystem_reader": d["dcp_fs_load_s"] / d["dcp_tierio_load_s"],
        "replicated_bytes_written": rep["written"] / rep["unique"],
    }
    return {
        "benchmark": "ckpt", "ranks": world, "directory": str(work), "machine": common.machine_facts(),
        "load_average_1min": load,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "met": common.check_targets(ratios, TARGETS),
        "fio": {"write_bytes_per_s": fio, "jobs": world, "read_bytes_per_s": fio_read},
        "persist": {**p, "write_bytes_per_s": p["bytes"] / p["write_s"], "persist_bytes_per_s": p["bytes"] / p["persist_s"]},
        "dcp": d, "replicated": rep, "buddy": r["buddy"],
        "extra_ratios": {
            "multirank_persist_end_to_end_vs_fio": p["bytes"] / p["persist_s"] / fio,
            # how close each reader comes to the disk (fio O_DIRECT read with as many jobs as readers)
            "dcp_filesystem_load_vs_fio_read": d["fio_read_s"] / d["dcp_fs_load_s"],
            "dcp_tierio_load_vs_fio_read": d["fio_read_s"] / d["dcp_tierio_load_s"],
            "reshard_dcp_load_vs_fio_read": d["reshard_fio_read_s"] / d["reshard_dcp_load_s"],
            "reshard_tierio_restore_vs_fio_read": d["reshard_fio_read_s"] / d["reshard_tierio_restore_s"],
            # the fastest of fio's three reads of the same bytes in the same rounds: dcp.load's rate
            # over it says how far above the disk 1.5x dcp.load lies
            "reshard_dcp_load_vs_best_fio_read": d["reshard_fio_best_s"] / d["reshard_dcp_load_s"],
            "reshard_tierio_restore_vs_best_fio_read": d["reshard_fio_best_s"] / d["reshard_tierio_restore_s"],
            "manager_save_vs_dcp_filesystem_save": d["dcp_fs_save_s"] / d["tierio_save_s"],
        },
    }


# -- commit scale ----------------------------------------------------------------------------------
class CountingStore:
    """A store wrapper counting calls by kind (the requests a commit makes), delegating everything."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.url = store.url
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.on_put: Any = None  # called with the key after each put_buffers

    def put_buffers(self, key: str, buffers: Any) -> int:
        with self._lock:
            self.calls["put_buffers"] += 1
        n = self._store.put_buffers(key, buffers)
        if self.on_put is not None:
            self.on_put(key)
        return n

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **kw: Any) -> Any:
            with self._lock:
                self.calls[name] += 1
            return attr(*a, **kw)
        return counted


def _simulate(store: Any, ranks: int, tensors: int, step: int) -> dict[str, Any]:
    """``ranks`` simulated ranks write their shard and record on threads; then the commit runs."""
    from tierio.ckpt.steps.commit import CommitPlan, Waiting, commit_step, write_record
    from tierio.format.manifest import ChunkInfo, RankEntry, TensorInfo
    from tierio.format.shard import shard_key, shard_name

    payload = b"\0" * (64 + 64 * tensors)  # a tiny shard: the commit is what is measured
    token = "be1c0de5"

    def entry(r: int) -> RankEntry:
        infos = {f"layers/{i}/w": TensorInfo(f"layers/{i}/w", "BF16", (ranks * 64, 32),
                                             [ChunkInfo(shard_name(r), 64 + 64 * i, 64 + 64 * (i + 1), (64 * r, 0), (1, 32), "0" * 16)],
                                             True) for i in range(tensors)}
        return RankEntry(r, shard_name(r), len(payload), {"layers": {str(i): {"w": {"__global__": f"layers/{i}/w"}} for i in range(tensors)}}, infos)

    entries = {r: entry(r) for r in range(ranks)}

    def write(r: int) -> None:
        store.put_buffers(shard_key(step, r), [payload])
        if ranks > 1:
            write_record(store, step, ranks, entries[r], token)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(write, range(ranks)))
    last_durable = time.perf_counter()
    committed: list[float] = []
    store.on_put = lambda key: committed.append(time.perf_counter()) if key.endswith("manifest.json") else None
    before = dict(store.calls)
    plan = lambda listing: CommitPlan.from_listing(listing, step, ranks, {}, {0: entries[0]})  # noqa: E731
    if ranks == 1:
        from tierio.ckpt.steps.commit import build_manifest, commit

        commit(store, build_manifest(store, CommitPlan(step, 1, {}, {}, {}, {0: entries[0]})), [])
    else:
        commit_step(store, plan, ranks, step, token, Waiting(600.0))
    done = time.perf_counter()
    commit_calls = {k: v - before.get(k, 0) for k, v in store.calls.items() if v - before.get(k, 0)}
    store.on_put = None
    # commit_s: the last shard and record durable -> the manifest durable (the commit point);
    # commit_all_s adds what follows it (removing merged records)
    return {"ranks": ranks, "write_s": last_durable - t0, "commit_s": committed[0] - last_durable,
            "commit_all_s": done - last_durable, "commit_requests": commit_calls}


def run_commit_scale(args: Any) -> dict[str, Any]:
    from tierio.storage.url import open_store

    counts = [int(x) for x in str(args.commit_scale).split(",") if x.strip()]
    if not counts or any(c < 1 for c in counts):
        raise ConfigError("--commit-scale takes rank counts, e.g. 1,64,1024")
    work = common.work_dir(args.dir, "commit")
    results: dict[str, Any] = {"benchmark": "ckpt-commit", "tensors_per_rank": args.commit_tensors, "directory": [], "s3": []}
    server = None
    try:
        targets = [("directory", lambda n: open_store(str(work / f"r{n}")))]
        if args.s3:
            from tierio.storage.seaweed import SeaweedServer

            server = SeaweedServer().start()
            os.environ.update(server.env())
            targets.append(("s3", lambda n: _bucket(server, f"commit-{n}")))
        for kind, make in targets:
            for n in counts:
                _log(f"commit of {n} simulated ranks on {kind}")
                store = CountingStore(make(n))
                r = _simulate(store, n, args.commit_tensors, 1)
                r["requests_per_rank"] = sum(store.calls.values()) / n
                r["files"] = len(store._store.list("step_000000001/"))  # noqa: SLF001 - our own wrapper
                r["files_per_rank"] = r["files"] / n
                results[kind].append(r)
                store.close()
    finally:
        if server is not None:
            server.close()
        if not getattr(args, "keep", False):
            shutil.rmtree(work, ignore_errors=True)
    return results


def _bucket(server: Any, name: str) -> Any:
    from tierio.storage import S3Store
    from tierio.storage.url import open_store

    s = S3Store(name, endpoint=server.endpoint)
    s.create_bucket()
    s.close()
    return open_store(server.url(f"{name}/ckpt"))
