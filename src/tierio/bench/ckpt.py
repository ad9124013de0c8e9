"""`tierio bench ckpt`: the checkpoint engine against fio, torch.save and torch.distributed.checkpoint.

Everything runs in one process on one directory, in one run, on the same state: by default 2 GiB in
96 tensors mixing fp32 and bf16. The page cache is dropped before every read. Peers run in their
documented default configuration; where a peer has a faster option (DCP's cached staging), the
faster figure is the one compared against.

Figures (seconds are medians of the steady-state repetitions):
  persist       tierio save() call -> local tier committed (manifest durable)
  write phase   staged -> committed (the part that competes with fio)
  blocking      how long save() holds the training loop (the snapshot copy)
  restore       restore(into=state) from a cold page cache, checksums verified
  restore alloc restore() into new memory (what a recovering process does), cold page cache,
                checksums verified; compared with dcp.load into freshly allocated tensors
  overlap       save(overlap=True) blocking + the next update's wait, in a loop whose forward +
                backward takes longer than the copy (bench/overlap.py)
  incremental   incremental=True with 95% of the state unchanged against full saves: bytes written
                and the persist stage (bench/incremental.py)

The reads (fio's O_DIRECT read, both restores, dcp.load in place and into new tensors) run after
every write, in interleaved rounds whose order rotates (common.alternate): this virtual disk
changes speed within minutes, and each side measured once, at its own moment, met another disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierio.bench import common, incremental, integrations, overlap
from tierio.bench.state import make_state, state_nbytes
from tierio.errors import ConfigError
from tierio.units import human_bytes, parse_size

TARGETS = {
    "persist_vs_fio_write": (">=", 0.9),
    "persist_vs_dcp_save": (">=", 1.8),
    "persist_vs_torch_save": (">=", 5.0),
    "stall_vs_memcpy": (">=", 0.67),
    "stall_vs_dcp_async": (">=", 3.0),
    "overlap_stall_vs_memcpy": (">=", 4.0),
    "incremental_bytes_ratio": (">=", 10.0),
    "incremental_persist_vs_full": (">=", 5.0),
    "restore_vs_fio_read": (">=", 0.9),
    "restore_vs_dcp_load": (">=", 1.0),
    "restore_alloc_vs_fio_read": (">=", 0.9),
    "restore_alloc_vs_dcp_load_alloc": (">=", 1.3),
    "rss_overhead": ("<=", 1.1),
    # --ranks N (bench/cluster.py)
    "multirank_persist_vs_fio": (">=", 0.85),
    "reshard_restore_vs_dcp_load": (">=", 1.5),
    "dcp_tierio_writer_vs_filesystem_writer": (">=", 1.3),
    "dcp_tierio_reader_vs_filesystem_reader": (">=", 1.0),
    "replicated_bytes_written": ("<=", 1.01),
    **integrations.TARGETS,
}


# -- helpers -------------------------------------------------------------------------------------


# -- the measurements ----------------------------------------------------------------------------


class _MemcpyFloor:
    """Copies the same tensors into one already-faulted buffer (typed copies, torch's fastest path):
    the floor of any snapshot. Timed right before each tierio save, so both see the same machine."""

    def __init__(self, state: dict[str, Any]) -> None:
        from tierio.io import HostBuffer

        self.tensors = list(state["tensors"].values())
        self.buf = HostBuffer(state_nbytes(state), pin=False)
        self.times: list[float] = []

    def __call__(self) -> float:
        dst = self.buf.tensor()
        t0 = time.perf_counter()
        off = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            dst[off : off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n
        self.times.append(time.perf_counter() - t0)
        return self.times[-1]


def _tierio(state: dict[str, Any], root: Path, repeat: int, floor: _MemcpyFloor) -> dict[str, Any]:
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    out: dict[str, Any] = {}
    blocking, walls, persist, write = [], [], [], []
    with CheckpointManager([Tier(str(root), retention=KeepLast(2))], min_keep=1) as mgr:
        for i in range(repeat + 1):  # save 0 allocates and faults the staging buffers: warm-up
            step = i + 1
            state["step"] = step
            if i > 0:
                floor()
            t0 = time.perf_counter()
            h = mgr.save(step, state)
            t1 = time.perf_counter()  # save() returns once staged: the rest is the background write
            h.persisted.result()
            t2 = time.perf_counter()
            if i == 0:
                out["first_save_blocking_s"] = t1 - t0
                continue
            walls.append(t1 - t0)
            blocking.append(h.blocking_seconds)
            persist.append(t2 - t0)
            write.append(t2 - t1)
        mgr.wait()
        out["blocking_s"] = statistics.median(blocking)
        out["blocking_wall_s"] = statistics.median(walls)
        out["persist_s"] = statistics.median(persist)
        out["write_s"] = statistics.median(write)
        out["step"] = repeat + 1  # kept for the reads (_reads)
        out["manager_stats"] = json.loads(json.dumps(mgr.stats(), default=str))
    return out


def _reads(state: dict[str, Any], work: Path, step: int, rounds: int) -> dict[str, Any]:
    """The read side of every peer on the checkpoints the write side left: fio's O_DIRECT read,
    tierio's restore in place and into new memory, ``dcp.load`` in place and into ``torch.empty``
    tensors; ``rounds`` interleaved rounds (common.alternate), page cache dropped before each read.
    Seconds are medians; every sample is in ``samples``."""
    import torch.distributed.checkpoint as dcp

    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    tensors = state["tensors"]
    nbytes = state_nbytes(state)
    fio_dir, dcp_dir = work / "fio-read", str(work / "dcp" / "save1")
    with warnings.catch_warnings(), CheckpointManager([Tier(str(work / "tierio"), retention=KeepLast(2))],
                                                      min_keep=1) as mgr:
        warnings.simplefilter("ignore", UserWarning)  # DCP without a process group: what we measure

        def fio_read() -> float:
            return common.run_fio(fio_dir, "read", nbytes, keep=True)["seconds"]  # laid out once, dropped before each read

        def restore(into: Any) -> Callable[[], float]:
            def run() -> float:
                got, seconds = common.timed(lambda: mgr.restore(step=step, into=into))
                del got  # a restore into new memory unmaps its files here
                return seconds
            return run

        def dcp_load(fresh: bool) -> Callable[[], float]:
            # DCP loads in place only: a recovering process hands it freshly allocated tensors,
            # allocated inside the timed call.
            def load() -> None:
                dest = {k: torch.empty_like(v) for k, v in tensors.items()} if fresh else tensors
                dcp.load(dest, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            return lambda: common.timed(load)[1]

        fio_read()  # lays its file out, untimed, before the rounds
        samples = common.alternate({"fio_read_s": fio_read, "restore_into_s": restore(state), "dcp_load_s": dcp_load(False),
                                    "restore_alloc_s": restore(None), "dcp_load_alloc_s": dcp_load(True)}, rounds,
                                   lambda: common.drop_caches([work]))
        stats = json.loads(json.dumps(mgr.stats(), default=str))
    shutil.rmtree(fio_dir, ignore_errors=True)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    out["fio_read_bytes_per_s"] = nbytes / out["fio_read_s"]
    out["samples"] = samples
    out["manager_stats"] = stats
    return out


def _dcp(state: dict[str, Any], root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: single-process is what we measure.
        warnings.simplefilter("ignore", UserWarning)
        return _dcp_runs(dcp, state, root)


def _dcp_runs(dcp: Any, state: dict[str, Any], root: Path) -> dict[str, Any]:
    tensors = state["tensors"]
    out: dict[str, Any] = {}
    saves = []
    for i in range(2):  # the first call also plans; take the faster of two
        path = root / f"save{i}"
        t0 = time.perf_counter()
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), no_dist=True)
        saves.append(time.perf_counter() - t0)
        if i == 0:
            shutil.rmtree(path)
    out["save_s"] = min(saves)  # save1 stays for the reads (_reads)

    # async_save: what the call blocks for, steady state (best of calls 2 and 3: the allocator
    # reuses the memory of the previous staging copy, so later calls fault fewer pages). DCP's cached staging
    # (cache_staged_state_dict) pins memory, so it exists only where CUDA does.
    variants = [False, True] if torch.cuda.is_available() else [False]
    for cached in variants:
        writer = dcp.FileSystemWriter(str(root / "async"), sync_files=True, cache_staged_state_dict=cached)
        blocks = []
        for i in range(3):
            t0 = time.perf_counter()
            fut = dcp.async_save(tensors, checkpoint_id=str(root / f"async{i}"), storage_writer=writer, no_dist=True)
            blocks.append(time.perf_counter() - t0)
            getattr(fut, "upload_completion", fut).result()
            shutil.rmtree(root / f"async{i}", ignore_errors=True)
        out[f"async_blocking_s_{'cached' if cached else 'default'}"] = min(blocks[1:])
        del writer
    out["async_blocking_s"] = min(v for k, v in out.items() if k.startswith("async_blocking_s_"))
    return out


def _rss_child(size: int, tensors: int, root: str) -> dict[str, Any]:
    """Runs in a fresh process: peak RSS of a first and a second async save of the state."""
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    state = make_state(size, tensors)
    nbytes = state_nbytes(state)
    before = common.rss_bytes()
    with common.RssSampler(interval=0.001) as rss, CheckpointManager([Tier(root, retention=KeepLast(1))], min_keep=1) as mgr:
        for step in (1, 2):
            state["step"] = step
            mgr.save(step, state).wait()
    return {"state_bytes": nbytes, "rss_before_save": before, "peak_rss": rss.peak}


def _rss(size: int, tensors: int, root: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "tierio.bench.ckpt", "--rss-child", str(size), str(tensors), str(root)],
        capture_output=True, text=True, check=False,
    )
    if r.returncode != 0:
        raise ConfigError(f"the RSS measurement process failed: {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tierio.bench import cluster

    if getattr(args, "commit_scale", None):
        return cluster.run_commit_scale(args)
    if getattr(args, "ranks", 1) > 1:
        return cluster.run_ranks(args)
    size = parse_size(args.size)
    if args.repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    work = common.work_dir(args.dir, "ckpt")
    log = common.logger("ckpt")
    try:
        # The RSS child runs first, while this process holds nothing large.
        log("peak RSS of an async save (separate process)")
        rss = _rss(size, args.tensors, work / "rss")
        shutil.rmtree(work / "rss", ignore_errors=True)

        log(f"fio O_DIRECT write, {human_bytes(size)} on {work}")
        (work / "fio").mkdir()
        fio_write = common.run_fio(work / "fio", "write", size)["bytes_per_s"]
        shutil.rmtree(work / "fio")

        state = make_state(size, args.tensors)
        nbytes = state_nbytes(state)
        log(f"state: {len(state['tensors'])} tensors, {human_bytes(nbytes)}")
        floor = _MemcpyFloor(state)
        floor()  # faults the floor's buffer in, untimed
        floor.times.clear()
        log("tierio: async saves and restores")
        tio = _tierio(state, work / "tierio", args.repeat, floor)
        memcpy_s = statistics.median(floor.times)
        del floor
        log("tierio: overlapped saves in a training loop")
        ovl = overlap.measure(state, work / "overlap", args.repeat, memcpy_s)
        shutil.rmtree(work / "overlap", ignore_errors=True)
        log("tierio: incremental saves, 95% of the state unchanged")
        inc = incremental.measure(state, work / "incremental")
        shutil.rmtree(work / "incremental", ignore_errors=True)
        log("torch.distributed.checkpoint: save, async_save")
        dcp_r = _dcp(state, work / "dcp")
        rounds = max(1, min(args.repeat, 3))
        log(f"reads: fio, tierio restore, dcp.load, in place and into new memory; {rounds} interleaved rounds")
        reads = _reads(state, work, tio["step"], rounds)
        fio_read = reads["fio_read_bytes_per_s"]
        shutil.rmtree(work / "tierio", ignore_errors=True)
        shutil.rmtree(work / "dcp", ignore_errors=True)
        log("torch.save + fsync")
        torch_save_s = common.timed_torch_save(state["tensors"], work / "torch")
        integ = {} if args.no_integrations else integrations.measure(size, work / "integrations", args.repeat, log)
    finally:
        if not getattr(args, "keep", False):
            shutil.rmtree(work, ignore_errors=True)

    persist_bw = nbytes / tio["write_s"]
    ratios = {
        "persist_vs_fio_write": persist_bw / fio_write,
        "persist_vs_dcp_save": dcp_r["save_s"] / tio["persist_s"],
        "persist_vs_torch_save": torch_save_s / tio["persist_s"],
        "stall_vs_memcpy": memcpy_s / tio["blocking_wall_s"],
        "stall_vs_dcp_async": dcp_r["async_blocking_s"] / tio["blocking_wall_s"],
        "overlap_stall_vs_memcpy": ovl["ratio"],
        "incremental_bytes_ratio": inc["bytes_ratio"],
        "incremental_persist_vs_full": inc["persist_ratio"],
        "restore_vs_fio_read": (nbytes / reads["restore_into_s"]) / fio_read,
        "restore_vs_dcp_load": reads["dcp_load_s"] / reads["restore_into_s"],
        "restore_alloc_vs_fio_read": (nbytes / reads["restore_alloc_s"]) / fio_read,
        "restore_alloc_vs_dcp_load_alloc": reads["dcp_load_alloc_s"] / reads["restore_alloc_s"],
        "rss_overhead": rss["peak_rss"] / (2 * rss["state_bytes"]),
        **integ.get("ratios", {}),
    }
    met = common.check_targets(ratios, {k: v for k, v in TARGETS.items() if k in ratios})
    return {
        "benchmark": "ckpt",
        "directory": str(work),
        "state_bytes": nbytes,
        "tensors": len(state["tensors"]),
        "dtypes": ["float32", "bfloat16"],
        "machine": common.machine_facts(),
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "met": met,
        "fio": {"write_bytes_per_s": fio_write, "read_bytes_per_s": fio_read},
        "tierio": {**tio, "persist_bytes_per_s": nbytes / tio["persist_s"], "write_bytes_per_s": persist_bw,
                   "restore_bytes_per_s": nbytes / reads["restore_into_s"],
                   "restore_alloc_bytes_per_s": nbytes / reads["restore_alloc_s"]},
        "reads": reads,
        "overlap": ovl,
        "incremental": inc,
        "dcp": dcp_r,
        "torch_save_fsync_s": torch_save_s,
        "memcpy_s": memcpy_s,
        "rss": rss,
        "integrations": integ,
        "extra_ratios": {
            "persist_vs_fio_write_end_to_end": (nbytes / tio["persist_s"]) / fio_write,
            "rss_overhead_excluding_interpreter":
                (rss["peak_rss"] - (rss["rss_before_save"] - rss["state_bytes"])) / (2 * rss["state_bytes"]),
        },
    }


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--rss-child":
    print(json.dumps(_rss_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
