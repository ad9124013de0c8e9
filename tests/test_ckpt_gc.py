"""The one garbage collector: leftovers of a process killed mid-promotion are removed by the next
manager and by `tierio ckpt gc`; stale S3 multipart uploads are aborted; the same safety rules
hold whether the manager, ckpt.steps.gc or the command line runs it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import torch

from tierio.ckpt import CheckpointManager, KeepAll, KeepEvery, KeepLast, Tier, gc, list_checkpoints, verify
from tierio.cli.main import main
from tierio.io.durable import is_temp
from tierio.storage import open_store


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 20, generator=g), "step": step}  # 4 MiB


def temps(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files if is_temp(f))


def tiers(root: Path) -> list:
    return [Tier(str(root / "fast"), KeepLast(2)), Tier(str(root / "slow"), KeepAll())]


def promote_slowly(root: str, first: int, ready, stop) -> None:
    """Child: save and promote at 1 MB/s (a 4 MiB shard takes seconds), to be killed meanwhile."""
    mgr = CheckpointManager(tiers(Path(root)), promote_bandwidth="1MB")
    mgr.save(first, state(first)).persisted.result()
    ready.set()
    stop.wait(300)


def kill_mid_promotion(root: Path, step: int) -> None:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=promote_slowly, args=(str(root), step, ready, stop))
    p.start()
    assert ready.wait(180), "saver did not start"
    step_dir = root / "slow" / f"step_{step:09d}"
    for _ in range(6000):  # until the partial shard shows on the slow tier (not the lease's temp file)
        if step_dir.is_dir() and temps(step_dir):
            break
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert temps(step_dir), "the kill did not land mid-promotion"
    assert not (root / "slow" / f"step_{step:09d}" / "manifest.json").exists()


def test_kill_mid_promotion_then_a_new_manager_leaves_no_temp_files(tmp_path):
    kill_mid_promotion(tmp_path, 1)
    with CheckpointManager(tiers(tmp_path)) as mgr:
        mgr.save(2, state(2)).wait()  # promotes the cut-short step 1 too, then cleans up
        assert mgr.steps() == [1, 2]
    assert temps(tmp_path) == []
    assert [c.step for c in list_checkpoints(tmp_path / "slow")] == [1, 2] and verify(tmp_path / "slow", 1).ok


def test_kill_mid_promotion_then_ckpt_gc_leaves_no_temp_files(tmp_path, capsys):
    kill_mid_promotion(tmp_path, 1)
    assert main(["ckpt", "gc", str(tmp_path / "slow"), "--keep", "all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["leftovers_removed"] >= 1
    assert temps(tmp_path / "slow") == []
    # A temp file a live writer holds is never removed (the writer's lock says it is alive).
    live = tmp_path / "slow" / ".rank_00000.safetensors.tmp-live"
    from tierio.io.files import hold_write_lock

    fd = os.open(live, os.O_CREAT | os.O_WRONLY)
    hold_write_lock(fd)
    try:
        assert main(["ckpt", "gc", str(tmp_path / "slow"), "--keep", "all"]) == 0
        assert live.exists()
    finally:
        os.close(fd)


def test_stale_multipart_uploads_are_aborted(tmp_path, s3_url, capsys):
    with CheckpointManager([tmp_path / "nvme", s3_url]) as mgr:
        mgr.save(1, state(1)).wait()
    s3 = open_store(s3_url)
    base = f"{s3.prefix}/" if s3.prefix else ""

    def start_upload(key: str) -> None:
        up = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=base + key)
        s3.client.upload_part(Bucket=s3.bucket, Key=base + key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 1024)

    def uploads() -> list[str]:
        return [u["Key"] for u in s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=base).get("Uploads", [])]

    start_upload("step_000000001/rank_00000.safetensors")  # in a committed step: a dead writer's
    start_upload("step_000000009/rank_00000.safetensors")  # not committed: may be a live one, kept by a manager
    with CheckpointManager([tmp_path / "nvme", s3_url]) as mgr:
        mgr.save(2, state(2)).wait()
    assert uploads() == [base + "step_000000009/rank_00000.safetensors"]
    assert main(["ckpt", "gc", s3_url, "--keep", "all"]) == 0  # holds the lease: no live writer exists
    assert uploads() == []
    assert "leftover" in capsys.readouterr().out


def test_one_collector_same_rules_everywhere(tmp_path, capsys):
    def fill(root: Path) -> None:
        with CheckpointManager([root]) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step)).wait()
        for step in (0, 4):  # a dead save older than every commit, and one that may be in flight
            (root / f"step_{step:09d}").mkdir()
            (root / f"step_{step:09d}" / "rank_00000.safetensors").write_bytes(b"partial")

    expected_dirs = ["step_000000003", "step_000000004", "tierio-lease"]  # the lease keeps its last generation
    # ckpt.steps.gc: a policy that keeps nothing still leaves the newest checkpoint, and debris older than it goes.
    fill(tmp_path / "a")
    assert gc(tmp_path / "a", "every:1000", min_keep=0) == [1, 2]
    assert sorted(os.listdir(tmp_path / "a")) == expected_dirs
    # the command line: the same decisions
    fill(tmp_path / "b")
    assert main(["ckpt", "gc", str(tmp_path / "b"), "--keep", "every:1000", "--min-keep", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted"] == [1, 2] and doc["deleted_uncommitted"] == [0] and doc["kept"] == [3]
    assert sorted(os.listdir(tmp_path / "b")) == expected_dirs
    # the manager
    fill(tmp_path / "c")
    with CheckpointManager([Tier(str(tmp_path / "c"), KeepEvery(1000))], min_keep=0) as mgr:
        assert sorted(s for _, s in mgr.gc()) == [1, 2]
    assert sorted(os.listdir(tmp_path / "c")) == expected_dirs
