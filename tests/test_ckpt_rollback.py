"""The rollback rule: after restoring step S, saving again supersedes the abandoned run's later
steps on every tier; a checkpoint saved after a rollback is never shadowed or lost."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from tierio.ckpt import CheckpointManager, KeepAll, KeepLast, Tier, inspect, list_checkpoints, verify
from tierio.cli.main import main
from tierio.errors import ConfigError


def state(step: int, branch: str) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(f"{step}/{branch}".encode()))  # the same in every process
    return {"w": torch.randn(32 * 1024, generator=g), "b": torch.randn(64, generator=g).bfloat16(),
            "step": step, "branch": branch}


def same(a: dict, b: dict) -> bool:
    return a["branch"] == b["branch"] and a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


def three_tiers(root: Path, last: str | None = None) -> list:
    shared = last or str(root / "shared")
    return [Tier(str(root / "nvme"), KeepLast(1)), Tier(str(root / "lustre"), KeepLast(3)), Tier(shared, KeepAll())]


def run_rollback(tiers: list) -> None:
    """Run A saves 1..3 everywhere; run B restores 1 and saves 2 and 3 again."""
    with CheckpointManager(tiers, min_keep=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step, "A")).wait()
    with CheckpointManager(tiers, min_keep=1) as mgr:
        assert same(mgr.restore(1), state(1, "A"))
        mgr.save(2, state(2, "B")).wait()
        assert mgr.latest() == 2  # the abandoned step 3 is gone from every tier
        mgr.save(3, state(3, "B")).wait()


def check_every_tier_holds_branch_b(urls: list[str]) -> None:
    for url in urls:
        for info in list_checkpoints(url):
            if info.step >= 2:
                assert info.resumed_from == 1, f"{url} step {info.step} still belongs to the abandoned run"
        with CheckpointManager([url]) as only:
            for step in only.steps():
                want = state(step, "A" if step == 1 else "B")
                assert same(only.restore(step), want), f"{url} serves the wrong step {step}"
        assert all(verify(url, s.step).ok for s in list_checkpoints(url))


def test_save_after_rollback_supersedes_the_old_run_on_every_tier(tmp_path):
    tiers = three_tiers(tmp_path)
    run_rollback(tiers)
    urls = [str(tmp_path / n) for n in ("nvme", "lustre", "shared")]
    assert [c.step for c in list_checkpoints(urls[0])] == [3]
    assert [c.step for c in list_checkpoints(urls[2])] == [1, 2, 3]
    check_every_tier_holds_branch_b(urls)
    # A new job resumes from branch B, whatever tier it reads.
    with CheckpointManager(tiers) as mgr:
        assert same(mgr.restore(), state(3, "B"))
    runs = {c.run for u in urls for c in list_checkpoints(u) if c.step >= 2}
    assert len(runs) == 1 and None not in runs


def test_rollback_with_an_s3_tier(tmp_path, s3_url):
    tiers = three_tiers(tmp_path, last=s3_url)
    run_rollback(tiers)
    check_every_tier_holds_branch_b([str(tmp_path / "nvme"), str(tmp_path / "lustre"), s3_url])
    man = inspect(s3_url, 2)
    assert man.extra["tierio.resumed_from"] == 1


def test_rollback_within_one_manager_and_abandoned_steps_beyond_the_new_one(tmp_path):
    tiers = [str(tmp_path / "a"), Tier(str(tmp_path / "b"), KeepAll())]
    with CheckpointManager(tiers) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, state(step, "A")).wait()
        assert same(mgr.restore(20), state(20, "A"))
        with pytest.raises(ConfigError, match="not after the restored step 20"):
            mgr.save(20, state(20, "B"))
        mgr.save(30, state(30, "B")).wait()
        assert mgr.steps() == [10, 20, 30]  # 40 would otherwise shadow the new branch
        with pytest.raises(ConfigError, match="immutable"):
            mgr.save(30, state(30, "C"))  # the branch's own checkpoints stay immutable
        assert same(mgr.restore(), state(30, "B"))
    for t in ("a", "b"):
        assert [c.step for c in list_checkpoints(tmp_path / t)] == [10, 20, 30]
        assert not (tmp_path / t / "step_000000040").exists()


def test_restoring_the_latest_retires_nothing(tmp_path):
    tiers = [str(tmp_path / "a"), str(tmp_path / "b")]
    with CheckpointManager(tiers) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step, "A")).wait()
    with CheckpointManager(tiers) as mgr:
        mgr.restore()
        mgr.save(3, state(3, "A")).wait()
        assert mgr.steps() == [1, 2, 3]


def test_manual_promote_never_overwrites_another_checkpoint_of_the_step(tmp_path, capsys):
    with CheckpointManager([str(tmp_path / "x")]) as mgr:
        mgr.save(5, state(5, "A")).wait()
    with CheckpointManager([str(tmp_path / "y")]) as mgr:
        mgr.save(5, state(5, "B")).wait()
    rc = main(["ckpt", "promote", str(tmp_path / "x"), str(tmp_path / "y"), "--step", "5"])
    err = capsys.readouterr().err
    assert rc == 1 and "another checkpoint of step 5" in err
    with CheckpointManager([str(tmp_path / "y")]) as mgr:
        assert same(mgr.restore(5), state(5, "B"))
    # The same checkpoint is recognised as already there.
    assert main(["ckpt", "promote", str(tmp_path / "y"), str(tmp_path / "z"), "--step", "5"]) == 0
    capsys.readouterr()
    assert main(["ckpt", "promote", str(tmp_path / "y"), str(tmp_path / "z"), "--step", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["promoted"][0]["skipped"] == "already committed on DST"


def gloo_rollback(rank: int, root: str, init: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        tiers = [str(Path(root) / "fast"), Tier(str(Path(root) / "slow"), KeepAll())]
        with CheckpointManager(tiers, commit_timeout=120) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step, f"A{rank}")).wait()
            dist.barrier()  # only so the test can compare: the commit itself uses no collectives
            assert same(mgr.restore(1), state(1, f"A{rank}"))
            dist.barrier()
            mgr.save(2, state(2, f"B{rank}")).wait()  # the old step 2 is still committed when rank 1 writes
            dist.barrier()
            assert mgr.steps() == [1, 2]
            assert same(mgr.restore(2), state(2, f"B{rank}"))
    finally:
        dist.destroy_process_group()


def test_rollback_with_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as tmp

    tmp.start_processes(gloo_rollback, args=(str(tmp_path), f"file://{tmp_path}/pg"), nprocs=2,
                        start_method="spawn", join=True)
    for tier in ("fast", "slow"):
        assert [c.step for c in list_checkpoints(tmp_path / tier)] == [1, 2] and verify(tmp_path / tier, 2).ok
        names = sorted(p.name for p in (tmp_path / tier / "step_000000002").iterdir())
        assert names == ["manifest.json", "rank_00000.safetensors", "rank_00001.safetensors"]
        with CheckpointManager([tmp_path / tier], rank=1, world_size=2) as mgr:
            assert same(mgr.restore(2), state(2, "B1"))
