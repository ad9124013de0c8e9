"""The planner's operator sections, each figure against hand arithmetic: the filesystem rule by GPU
count, idle dollars, recovery per tier against the target, node NVMe capacity, and the return on
packing, a DataLoader fix and faster serving restarts (the chapter's figures, its slips corrected)."""

from __future__ import annotations

import json

import pytest

from tierio.cli.main import main
from tierio.errors import ConfigError
from tierio.plan import operator
from tierio.plan.model import preset
from tierio.plan.report import PlanInputs, build_plan, tables


def test_filesystem_rule_by_gpu_count():
    assert operator.choose_filesystem(24).fs == "nfs"
    mid = operator.choose_filesystem(128)
    assert mid.fs == "lustre" and mid.by_scale == "weka or lustre" and "32 ≤ 128 GPUs ≤ 256" in mid.reason
    big = operator.choose_filesystem(1024)
    assert big.fs == "lustre" and "100+ OSTs" in big.reason
    forced = operator.choose_filesystem(1024, "nfs")
    assert forced.fs == "nfs" and not forced.fits and "15–20%" in forced.reason
    assert operator.choose_filesystem(16, "nfs").fits


def test_idle_dollars_and_the_chapter_figure():
    c = operator.gpu_time_cost(1024, 0.15, 3.0)
    assert c.per_hour == pytest.approx(1024 * 0.15 * 3)                  # $460.80/h (the chapter says $4,000+)
    assert c.per_day == pytest.approx(460.8 * 24) and c.per_year == pytest.approx(460.8 * 24 * 365)
    assert c.gpu_hours_per_day == pytest.approx(1024 * 0.15 * 24)


def test_roi_lines():
    plan = build_plan(PlanInputs())
    p, d, r = plan["roi"]["packing"], plan["roi"]["dataloader"], plan["roi"]["restarts"]
    assert p["share"] == pytest.approx(1 - (1 - 0.902) / (1 - 0.02))     # 90.0% of GPU time freed
    assert p["per_day"] == pytest.approx(1024 * 24 * 3 * (1 - 0.098 / 0.98))
    assert d["share"] == pytest.approx(0.15) and d["per_day"] == pytest.approx(1024 * 24 * 3 * 0.15)   # $11,059.20
    # 70 GB of FP8 weights: 70e9 / 7.5e9 = 9.33 s from NFS, 70e9 / 112e9 = 0.625 s with GDS
    saved = 70e9 / 7.5e9 - 70e9 / 112e9
    assert r["node_hours_per_day"] == pytest.approx(100 * 50 * saved / 3600)            # 12.1 node-hours
    assert r["gpu_hours_per_day"] == pytest.approx(100 * 50 * saved / 3600 * 8)         # 96.8 GPU-hours
    assert r["per_day"] == pytest.approx(100 * 50 * saved / 3600 * 8 * 3)               # $290.28 (not $36)
    # packing from MFU 42% -> 50%: the same work in 42/50 of the time
    assert operator.freed_share(0.42, 0.50) == pytest.approx(0.16)


def test_recovery_and_nvme_against_the_plan():
    plan = build_plan(PlanInputs())
    total, per_rank = plan["checkpoint"]["bytes_total"], plan["checkpoint"]["per_rank_written"]
    tiers = {t["tier"]: t for t in plan["recovery"]["tiers"]}
    assert tiers["local NVMe"]["seconds"] == pytest.approx(per_rank * 8 / 110e9)
    shared_bw = min(plan["write"]["storage_bw"], 128 * 25e9)
    assert tiers["shared filesystem"]["seconds"] == pytest.approx(total / shared_bw)
    assert tiers["object store"]["seconds"] == pytest.approx(total / 5e9) and tiers["object store"]["meets_target"]
    n = plan["nvme"]
    assert n["checkpoint_staging"] == pytest.approx(per_rank * 8 * 3)
    assert n["total"] == pytest.approx(2e12 + per_rank * 8 * 3 + 10e12) and n["fits"]
    big = build_plan(PlanInputs(model=preset("405b"),
                                gpus=2048, async_window_s=45, restart_s=60))
    obj = {t["tier"]: t for t in big["recovery"]["tiers"]}["object store"]
    assert obj["seconds"] == pytest.approx(6.48e12 / 5e9 + 60) and not obj["meets_target"]   # 1,356 s > 600 s
    with pytest.raises(ConfigError, match="kept steps"):
        operator.nvme_capacity(1, 1, 0, 1, 1)


def test_the_405b_review_question_still_holds(capsys):
    assert main(["plan", "--preset", "405b", "--gpus", "2048", "--async-window", "45s", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"]["bytes_total"] == pytest.approx(6.48e12)
    assert doc["checkpoint"]["per_rank_written"] == pytest.approx(3.164e9, rel=1e-3)
    assert doc["bandwidth"]["lustre"]["specified"] == 144


def test_cli_flags_and_tables(capsys):
    assert main(["plan", "--gpus", "24", "--gpus-per-node", "8", "--fs", "auto", "--idle-fraction", "12%",
                 "--only", "fs,idle", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fs"]["fs"] == "nfs" and doc["idle"]["per_day"] == pytest.approx(24 * 0.12 * 3 * 24)
    assert main(["plan", "--restart-to", "floppy", "--only", "roi"]) == 1
    assert "not a load path" in capsys.readouterr().err
    titles = [t for t, _, _ in tables(build_plan(PlanInputs()), ("fs", "idle", "recovery", "nvme", "roi"))]
    assert titles[0] == "Filesystem choice" and titles[-1] == "Return on fixes"
