"""Incremental checkpoints: unchanged tensors are referenced, not rewritten; retention, gc, the CLI,
promotion (to S3 too), verify and restore all follow the references; kill -9 mid-save restores
bit-exact; dangling references and cycles are clear errors."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from tierio.ckpt import CheckpointManager, KeepLast, Tier, delete_step, gc, inspect, list_checkpoints, verify
from tierio.errors import DanglingReferenceError, FormatError
from tierio.format.shard import manifest_key, shard_key
from tierio.storage import open_store
from saving_loops import save_forever

FROZEN = 256 * 1024  # fp32 elements of the frozen tensor (1 MiB)


def frozen() -> torch.Tensor:
    return torch.randn(FROZEN, generator=torch.Generator().manual_seed(7))


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"frozen": frozen(), "lora": torch.randn(4096, generator=g), "step": step}


def same(out: dict, step: int) -> bool:
    exp = state_for(step)
    return out["step"] == step and torch.equal(out["frozen"], exp["frozen"]) and torch.equal(out["lora"], exp["lora"])


def saved(root, steps, tiers=None, **kw) -> list[dict]:
    tiers = tiers or [root / "fast", root / "slow"]
    with CheckpointManager(tiers, incremental=True, min_keep=1, **kw) as mgr:
        for s in steps:
            mgr.save(s, state_for(s)).wait()
        return [dict(x) for x in mgr.stats()["saves"]]


def chunk_files(tier, step: int) -> dict[str, str]:
    doc = json.loads((tier / manifest_key(step)).read_bytes())
    return {n: t["chunks"][0]["file"] for n, t in doc["ranks"][0]["tensors"].items()}


def test_unchanged_tensors_are_referenced_and_restore_bit_exact(tmp_path):
    saves = saved(tmp_path, [10, 20, 30])
    assert "reused_bytes" not in saves[0] and saves[1]["reused_bytes"] == saves[2]["reused_bytes"] == FROZEN * 4
    assert saves[2]["written_bytes"] * 10 < saves[2]["bytes"]
    for tier in (tmp_path / "fast", tmp_path / "slow"):
        # a reference names the file holding the bytes (step 10's), never a reference to a reference
        assert chunk_files(tier, 30) == {"frozen": "step_000000010/rank_00000.safetensors", "lora": "rank_00000.safetensors"}
        assert (tier / shard_key(30, 0)).stat().st_size < 64 << 10
        assert verify(tier, 30).ok
    with CheckpointManager([tmp_path / "fast", tmp_path / "slow"]) as mgr:
        assert same(mgr.restore(30), 30) and same(mgr.restore(20, mapped=False), 20)
        # the first save after a restore is a full one
        mgr.save(40, state_for(40)).wait()
    assert chunk_files(tmp_path / "fast", 40)["frozen"] == "rank_00000.safetensors"


def test_retention_keeps_referenced_chunks(tmp_path):
    fast = tmp_path / "fast"
    with CheckpointManager([Tier(fast, KeepLast(1))], incremental=True, min_keep=1) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state_for(s)).wait()
        assert mgr.steps() == [30]
    assert sorted(os.listdir(fast / "step_000000010")) == ["rank_00000.safetensors"]  # no manifest: not a checkpoint
    assert not (fast / "step_000000020").exists()
    assert verify(fast, 30).ok
    with CheckpointManager([fast]) as mgr:
        assert same(mgr.restore(30), 30)
        mgr.save(40, state_for(40)).wait()  # a full save: nothing refers to step 10 once 30 goes
    assert gc(fast, "last:1", min_keep=1) == [30]
    assert sorted(os.listdir(fast)) == ["step_000000040", "tierio-lease"]  # step 10's shard went with the last reference


def test_gc_api_and_cli_and_delete_step_keep_referenced_chunks(tmp_path):
    saved(tmp_path, [10, 20, 30], tiers=[tmp_path / "fast"])
    fast = tmp_path / "fast"
    assert gc(fast, "last:2", min_keep=1) == [10]
    assert (fast / shard_key(10, 0)).exists() and not (fast / manifest_key(10)).exists()
    r = subprocess.run([sys.executable, "-m", "tierio", "ckpt", "gc", str(fast), "--keep", "last:1", "--min-keep", "1",
                        "--json"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["deleted"] == [20]
    assert (fast / shard_key(10, 0)).exists() and verify(fast, 30).ok
    for argv in (["ls", str(fast), "--json"], ["verify", str(fast), "--all", "--json"]):
        r = subprocess.run([sys.executable, "-m", "tierio", "ckpt", *argv], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert r.returncode == 0, r.stderr  # step 10's kept shard is neither a partial checkpoint nor a bad one
        doc = json.loads(r.stdout)
        assert doc.get("referenced_only", [10]) == [10] and doc.get("uncommitted", []) == []
        assert [x["step"] for x in doc.get("steps", [{"step": 30}])] == [30]
    with CheckpointManager([fast]) as mgr:
        mgr.save(40, state_for(40)).wait()  # a full save
    delete_step(open_store(str(fast)), 30)  # the last step referring to step 10: its shard may go now
    assert not (fast / "step_000000030").exists() and (fast / shard_key(10, 0)).exists()
    report = gc(fast, "all", min_keep=0)
    assert report == [] and not (fast / "step_000000010").exists()  # debris once nothing refers to it


def corrupt(path) -> None:
    with open(path, "r+b") as f:
        f.seek(8192)  # inside 'frozen', the first (largest, then by name) tensor of the shard
        f.write(b"\xff" * 8)


def test_corrupt_referenced_chunk_is_found_and_restore_falls_back(tmp_path):
    saved(tmp_path, [10, 20])
    corrupt(tmp_path / "fast" / shard_key(10, 0))
    report = verify(tmp_path / "fast", 20)
    assert not report.ok
    assert any("step_000000010/rank_00000.safetensors" in p.file and "'frozen'" in (p.chunk or "") for p in report.problems)
    assert verify(tmp_path / "slow", 20).ok
    with CheckpointManager([tmp_path / "fast", tmp_path / "slow"]) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert same(mgr.restore(20), 20)
            assert same(mgr.restore(20, mapped=False), 20)
        assert any("slow" in str(w.message) for w in caught)


def test_dangling_reference_is_a_typed_error(tmp_path):
    saved(tmp_path, [10, 20])
    os.remove(tmp_path / "fast" / shard_key(10, 0))  # deleted outside tierio, on one tier
    with CheckpointManager([tmp_path / "fast", tmp_path / "slow"]) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert same(mgr.restore(20), 20)  # read from the other tier
    os.remove(tmp_path / "slow" / shard_key(10, 0))  # and on the other
    report = verify(tmp_path / "fast", 20)
    assert any("dangling reference" in p.message and "'frozen'" in p.message and "step 20" in p.message
               for p in report.problems)
    with CheckpointManager([tmp_path / "fast", tmp_path / "slow"]) as mgr:
        for mapped in (True, False):
            with pytest.raises(DanglingReferenceError) as exc:
                mgr.restore(20, mapped=mapped)
            assert exc.value.step == 20 and exc.value.tensor == "frozen"
            assert exc.value.file == "step_000000010/rank_00000.safetensors"
    dst = tmp_path / "third"
    from tierio.ckpt import promote
    with pytest.raises(DanglingReferenceError, match="frozen"):
        promote(tmp_path / "fast", dst, 20)
    assert not (dst / manifest_key(20)).exists()


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A tier holding step 10 and step 20 (which refers to step 10), saved once for the module."""
    root = tmp_path_factory.mktemp("two_steps")
    saved(root, [10, 20], tiers=[root / "fast"])
    return root / "fast"


@pytest.mark.parametrize("ref", [
    "step_000000020/rank_00000.safetensors",  # itself: a cycle
    "step_000000030/rank_00000.safetensors",  # a later step
    "step_000000010/../../../etc/passwd",
    "/step_000000010/rank_00000.safetensors",
    "step_000000010/rank_00000.safetensors/x",
    "step_10/rank_00000.safetensors",
])
def test_hostile_references_are_refused(tmp_path, two_steps, ref):
    shutil.copytree(two_steps, tmp_path / "fast")
    path = tmp_path / "fast" / manifest_key(20)
    doc = json.loads(path.read_bytes())
    doc["ranks"][0]["tensors"]["frozen"]["chunks"][0]["file"] = ref
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError) as exc:
        inspect(tmp_path / "fast", 20)
    if ref.startswith("step_0000000") and ref.endswith(".safetensors") and ".." not in ref:
        assert "reference cycle" in str(exc.value) and "'frozen'" in str(exc.value) and "step 20" in str(exc.value)
    assert not verify(tmp_path / "fast", 20).ok


# -- kill -9 mid incremental save --------------------------------------------------------------------
TRIALS = 20


def saver(root: str, first: int, ready, persisted) -> None:
    """Child: incremental saves forever, reporting each step once it is durable."""
    mgr = CheckpointManager([Tier(os.path.join(root, "fast"), KeepLast(2))], incremental=True, min_keep=1)
    ready.set()
    save_forever(mgr, first, state_for, persisted)


def test_kill_dash_nine_mid_incremental_save(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tierio.ckpt"])
    rng = random.Random(99)
    root = str(tmp_path)
    next_step, restored = 1, 0
    for trial in range(TRIALS):
        ready, persisted = ctx.Event(), ctx.Value("q", 0, lock=False)  # a lock would die held by a killed child
        p = ctx.Process(target=saver, args=(root, next_step, ready, persisted))
        p.start()
        assert ready.wait(60), "saver did not start"
        if trial % 4 == 3:  # some kills land after a few incremental commits even on a loaded machine
            deadline = time.monotonic() + 60
            while persisted.value < next_step + 2 and time.monotonic() < deadline:
                time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        with CheckpointManager([os.path.join(root, "fast")], min_keep=1) as mgr:
            latest = mgr.latest()
            assert persisted.value == 0 or (latest is not None and latest >= persisted.value)
            if latest is not None:
                assert same(mgr.restore(), latest), f"trial {trial}: step {latest}"
                assert verify(os.path.join(root, "fast"), latest).ok
                restored += 1
        next_step = max(next_step, latest or 0, persisted.value) + 1
    assert restored >= TRIALS // 2
    refs = [s for s in (c.step for c in list_checkpoints(os.path.join(root, "fast")))
            if chunk_files(tmp_path / "fast", s)["frozen"].startswith("step_")]
    assert refs, "no incremental checkpoint survived the trials"


# -- S3 ----------------------------------------------------------------------------------------------
def test_promotion_to_s3_carries_referenced_shards(tmp_path, s3_url):
    fast = tmp_path / "nvme"
    with CheckpointManager([Tier(fast, KeepLast(1)), Tier(s3_url, KeepLast(1))], incremental=True, min_keep=1) as mgr:
        mgr.save(10, state_for(10)).wait()
        mgr.save(20, state_for(20)).wait()
        mgr.save(30, state_for(30)).wait()
    s3 = open_store(s3_url)
    assert s3.exists(shard_key(10, 0)) and not s3.exists(manifest_key(10)) and not s3.exists(manifest_key(20))
    assert verify(s3_url, 30).ok
    # a fresh S3 tier gets the referenced shard with the step that refers to it
    from tierio.ckpt import promote
    other = s3_url.replace("?", "-copy?", 1) if "?" in s3_url else s3_url + "-copy"
    promote(fast, other, 30)
    assert open_store(other).exists(shard_key(10, 0)) and verify(other, 30).ok
    shutil.rmtree(fast)  # the node's disk is gone
    with CheckpointManager([fast, s3_url]) as mgr:
        assert same(mgr.restore(30), 30)


def test_weights_load_refuses_an_incremental_step_and_export_writes_it_whole(tmp_path):
    from tierio.ckpt.export import export
    from tierio.weights import load

    saved(tmp_path, [10, 20], tiers=[tmp_path / "fast"])
    with pytest.raises(FormatError, match="incremental checkpoint"):
        load(tmp_path / "fast")
    export(tmp_path / "fast", tmp_path / "model", step=20)
    out = load(tmp_path / "model")
    assert torch.equal(out["frozen"], frozen()) and torch.equal(out["lora"], state_for(20)["lora"])


# -- several ranks ---------------------------------------------------------------------------------
def rank_worker(rank: int, root: str, init: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        # inline_record_bytes=0: the manifest names each rank's record, so counting references reads them
        with CheckpointManager([Tier(os.path.join(root, "fast"), KeepLast(1)), os.path.join(root, "slow")],
                               incremental=True, min_keep=1, inline_record_bytes=0) as mgr:
            for step in (10, 20, 30):
                state = state_for(step)
                state["lora"] += rank
                mgr.save(step, state).wait()
            dist.barrier()
            out = mgr.restore(30)
            assert torch.equal(out["frozen"], frozen()) and torch.equal(out["lora"], state_for(30)["lora"] + rank)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_incremental_with_records_and_retention(tmp_path):
    import torch.multiprocessing as tmp

    tmp.start_processes(rank_worker, args=(str(tmp_path), f"file://{tmp_path}/pg"), nprocs=2, start_method="spawn",
                        join=True)
    fast = tmp_path / "fast"
    assert [c.step for c in list_checkpoints(fast)] == [30]
    assert sorted(os.listdir(fast / "step_000000010")) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    plain = inspect(fast, 30)  # records by reference: the manifest alone still says it is incremental
    assert not plain.ranks[1].loaded and plain.incremental
    man = inspect(fast, 30, records=True)
    assert {c.file for r in man.ranks for c in r.tensors["frozen"].chunks} == {
        "step_000000010/rank_00000.safetensors", "step_000000010/rank_00001.safetensors"}
    assert verify(fast, 30).ok and verify(tmp_path / "slow", 30).ok


def test_bench_incremental_figures_run(tmp_path):
    from tierio.bench import incremental
    from tierio.bench.ckpt import TARGETS, make_state

    out = incremental.measure(make_state(8 << 20, 24), tmp_path, repeat=1)
    assert 0 < out["changed_share"] <= incremental.CHANGED
    assert out["full_bytes"] > 10 * out["incremental_bytes"] and out["bytes_ratio"] > 10
    assert out["persist_ratio"] > 0 and {"incremental_bytes_ratio", "incremental_persist_vs_full"} <= set(TARGETS)


def uneven_worker(rank: int, root: str, init: str) -> None:
    """Rank 0 changes every tensor at every step, rank 1 changes only ``lora``: only rank 1's
    entries refer to earlier shards, and records by reference keep them out of the committer's sight."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        with CheckpointManager([os.path.join(root, "fast")], incremental=True, inline_record_bytes=0) as mgr:
            for step in (10, 20):
                state = state_for(step)
                if rank == 0:
                    state["frozen"] += step
                mgr.save(step, {f"{k}{rank}": v for k, v in state.items()}).wait()  # disjoint names: a model
    finally:
        dist.destroy_process_group()


def test_weights_load_sees_references_only_another_rank_made(tmp_path):
    import torch.multiprocessing as tmp
    from tierio.weights import load

    tmp.start_processes(uneven_worker, args=(str(tmp_path), f"file://{tmp_path}/pg"), nprocs=2, start_method="spawn",
                        join=True)
    man = inspect(tmp_path / "fast", 20, records=True)
    assert not man.ranks[0].refs and man.ranks[1].refs  # rank 1's shard lacks 'frozen1'
    with pytest.raises(FormatError, match="incremental checkpoint"):
        load(tmp_path / "fast")
