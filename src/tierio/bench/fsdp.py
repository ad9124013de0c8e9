"""FSDP2 checkpoint saves: the frameworks' own sharded save against tierio's, on one rank.

  fsdp_save_vs_framework_default   seconds of the save Accelerate and Lightning make of an FSDP2
                                   state (``dcp.save`` through ``FileSystemWriter``, fsynced: their
                                   default) ÷ the seconds tierio's save holds the training loop

The state is what both frameworks save: ``get_state_dict`` of linear layers ``fully_shard``-ed on a
one-rank gloo mesh (on the CPU) after one Adam step, weights and both moments as DTensors. tierio's
side is the adapters' own call (``TrainerCheckpoints.save_folder``); each of its saves is durable
and published, untimed, before the next sample. The sides alternate (``common.alternate``).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tierio.bench.common import alternate, logger

WIDTH = 1024


def _state(nbytes: int) -> tuple[Any, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierio.integrations.sharded import state_dicts

    layers = max(1, nbytes // 3 // (WIDTH * WIDTH * 4))  # weights + Adam's two moments
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    opt.step()
    msd, (osd,) = state_dicts(model, [opt])
    return model, {"model": msd, "optimizer": osd, "layers": layers}


def measure(nbytes: int, work: Path, rounds: int) -> dict[str, Any]:
    """The figures (medians of ``rounds`` alternated samples a side) and ``ratio``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierio.integrations.hf import TrainerCheckpoints
    from tierio.storage.seaweed import free_port

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    saver = TrainerCheckpoints([str(work / "tiers")], {})
    try:
        _model, state = _state(nbytes)
        layers = state.pop("layers")
        count = {"n": 0}

        def framework() -> float:
            target = work / "dcp" / f"step-{count['n']}"
            count["n"] += 1
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target), sync_files=True))
            seconds = time.perf_counter() - t0
            shutil.rmtree(target, ignore_errors=True)
            return seconds

        def tierio() -> float:
            count["n"] += 1
            t0 = time.perf_counter()
            saver.save_folder(state, work / "out" / f"checkpoint-{count['n']}", "{}", lambda: None, count["n"], None)
            seconds = time.perf_counter() - t0
            saver.wait()  # durable and published before the next sample, untimed
            return seconds

        logger("bench integrations")(f"fsdp: {layers} layers of {WIDTH}x{WIDTH}, dcp.save vs tierio, {rounds} rounds")
        tierio(), framework()  # warm-up: staging memory, DCP's planner
        samples = alternate({"framework_default": framework, "tierio": tierio}, rounds)
        out: dict[str, Any] = {"layers": layers, "samples_s": samples}
        out.update({f"{k}_s": statistics.median(v) for k, v in samples.items()})
        stats = saver.manager.stats()["saves"][-1] if saver.manager else {}
        out["checkpoint_bytes"] = stats.get("bytes")
        out["ratio"] = out["framework_default_s"] / out["tierio_s"]
        return out
    finally:
        saver.close()
        if own_group:
            dist.destroy_process_group()

