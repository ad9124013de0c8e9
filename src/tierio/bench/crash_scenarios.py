"""The scenarios whose every crash point ``tierio.bench.crash`` enumerates.

Each is a ``run(ctx)`` that sets up (unrecorded), calls ``ctx.arm()`` and then does the operations
under test, noting what it was told is durable (``ctx.note``), and a ``check(ctx)`` that a fresh
process runs after the crash: it returns what is wrong (an empty list when nothing is).
The states are small on purpose: a point costs a run up to it plus a check, whatever the size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierio.bench.crash_recorder import Ctx, Scenario


# -- shared by the checkpoint scenarios -----------------------------------------------------------
def state_for(step: int, n: int = 4096) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g).bfloat16()},
            "opt": {"m": torch.randn(n // 4, generator=g)}, "step": step}


def differs(got: Any, want: Any, where: str = "state") -> list[str]:
    """Where ``got`` is not bit-exact ``want``."""
    import torch

    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [p for k in want for p in differs(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        return [] if ok else [f"{where}: tensor differs"]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def other_run(ctx: Ctx, local: str = "other") -> None:
    """Another run's checkpoint next to the trial's tiers (a sibling directory, a sibling S3
    prefix): nothing the scenario does may touch it. Its listing is noted for the check."""
    from tierio.ckpt import CheckpointManager

    urls = other_urls(ctx, local)
    with CheckpointManager(urls, run_id="other-run", min_keep=1) as m:
        m.save(7, state_for(7, 256)).wait()
    ctx.note("other", listing(urls))


def other_urls(ctx: Ctx, local: str = "other") -> list[str]:
    urls = [str(ctx.root / local)]
    if ctx.s3_url:
        urls.append(ctx.s3_url.replace("/data?", "/other?", 1))
    return urls


def listing(urls: list[str]) -> dict[str, dict[str, int]]:
    from tierio.storage import open_store

    out = {}
    for url in urls:
        store = open_store(url)
        try:
            out[url] = store.list_sizes("")
        finally:
            store.close()
    return out


def whole_listings(urls: list[str], allowed: set[int]) -> list[str]:
    """Every step listed on every tier is complete and verifies; no step is one never saved."""
    from tierio.ckpt import list_checkpoints, verify

    problems = []
    for url in urls:
        for info in list_checkpoints(url):
            if info.step not in allowed:
                problems.append(f"{url}: lists step {info.step}, never saved")
            elif info.error is not None:
                problems.append(f"{url}: step {info.step} listed with error {info.error}")
            elif not verify(url, info.step).ok:
                problems.append(f"{url}: step {info.step} listed but does not verify")
    return problems


def listed(url: str) -> set[int]:
    from tierio.ckpt import list_checkpoints

    return {i.step for i in list_checkpoints(url)}


def restore_and_go_on(tiers: list[Any], allowed: set[int], at_least: int, next_step: int,
                      state: Any = state_for, **options: Any) -> list[str]:
    """The newest committed step restores bit-exact (one that was saved, not older than what was
    reported durable); then a later save commits and restores bit-exact too."""
    from tierio.ckpt import CheckpointManager

    problems: list[str] = []
    with CheckpointManager(tiers, run_id="recovery", min_keep=1, **options) as m:
        latest = m.latest()
        if latest is None or latest not in allowed or latest < at_least:
            why = why_missing(tiers, at_least) if at_least and (latest is None or latest < at_least) else ""
            return [f"latest committed step is {latest}; saved {sorted(allowed)}, durable up to {at_least}{why}"]
        got = m.restore()
        problems += differs(got, state(m.restored_step), f"restored step {m.restored_step}")
        if m.restored_step != latest:
            problems.append(f"restored step {m.restored_step}, latest is {latest}")
        m.save(next_step, state(next_step)).wait()
    with CheckpointManager(tiers, run_id="reader", min_keep=1, **options) as m:
        if m.latest() != next_step:
            problems.append(f"a save after recovery did not commit: latest {m.latest()}")
        else:
            problems += differs(m.restore(), state(next_step), f"step {next_step} saved after recovery")
    return problems


def intact(ctx: Ctx) -> list[str]:
    before = ctx.notes().get("other", [None])[0]
    if before is None:
        return []
    now = listing(list(before))
    return [f"another run's files changed under {u}: {sorted(set(before[u]) ^ set(now[u]))[:4]}"
            for u in before if now[u] != before[u]]


def durable(ctx: Ctx, what: str) -> int:
    return max(ctx.notes().get(what, [0]))


LOST_DIR = "its step directory is gone (created, never made durable in its parent)"


def why_missing(tiers: list[Any], step: int) -> str:
    """Tell a lost step whose whole directory vanished (the known gap) from any other loss."""
    local = [Path(str(t.url)) for t in tiers if "://" not in str(t.url)]
    gone = [p for p in local if not (p / f"step_{step:09d}").exists()]
    return f": {LOST_DIR}" if gone and len(gone) == len(local) else ""


# -- (a) one rank: save, promote to a shared directory and S3, retention ----------------------------
def promote_tiers(ctx: Ctx) -> list[Any]:
    from tierio.ckpt import KeepLast, Tier

    return [Tier(str(ctx.root / "nvme"), KeepLast(1)), Tier(str(ctx.root / "shared"), KeepLast(2)),
            Tier(ctx.s3_url, KeepLast(2))]


def promote_run(ctx: Ctx) -> None:
    from tierio.ckpt import CheckpointManager

    other_run(ctx)
    with CheckpointManager(promote_tiers(ctx), run_id="run-0", min_keep=1) as m:
        m.save(1, state_for(1)).wait()
    with CheckpointManager(promote_tiers(ctx), run_id="run-1", min_keep=1) as m:
        m.restore()
        ctx.arm()
        save_noted(ctx, m, 2)


def save_noted(ctx: Ctx, m: Any, step: int) -> None:
    """Save ``step``, noting when it was reported persisted and when promoted (what the check may
    then require to survive)."""
    h = m.save(step, state_for(step))
    h.persisted.result()
    ctx.note("persisted", step)
    h.wait()
    ctx.note("promoted", step)


def promote_check(ctx: Ctx) -> list[str]:
    tiers = promote_tiers(ctx)
    urls = [str(t.url) for t in tiers]
    problems = whole_listings(urls, {1, 2})
    for url in urls[1:]:  # retention keeps two steps there: run-0's step 1 must survive run-1
        if 1 not in listed(url):
            problems.append(f"{url}: step 1 of the previous run was deleted")
    if durable(ctx, "promoted"):
        problems += [f"{u}: step 2 was promoted but is not listed{why_missing([t], 2)}"
                     for u, t in zip(urls, tiers) if 2 not in listed(u)]
    problems += intact(ctx)
    return problems + restore_and_go_on(tiers, {1, 2}, durable(ctx, "persisted"), 3)


# -- (c) incremental saves: later steps refer to an earlier step's shard -----------------------------
def incremental_state(step: int) -> dict[str, Any]:
    import torch

    frozen = torch.randn(8192, generator=torch.Generator().manual_seed(0))  # unchanged: referenced, not rewritten
    return {"model": {"frozen": frozen, "w": torch.randn(1024, generator=torch.Generator().manual_seed(step))}, "step": step}


def incremental_tiers(ctx: Ctx) -> list[Any]:
    from tierio.ckpt import KeepLast, Tier

    return [Tier(str(ctx.root / "nvme"), KeepLast(1)), Tier(str(ctx.root / "shared"), KeepLast(2))]


def incremental_run(ctx: Ctx) -> None:
    from tierio.ckpt import CheckpointManager

    with CheckpointManager(incremental_tiers(ctx), run_id="run-c", min_keep=1, incremental=True) as m:
        m.save(1, incremental_state(1)).wait()
        ctx.arm()
        for step in (2, 3):
            h = m.save(step, incremental_state(step))
            h.persisted.result()
            ctx.note("persisted", step)
            h.wait()


def incremental_check(ctx: Ctx) -> list[str]:
    tiers = incremental_tiers(ctx)
    problems = whole_listings([str(t.url) for t in tiers], {1, 2, 3})
    return problems + restore_and_go_on(tiers, {1, 2, 3}, durable(ctx, "persisted"), 4, incremental_state, incremental=True)


# -- (e) a weight-cache fill in front of a slower source, evicting an older model -----------------------
CACHE_BYTES = 100_000  # room for one model of ~66 kB: m2's fill evicts m1


def model_tensors(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 128, generator=g), "layers.0.mlp.weight": torch.randn(128, 64, generator=g),
            "norm.weight": torch.randn(128, generator=g).bfloat16()}


def write_model(path: Path, seed: int) -> None:
    """A two-shard Hugging Face style model directory (index, shards, config)."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True)
    t = model_tensors(seed)
    shards = {"model-00001-of-00002.safetensors": ["embed.weight"],
              "model-00002-of-00002.safetensors": ["layers.0.mlp.weight", "norm.weight"]}
    for name, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(path / name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    (path / "config.json").write_text(json.dumps({"seed": seed}))


def weights_run(ctx: Ctx) -> None:
    from tierio.weights import WeightCache

    for seed in (1, 2):
        write_model(ctx.root / "models" / f"m{seed}", seed)
    cache = WeightCache(ctx.root / "cache", max_bytes=CACHE_BYTES)
    cache.fetch(ctx.root / "models" / "m1")
    ctx.arm()
    cache.fetch(ctx.root / "models" / "m2")
    ctx.note("filled", 2)


def weights_check(ctx: Ctx) -> list[str]:
    from tierio.weights import WeightCache

    problems = []
    cache = WeightCache(ctx.root / "cache", max_bytes=CACHE_BYTES)
    for e in cache.entries():  # an entry with a record is whole and the source's bytes, byte for byte
        if not e.source:
            continue  # no readable record: an eviction cut short; a load treats it as a miss (checked below)
        src = Path(e.source)
        for f in e.path.iterdir():
            if not f.name.startswith(".") and (not (src / f.name).is_file() or f.read_bytes() != (src / f.name).read_bytes()):
                problems.append(f"cache entry {e.name} ({src.name}) holds a wrong or partial {f.name}")
    names = {e.source for e in cache.entries()}
    if durable(ctx, "filled") and str(ctx.root / "models" / "m2") not in names:
        problems.append("m2's fill returned but the cache does not list it")
    for seed in (2, 1, 2):  # hit or refill, both must load the source's exact tensors
        problems += differs(cache.load(ctx.root / "models" / f"m{seed}"), model_tensors(seed), f"m{seed} through the cache")
    return problems


# -- (f) a dataset build published over an older one ---------------------------------------------------
def documents(version: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(version)
    return [rng.integers(0, 30000, int(rng.integers(1, 400)), dtype=np.int64) for _ in range(40 + 10 * version)]


def dataset_run(ctx: Ctx) -> None:
    from tierio.data import build_indexed

    build_indexed(documents(1), ctx.root / "corpus", vocab_size=32000)
    ctx.arm()
    build_indexed(documents(2), ctx.root / "corpus", vocab_size=32000)
    ctx.note("built", 2)


def _read_dataset(prefix: Path) -> list[list[int]]:
    from tierio.data import IndexedDataset

    ds = IndexedDataset(prefix)
    try:
        return [ds[i].tolist() for i in range(len(ds))]
    finally:
        close = getattr(ds, "close", None)
        if close:
            close()


def dataset_check(ctx: Ctx) -> list[str]:
    from tierio.data import build_indexed

    got = _read_dataset(ctx.root / "corpus")
    versions = {v: [d.tolist() for d in documents(v)] for v in (1, 2, 3)}
    problems = []
    if got not in (versions[1], versions[2]):
        problems.append(f"the dataset is neither the old nor the new one ({len(got)} documents)")
    elif durable(ctx, "built") and got != versions[2]:
        problems.append("the build returned but the old dataset is still there")
    build_indexed(documents(3), ctx.root / "corpus", vocab_size=32000)
    if _read_dataset(ctx.root / "corpus") != versions[3]:
        problems.append("a build after the crash did not publish its dataset")
    return problems


# -- (b) two ranks (gloo processes), each on its own node with a node-local tier 0 ------------------
RANK_TIMEOUT = 60.0


def rank_state(step: int, rank: int) -> dict[str, Any]:
    import torch

    return {"mine": torch.randn(2048, generator=torch.Generator().manual_seed(step * 10 + rank)), "step": step}


def rank_tiers(ctx: Ctx, rank: int) -> list[Any]:
    from tierio.ckpt import KeepLast, Tier

    return [Tier(str(ctx.root / f"node{rank}"), KeepLast(1), scope="node"), Tier(str(ctx.root / "shared"), KeepLast(2))]


def in_ranks(ctx: Ctx, phase: str, body: Any, world: int = 2) -> list[str]:
    """Run ``body(ctx, rank)`` in ``world`` forked gloo processes; their problems (or failures)."""
    import faulthandler
    import json
    import os
    import signal
    import time
    import traceback
    from datetime import timedelta

    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            out = ctx.control / f"{phase}-rank{rank}.json"
            faulthandler.dump_traceback_later(RANK_TIMEOUT - 5)  # where a hung rank waits, in the trial's log
            try:
                import torch.distributed as dist

                dist.init_process_group("gloo", init_method=f"file://{ctx.control}/pg-{phase}", rank=rank, world_size=world,
                                        timeout=timedelta(seconds=RANK_TIMEOUT))
                out.write_text(json.dumps(body(ctx, rank) or []))
                dist.destroy_process_group()
                code = 0
            except BaseException:
                out.write_text(json.dumps([f"rank {rank} raised in {phase}: {traceback.format_exc(limit=8)}"]))
                code = 3
            os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + 2 * RANK_TIMEOUT
    while len(codes) < world and time.monotonic() < deadline:  # a rank that failed leaves its peer in a collective
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.05)
    for pid in set(pids) - set(codes):
        os.kill(pid, signal.SIGKILL)
        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    problems = []
    for rank in range(world):
        out = ctx.control / f"{phase}-rank{rank}.json"
        problems += json.loads(out.read_text()) if out.exists() else [f"rank {rank} of {phase} hung (killed)"]
    if any(codes.values()) and not problems:
        problems.append(f"ranks of {phase} exited with {sorted(codes.values())}")
    return problems


def ranks_save(ctx: Ctx, rank: int) -> None:
    from tierio.ckpt import CheckpointManager

    with CheckpointManager(rank_tiers(ctx, rank), run_id="run-b", node=f"n{rank}", min_keep=1, commit_timeout=60) as m:
        m.save(1, rank_state(1, rank)).wait()
        ctx.arm(f"rank{rank}", volatile=[ctx.root / f"node{rank}"])  # a power loss of this rank's node
        h = m.save(2, rank_state(2, rank))
        h.committed.result()
        ctx.note("committed", 2)  # globally committed: every rank must restore it from now on
        h.wait()


def ranks_run(ctx: Ctx) -> None:
    problems = in_ranks(ctx, "run", ranks_save)
    if problems:
        raise RuntimeError("; ".join(problems))


def ranks_recover(ctx: Ctx, rank: int) -> list[str]:
    from tierio.ckpt import CheckpointManager

    at_least = durable(ctx, "committed")
    tiers = rank_tiers(ctx, rank)
    with CheckpointManager(tiers, run_id="recovery", node=f"n{rank}", min_keep=1, commit_timeout=60) as m:
        latest = m.latest()
        if latest not in (1, 2) or latest < at_least:
            return [f"rank {rank}: latest committed step is {latest}, globally committed up to {at_least}"]
        problems = differs(m.restore(), rank_state(m.restored_step, rank), f"rank {rank} step {m.restored_step}")
        m.save(3, rank_state(3, rank)).wait()
    with CheckpointManager(tiers, run_id="reader", node=f"n{rank}", min_keep=1) as m:
        problems += differs(m.restore(), rank_state(3, rank), f"rank {rank} step 3 saved after recovery")
    return problems


def ranks_check(ctx: Ctx) -> list[str]:
    return whole_listings([str(ctx.root / "shared")], {1, 2}) + in_ranks(ctx, "check", ranks_recover)


# -- (d) a lease taken over from a job that died holding it ------------------------------------------
def takeover_tiers(ctx: Ctx) -> list[Any]:
    from tierio.ckpt import KeepLast, Tier

    return [Tier(str(ctx.root / "shared"), KeepLast(2)), Tier(ctx.s3_url, KeepLast(2))]


def takeover_run(ctx: Ctx) -> None:
    """Job A saves step 1 and is killed holding the leases of both tiers; job B (on the same
    node, so A's death is provable) takes them over and saves step 2. Public API only."""
    import os
    import signal

    from tierio.ckpt import CheckpointManager

    pid = os.fork()
    if pid == 0:
        m = CheckpointManager(takeover_tiers(ctx), run_id="job-a", min_keep=1)
        m.save(1, state_for(1)).wait()
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    with CheckpointManager(takeover_tiers(ctx), run_id="job-b", min_keep=1) as m:
        ctx.arm()
        save_noted(ctx, m, 2)


def takeover_check(ctx: Ctx) -> list[str]:
    tiers = takeover_tiers(ctx)
    urls = [str(t.url) for t in tiers]
    problems = whole_listings(urls, {1, 2})
    problems += [f"{u}: job A's step 1 was deleted" for u in urls if 1 not in listed(u)]
    if durable(ctx, "promoted"):
        problems += [f"{u}: step 2 was promoted but is not listed{why_missing([t], 2)}"
                     for u, t in zip(urls, tiers) if 2 not in listed(u)]
    return problems + restore_and_go_on(tiers, {1, 2}, durable(ctx, "persisted"), 3)


SCENARIOS: list[Scenario] = [
    Scenario("promote", promote_run, promote_check, s3=True,
             about="(a) one rank: save to a local tier 0, promote to a shared directory and S3, retention"),
    Scenario("ranks", ranks_run, ranks_check, about="(b) two gloo ranks on two nodes, node-local tier 0, shared tier"),
    Scenario("incremental", incremental_run, incremental_check,
             about="(c) incremental saves referring to an earlier step's shard, retention keeping it"),
    Scenario("takeover", takeover_run, takeover_check, s3=True,
             about="(d) a lease taken over from a job killed holding it (directory and S3 tiers)"),
    Scenario("weights", weights_run, weights_check, about="(e) a weight-cache fill that evicts an older model"),
    Scenario("dataset", dataset_run, dataset_check, about="(f) a dataset rebuilt and published over the old one"),
]
BY_NAME = {s.name: s for s in SCENARIOS}
