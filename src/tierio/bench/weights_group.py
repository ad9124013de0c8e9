"""`tierio bench weights`, the cooperative part: 4 gloo ranks load one model from a local SeaweedFS.

Each round (``bench.common.alternate`` order, page cache irrelevant: the bytes come over S3):
every rank loads the whole model independently (4 × the model from the server), and the 4 ranks
load it cooperatively (``weights.load_group``: each byte from the server once, shared through the
node's memory, the ranks being on one node), and cooperatively through the node's weight cache
(``cache=``: the first such load fills it from the group's stream, the next ones read the node's
copy with no exchange). Rank 0 times each between barriers; ``--only group`` runs this part alone.
Bytes from the server count the data GETs of every rank plus the header probes each rank's
``resolve`` makes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

RANKS = 4


def _worker(rank: int, url: str, init: str, rounds: int, out: str) -> None:
    import torch.distributed as dist

    from tierio.bench.common import alternate
    from tierio.weights import LoadStats, WeightCache, load, load_group
    from tierio.weights.sources import HEAD_PROBE, resolve

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    got: dict[str, list[int]] = {"independent": [], "group": [], "group_cached": []}
    cache = WeightCache(Path(out, "node-cache"), "64GiB")
    fills: list[str] = []  # how each cached round went: "filled" (the first) or "hit"

    def side(name: str, fn):
        def run() -> float:
            st = LoadStats()
            dist.barrier()
            t0 = time.perf_counter()
            loaded = fn(st)
            dist.barrier()
            seconds = time.perf_counter() - t0
            del loaded
            got[name].append(st.remote_bytes)
            if name == "group_cached":
                fills.append(str(st.extra.get("cache")))
            return seconds
        return run

    secs = alternate({"independent": side("independent", lambda st: load(url, stats=st)),
                      "group": side("group", lambda st: load_group(url, stats=st)),
                      "group_cached": side("group_cached", lambda st: load_group(url, stats=st, cache=cache))}, rounds)
    probes = sum(min(s.size, HEAD_PROBE) for s in resolve(url, read_headers=False).shards)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"seconds": secs, "bytes": got, "probe_bytes": probes,
                                                          "cache": fills}))
    dist.destroy_process_group()


def run_group(work: Path, model: Path, rounds: int) -> tuple[dict, dict[str, float]]:
    """(figures, ratios) of 4 ranks loading ``model`` from a local SeaweedFS."""
    from tierio.storage import S3Store, open_store
    from tierio.storage.seaweed import SeaweedServer

    (work / "seaweed").mkdir(parents=True, exist_ok=True)
    with SeaweedServer(work / "seaweed") as server:
        os.environ.update(server.env())
        S3Store("group", endpoint=server.endpoint).create_bucket()
        url = server.url("group/model")
        store = open_store(url)
        files = sorted(f for f in model.iterdir() if f.is_file())
        for f in files:
            store.put_file(f.name, f)
        store.close()
        shard_bytes = sum(f.stat().st_size for f in files if f.name.endswith(".safetensors"))
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, url, f"file://{work}/pg", rounds, str(work))) for r in range(RANKS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=1800)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a rank of the cooperative bench failed: exit codes {[p.exitcode for p in procs]}")
    res = [json.loads((work / f"rank{r}.json").read_text()) for r in range(RANKS)]
    secs = res[0]["seconds"]
    per_round = [sum(r["bytes"]["group"][i] + r["probe_bytes"] for r in res) for i in range(len(secs["group"]))]
    cached = list(zip(secs.pop("group_cached"), res[0]["cache"]))
    fill = [t for t, how in cached if how == "filled"]
    hits = [t for t, how in cached if how == "hit"]
    secs.update({"group_cache_fill": fill, "group_cache_hit": hits})
    out = {"ranks": RANKS, "model_bytes": shard_bytes, "seconds": secs, "group_source_bytes": per_round}
    ratios = {"group_source_bytes_vs_model": max(per_round) / shard_bytes,
              "group_load_vs_independent": min(secs["independent"]) / min(secs["group"])}
    if fill and hits:  # what the node cache costs once and saves each later start
        ratios["group_cache_fill_vs_group"] = fill[0] / min(secs["group"])
        ratios["group_load_vs_cache_hit"] = min(secs["group"]) / min(hits)
    return out, ratios


__all__ = ["run_group"]
