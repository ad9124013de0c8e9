"""The optimal checkpoint interval: Young/Daly's arithmetic, the manager's should_save from its
measured saves (the clock is driven in, never read by the assertions), and `tierio plan`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tierio.ckpt import CheckpointManager, CheckpointOptions
from tierio.ckpt.saving.interval import interval_at, measured_cost, optimal_interval, save_due
from tierio.cli.main import main
from tierio.errors import ConfigError


def test_young_daly_arithmetic():
    p = optimal_interval(2.0, 4 * 3600)  # sqrt(2 * 2 s * 14,400 s) = 240 s
    assert p.young_daly_s == pytest.approx(240.0)
    assert p.interval_s == pytest.approx(240.0) and p.bound == "young-daly"
    assert p.overhead == pytest.approx(2.0 / 240.0)
    assert p.lost_per_failure_s == pytest.approx((240.0 + 2.0) / 2)
    assert p.waste == pytest.approx(2.0 / 240.0 + 121.0 / 14400.0)
    with_restart = optimal_interval(2.0, 4 * 3600, restart_s=600.0)
    assert with_restart.interval_s == pytest.approx(240.0)  # the restart does not move the optimum
    assert with_restart.lost_per_failure_s == pytest.approx(121.0 + 600.0)


def test_the_background_write_bounds_the_interval_from_below():
    p = optimal_interval(2.0, 4 * 3600, write_s=400.0)
    assert p.young_daly_s == pytest.approx(240.0)
    assert p.interval_s == pytest.approx(400.0) and p.bound == "background write"
    assert p.lost_per_failure_s == pytest.approx(201.0)


@pytest.mark.parametrize("cost,mtbf", [(0.05, 3600.0), (2.0, 14400.0), (30.0, 86400.0)])
def test_the_optimum_loses_least(cost, mtbf):
    best = optimal_interval(cost, mtbf)
    for factor in (0.5, 0.8, 0.95, 1.05, 1.25, 2.0):
        assert interval_at(best.interval_s * factor, cost, mtbf).waste > best.waste


@pytest.mark.parametrize("mtbf", [0, -1.0, math.inf, math.nan, "4h", True])
def test_bad_mtbf_is_refused(tmp_path, mtbf):
    with pytest.raises(ConfigError, match="mean time between failures"):
        optimal_interval(1.0, mtbf)
    with pytest.raises(ConfigError, match="mean time between failures"):
        CheckpointManager([tmp_path / "t0"], CheckpointOptions(mtbf=mtbf))


def test_measured_cost_is_the_mean_of_recent_saves_and_their_longest_write():
    saves = [{"blocking_seconds": 100.0, "persist_seconds": 100.0}] + [
        {"blocking_seconds": b, "persist_seconds": w} for b, w in ((1.0, 3.0), (2.0, 5.0), (3.0, 4.0), (4.0, 1.0))
    ] + [{"blocking_seconds": 5.0}]  # the latest still persists: no write time yet
    cost = measured_cost(saves)
    assert cost is not None and cost.saves == 5
    assert cost.blocking_s == pytest.approx(3.0) and cost.write_s == pytest.approx(5.0)
    assert measured_cost([]) is None
    overlapped = [{"blocking_seconds": 0.5, "update_wait_seconds": 1.5, "persist_seconds": 2.0}]
    assert measured_cost(overlapped).blocking_s == pytest.approx(2.0)  # the update's wait holds training too


def test_no_save_while_the_previous_one_persists():
    plan = optimal_interval(1.0, 3600.0)
    assert save_due(plan, plan.interval_s * 10, persisting=False)
    assert not save_due(plan, plan.interval_s * 10, persisting=True)
    assert not save_due(plan, plan.interval_s * 0.99, persisting=False)


def test_should_save_needs_an_mtbf(tmp_path):
    with CheckpointManager([tmp_path / "t0"]) as mgr, pytest.raises(ConfigError, match="mtbf"):
        mgr.should_save(1)


def test_should_save_follows_the_measured_cost(tmp_path):
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 0}
    with CheckpointManager([tmp_path / "t0"], mtbf=3600.0) as mgr:
        assert mgr.interval_plan() is None
        assert mgr.should_save(1)  # the first save measures the cost
        mgr.save(1, state).wait()
        saves = mgr.stats()["saves"]
        plan = mgr.interval_plan()
        assert plan is not None
        assert plan.cost_s == pytest.approx(saves[0]["blocking_seconds"])
        assert plan.write_s == pytest.approx(saves[0]["persist_seconds"])
        assert plan.interval_s == pytest.approx(max(math.sqrt(2 * plan.cost_s * 3600.0), plan.write_s))
        returned = saves[0]["returned_at"]
        assert not mgr.should_save(2, now=returned + plan.interval_s * 0.5)
        assert mgr.should_save(2, now=returned + plan.interval_s * 1.01)
        mgr.save(2, state).wait()
        # the cost is the mean of the saves so far, and the clock runs from the latest one
        saves = mgr.stats()["saves"]
        plan2 = mgr.interval_plan()
        assert plan2.cost_s == pytest.approx((saves[0]["blocking_seconds"] + saves[1]["blocking_seconds"]) / 2)
        assert not mgr.should_save(3, now=saves[1]["returned_at"] + plan2.interval_s * 0.5)
        assert mgr.should_save(3, now=saves[1]["returned_at"] + plan2.interval_s * 1.01)


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--only", "interval", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["interval"]


def test_plan_prints_the_optimum_and_the_work_lost(capsys):
    iv = plan_json(capsys, "--snapshot-time", "2s", "--mtbf", "4h", "--step-time", "20s")
    best = iv["optimum"]
    assert iv["mtbf_s"] == 14400 and iv["mtbf_source"] == "given"
    assert best["interval_s"] == pytest.approx(240.0) and best["bound"] == "young-daly"
    assert iv["optimum_steps"] == pytest.approx(12.0)
    assert best["lost_per_failure_s"] == pytest.approx(121.0)
    planned = iv["planned"]  # 1,000 steps of 20 s
    assert planned["interval_s"] == pytest.approx(20000.0)
    assert planned["lost_per_failure_s"] == pytest.approx(10001.0) and planned["waste"] > best["waste"]
    # without --mtbf: one GPU's MTBF over the GPUs
    iv = plan_json(capsys, "--gpus", "1000", "--gpu-mtbf", "1000h")
    assert iv["mtbf_s"] == pytest.approx(3600.0) and iv["mtbf_source"] != "given"
    assert main(["plan", "--only", "interval"]) == 0
    assert "Young/Daly" in capsys.readouterr().out


def test_plan_interval_bounded_by_the_background_write(capsys):
    iv = plan_json(capsys, "--snapshot-time", "10ms", "--mtbf", "1h", "--storage-bw", "10GB/s")
    best = iv["optimum"]
    assert best["young_daly_s"] == pytest.approx(math.sqrt(2 * 0.01 * 3600))
    assert best["bound"] == "background write" and best["interval_s"] == pytest.approx(best["write_s"])


@pytest.mark.parametrize("argv,msg", [(["--mtbf", "0s"], "more than zero"), (["--mtbf=-3h"], "negative"),
                                      (["--gpu-mtbf", "soon"], "cannot read"), (["--restart-time=-1s"], "negative")])
def test_plan_refuses_bad_failure_figures(capsys, argv, msg):
    assert main(["plan", "--only", "interval", *argv]) == 1
    err = capsys.readouterr().err
    assert "--" in err and msg in err and "Traceback" not in err


def agreeing_worker(rank: int, root: str, init: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        with CheckpointManager([root], mtbf=3600.0) as mgr:
            assert mgr.should_save(1)
            mgr.save(1, {"w": torch.full((1024,), float(rank)), "step": 1}).wait()
            plan = mgr.interval_plan()
            last = mgr.stats()["saves"][0]["returned_at"]
            # rank 1 finds the next step due, rank 0 not yet: nobody saves it
            assert not mgr.should_save(2, now=last + plan.interval_s * (2.0 if rank else 0.5))
            assert mgr.should_save(3, now=last + plan.interval_s * 2.0)
            mgr.save(3, {"w": torch.full((1024,), float(rank)), "step": 3}).wait()
            assert mgr.steps() == [1, 3]
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_should_save(tmp_path):
    import torch.multiprocessing as tmp

    tmp.start_processes(agreeing_worker, args=(str(tmp_path / "t0"), f"file://{tmp_path}/pg"), nprocs=2,
                        start_method="spawn", join=True)
