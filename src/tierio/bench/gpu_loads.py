"""The parts of ``tierio.bench.gpu`` that read files: weight loads to the GPU (GDS, the pinned
bounce ring, safetensors) and the 2-process NCCL checkpoint save and resharding restore."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from tierio.bench import common


def drop_is_global() -> bool:
    """Whether the whole page cache can be dropped here (root); else only the file's pages are."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def bench_weights(size: int, work: Path, rounds: int) -> dict[str, Any]:
    """Cold loads of one safetensors file to the GPU, each way's bytes checked against the others'."""
    import torch
    from safetensors.torch import load_file, save_file

    from tierio.bench.state import make_state
    from tierio.io import gds
    from tierio.weights import LoadStats, load

    path = work / "model.safetensors"
    save_file(make_state(size, 16, seed=1)["tensors"], str(path))
    nbytes = path.stat().st_size
    methods: dict[str, str] = {}

    def tierio(use_gds: bool, name: str):
        def once() -> None:
            stats = LoadStats()
            load(path, device="cuda", use_gds=use_gds, stats=stats)
            methods[name] = stats.method
        return once

    ways = {"ring": tierio(False, "ring"), "safetensors": lambda: load_file(str(path), device="cuda")}
    if gds.available():
        ways["gds"] = tierio(True, "gds")
    best = common.alternate({n: _synced_load(fn) for n, fn in ways.items()}, rounds + 1,
                            before=lambda: common.drop_caches([path]))
    seconds = {n: min(s[1:]) for n, s in best.items()}
    want = load_file(str(path), device="cuda")
    for name, fn in (("ring", lambda: load(path, device="cuda", use_gds=False)),
                     ("gds", lambda: load(path, device="cuda", use_gds=True))):
        if name in ways:
            got = fn()
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            if bad:
                raise AssertionError(f"the {name} load differs from safetensors in {bad[:5]}")
            del got
    out: dict[str, Any] = {"bytes": nbytes, "page_cache": "dropped" if drop_is_global() else "file evicted",
                           "methods": methods}
    for n, s in seconds.items():
        out[f"{n}_s"], out[f"{n}_bytes_per_s"] = s, nbytes / s
    if "gds" in ways:
        out["gds_compat_mode"] = gds.compat_mode()
        if methods.get("gds") != "gds":
            out["gds_note"] = f"use_gds=True ran as {methods.get('gds')}: GDS failed and fell back (see the log)"
    else:
        out["gds"] = {"skipped": "kvikio does not import with a CUDA device here: GDS is not measured"}
    fastest = min(s for n, s in seconds.items() if n != "safetensors")
    out["ratios"] = {"load_vs_safetensors": common.ratio(seconds["safetensors"], fastest)}
    if "gds" in seconds and methods.get("gds") == "gds" and not out["gds_compat_mode"]:
        out["ratios"]["gds_vs_ring"] = common.ratio(seconds["ring"], seconds["gds"])
    path.unlink()
    return out


def _synced_load(fn: Any) -> Any:
    import torch

    def run() -> float:
        torch.cuda.synchronize()
        _, seconds = common.timed(lambda: (fn(), torch.cuda.synchronize()))
        torch.cuda.empty_cache()  # each load allocates anew, as a cold start does
        return seconds
    return run


# -- NCCL ---------------------------------------------------------------------------------------
def bench_nccl(size: int, work: Path) -> dict[str, Any]:
    """2 ranks over NCCL: save blocking and durable seconds, then a restore into other placements."""
    import torch
    import torch.multiprocessing as tmp

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": f"NCCL needs 2 GPUs, this machine has {gpus}"}
    tmp.start_processes(nccl_rank, args=(str(work), size, f"file://{work}/pg"), nprocs=2, start_method="spawn")
    ranks = [json.loads((work / f"nccl-{r}.json").read_text()) for r in range(2)]
    out = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the slower rank is the job's figure
    out["restore_bytes_per_s"] = out["bytes"] / out["restore_s"]
    return out


def nccl_rank(rank: int, work: str, size: int, init: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tierio.ckpt import CheckpointManager

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=300),
                            device_id=torch.device("cuda", rank))
    try:
        mesh = init_device_mesh("cuda", (2,))
        rows = max(2, size // 4 // 4096 // 4)
        gen = torch.Generator(device="cuda").manual_seed(3)  # the same full tensors on both ranks
        full = {f"w{i}": torch.randn(rows, 4096, device="cuda", generator=gen) for i in range(4)}
        state = {"model": {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}, "step": 1}
        with CheckpointManager([f"{work}/nccl-t0"]) as mgr:
            dist.barrier()
            h, save_s = common.timed(lambda: mgr.save(1, state))
            _, durable_s = common.timed(h.wait)
            dist.barrier()
            into = {"model": {n: distribute_tensor(torch.zeros_like(t), mesh, [Shard(1)]) for n, t in full.items()}}
            common.drop_caches([f"{work}/nccl-t0"])
            dist.barrier()
            out, restore_s = common.timed(lambda: (mgr.restore(into=into), torch.cuda.synchronize())[0])
        for n, t in full.items():
            if not torch.equal(out["model"][n].to_local(), distribute_tensor(t, mesh, [Shard(1)]).to_local()):
                raise AssertionError(f"rank {rank}: the resharded {n} differs from what was saved")
        Path(work, f"nccl-{rank}.json").write_text(json.dumps(
            {"bytes": sum(t.numel() * t.element_size() for t in full.values()), "save_s": save_s,
             "durable_s": save_s + durable_s, "restore_s": restore_s}))
    finally:
        dist.destroy_process_group()
