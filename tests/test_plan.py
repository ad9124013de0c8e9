"""The sizing planner reproduces the worked examples' arithmetic and refuses bad input clearly."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierio.cli.main import main
from tierio.errors import ConfigError, FormatError
from tierio.plan import (
    Parallelism, PlanInputs, archive_cost, build_plan, checkpoint_size, data_read_bw, fetch_rule, kv_bytes_per_token,
    lustre_osts, parse_measured, pinned_memory, preset, required_write_bw, stripe_tax, users_per_budget,
    weight_load_times, write_costs,
)
from tierio.plan.quantities import fmt_bytes, fmt_rate, parse_bytes, parse_count, parse_duration, parse_rate


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- the 1,024-GPU worked example -------------------------------------------------------------

def test_worked_example_defaults(capsys):
    plan = run_json(capsys)
    ck, bw = plan["checkpoint"], plan["bandwidth"]
    assert ck["bytes_per_param"] == 16
    assert ck["bytes_total"] == pytest.approx(1.12e12)                       # 70B × 16 B = 1.12 TB
    assert ck["per_rank_written"] == pytest.approx(1.12e12 / 1024)           # 1.09 GB per rank
    assert fmt_bytes(ck["per_rank_written"]) == "1.09 GB"
    assert fmt_rate(bw["required_write"]["base"]) == "37.3 GB/s"             # 1,024 × 1.09 GB / 30 s
    assert bw["required_write"]["target"] == pytest.approx(74.67e9, rel=1e-3)  # ≈ 75 GB/s with 2× margin
    assert bw["lustre"]["minimum"] == 38                                     # 75 / 2 → 38 OSTs
    assert bw["lustre"]["specified"] == 48                                   # rounded to 48
    assert plan["cost"]["hardware"]["total"] == pytest.approx(1.2e6)         # 48 × $25K
    assert plan["data"]["bytes_per_step"] == pytest.approx(8e6)              # 4M tokens × 2 B = 8 MB
    assert plan["data"]["bandwidth"] == pytest.approx(0.32e6)                # 8 MB / 25 s = 0.32 MB/s (not GB/s)
    loads = {p["path"]: p["seconds"] for p in plan["weights"]["paths"]}
    assert round(loads["gds"], 2) == 0.62 or round(loads["gds"], 3) == 0.625  # 70 GB / 112 GB/s
    assert round(loads["nfs"], 1) == 9.3                                     # 70 GB / 7.5 GB/s
    assert round(loads["nvlink"], 2) == 0.12


def test_kv_example(capsys):
    plan = run_json(capsys, "--preset", "llama3-70b", "--only", "kv")
    kv = plan["kv"]
    assert kv["bytes_per_token"] == 163_840                                  # 2 × 80 × 8 × 128 × 1 B
    assert kv["bytes_per_user"] == 8192 * 163_840 == 1.25 * 2**30            # 1.34 GB = 1.25 GiB
    assert kv["serve_gpus"] == 2
    assert kv["hbm_budget"] == pytest.approx(75e9)                           # 2 × 80 − 70 − 15
    assert kv["hbm_users"] == 55                                             # 75 GB / 1.342 GB (text says 58)
    assert kv["nvme_users"] == 7450                                          # 10 TB / 1.342 GB (text says 7,812)
    fr = kv["fetch_rule"]
    assert fr["penalty_s"] == pytest.approx(20e-6)                           # 0.1 × 200 µs
    assert fr["overhead"] == pytest.approx(20e-6 / 15e-3)                    # 0.13%
    assert fr["viable"] is True
    assert "checkpoint" not in plan


def test_kv_budget_in_binary_units_gives_60_users():
    m = preset("llama3-70b")
    per_user = kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, 1) * 8192
    assert users_per_budget(75 * 2**30, per_user) == 60                      # consistent GiB: 75 / 1.25


def test_section_15_4_table_128_gpus(capsys):
    plan = run_json(capsys, "--gpus", "128", "--interval-steps", "100", "--storage-bw", "100GB/s",
                    "--snapshot-time", "4s", "--misc", "1GB", "--only", "checkpoint,write")
    ck = plan["checkpoint"]
    assert ck["bytes_total"] == pytest.approx(1121e9)
    assert fmt_bytes(ck["per_rank_written"]) == "8.76 GB"
    comps = {c["name"]: c["bytes_total"] / 128 for c in ck["components"]}
    assert fmt_bytes(comps["model weights (bf16)"]) == "1.09 GB"
    assert fmt_bytes(comps["optimizer: Adam v (fp32)"]) == "2.19 GB"
    single, sharded, asyn = plan["write"]["strategies"]
    assert round(single["blocking_s"]) == 112 and single["overhead"] == pytest.approx(0.0448, rel=1e-3)
    assert sharded["blocking_s"] == pytest.approx(11.21, abs=0.01) and round(sharded["overhead"] * 100, 2) == 0.45
    assert asyn["blocking_s"] == 4 and asyn["overhead"] == pytest.approx(0.0016)
    assert asyn["background_s"] == sharded["blocking_s"]


def test_stripe_tax_and_405b_review_question():
    tax = stripe_tax(1024 * 8.76e9, 2e9, 96)                                 # the chapter's c=1 vs c=96 figure
    assert round(tax.seconds_c1) == 4485 and round(tax.seconds_full) == 47
    par = Parallelism(2048)
    size = checkpoint_size(405e9, par)
    assert size.bytes_total == pytest.approx(6.48e12)
    need = required_write_bw(size.bytes_total, 45)
    assert need.base == pytest.approx(144e9)
    assert lustre_osts(need.target, 2e9, round_to=1).minimum == 144


def test_money_per_second_of_stall():
    # 10,000 GPUs at $3/GPU-h: a 90 s stall costs $750.
    par = Parallelism(10_000, gpus_per_node=8)
    size = checkpoint_size(70e9, par)
    costs = write_costs(size, par, single_writer_bw=size.bytes_total / 90, storage_bw=1e12, node_bw=1e12,
                        snapshot_bw=1e12, interval_s=25_000, gpu_hour_cost=3.0)
    assert costs[0].cost_per_ckpt == pytest.approx(750.0)


def test_pinned_memory_is_megabytes_not_gigabytes():
    pm = pinned_memory(8, 4, 32, 4096, 2)
    assert pm.per_gpu == 8 * 4 * 32 * 4096 * 2 == 8_388_608                 # 8.4 MB (text says 8.4 GB)


def test_archive_cost_grows_quadratically():
    three = archive_cost(6e12, 0.02, 3)
    assert three.total == pytest.approx(2.37e6, rel=0.01)
    assert archive_cost(6e12, 0.02, 6).total == pytest.approx(4 * three.total, rel=0.01)
    capped = archive_cost(6e12, 0.02, 3, retention_days=30)
    assert capped.final_stored_bytes == pytest.approx(180e12)
    assert capped.total < three.total / 10


# ---- sharding rules ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage,held_per_param", [(0, 16), (1, 4 + 12 / 64), (2, 2 + 14 / 64), (3, 16 / 64)])
def test_zero_stages(stage, held_per_param):
    size = checkpoint_size(1e9, Parallelism(64, zero_stage=stage))
    assert size.bytes_total == 16e9
    assert size.per_rank_held == pytest.approx(held_per_param * 1e9)


def test_tensor_parallel_splits_everything():
    size = checkpoint_size(1e9, Parallelism(64, tp=8, zero_stage=0))
    assert size.per_rank_held == pytest.approx(16e9 / 8)


@given(params=st.floats(1e6, 1e12), world=st.sampled_from([8, 64, 512, 4096]), stage=st.integers(0, 3))
def test_checkpoint_invariants(params, world, stage):
    size = checkpoint_size(params, Parallelism(world, zero_stage=stage))
    assert size.bytes_total == pytest.approx(16 * params)
    assert size.bytes_total / world * (1 - 1e-9) <= size.per_rank_written <= size.bytes_total * (1 + 1e-9)


@given(bw=st.floats(1e6, 1e13), ost=st.floats(1e8, 1e11), r=st.integers(1, 64))
def test_ost_plan_covers_target(bw, ost, r):
    plan = lustre_osts(bw, ost, r)
    assert plan.specified % r == 0 and plan.specified >= plan.minimum
    assert plan.minimum * ost >= bw * (1 - 1e-6)


# ---- measured bandwidths ------------------------------------------------------------------------

PROBE = {
    "fs_type": "xfs",
    "results": [
        {"target": "/mnt/nvme", "mode": "direct", "op": "write", "bytes": 1 << 30, "seconds": 0.5,
         "bytes_per_s": 2.0e9, "concurrency": 8},
        {"target": "/mnt/nvme", "mode": "buffered", "op": "write", "bytes": 1 << 30, "seconds": 0.9,
         "bytes_per_s": 1.1e9, "concurrency": None},
        {"target": "/mnt/nvme", "mode": "direct", "op": "read", "bytes": 1 << 30, "seconds": 0.3,
         "bytes_per_s": 3.5e9, "concurrency": 8},
    ],
}


def test_measured_file_drives_write_and_load(tmp_path, capsys):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(PROBE))
    plan = run_json(capsys, "--measured", str(path), "--only", "write,weights")
    assert plan["write"]["single_writer_bw"] == 2.0e9
    assert plan["write"]["strategies"][0]["blocking_s"] == pytest.approx(1.12e12 / 2.0e9)
    measured = [p for p in plan["weights"]["paths"] if p["path"].startswith("measured")]
    assert measured and measured[0]["seconds"] == pytest.approx(70e9 / 3.5e9)
    assert plan["measured"]["fs_type"] == "xfs"


@pytest.mark.parametrize("doc,msg", [
    ({"res": []}, "results"),
    ({"results": []}, "no results"),
    ({"results": [{"target": "/x", "op": "write"}]}, "bytes_per_s"),
    ({"results": [{"target": "/x", "op": "write", "bytes_per_s": 0}]}, "more than zero"),
    ({"results": [{"target": "/x", "op": "write", "bytes_per_s": "fast"}]}, "wrong type"),
])
def test_measured_bad_documents(doc, msg):
    with pytest.raises(FormatError, match=msg):
        parse_measured(doc, "probe.json")


def test_measured_file_missing_or_not_json(tmp_path, capsys):
    assert main(["plan", "--measured", str(tmp_path / "none.json")]) == 1
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plan", "--measured", str(bad)]) == 1
    assert "is not JSON" in capsys.readouterr().err


# ---- bad input: a clear message, never a traceback ---------------------------------------------

@pytest.mark.parametrize("argv,msg", [
    (["--preset", "13b"], "unknown preset"),
    (["--gpus", "1001"], "whole number of nodes"),
    (["--gpus", "1024", "--tp", "3"], "not divisible"),
    (["--gpus=-8"], "negative"),
    (["--gpus", "0"], "more than zero"),
    (["--step-time", "0"], "more than zero"),
    (["--params=-70B"], "negative"),
    (["--async-window", "soon"], "cannot read"),
    (["--ost-bw", "0GB/s"], "more than zero"),
    (["--only", "disks"], "unknown section"),
    (["--optimizer", "lion"], "unknown optimizer"),
    (["--kv-dtype", "fp7"], "unknown dtype"),
    (["--hbm-per-gpu", "40GB", "--serve-gpus", "2"], "no HBM left"),
    (["--fetch-fraction", "1.5"], "between 0 and 1"),
    (["--load-bw", "nfs"], "PATH=RATE"),
])
def test_bad_input_messages(capsys, argv, msg):
    assert main(["plan", *argv]) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_quantity_parsers():
    assert parse_count("70B") == 70e9 and parse_count("4M") == 4e6 and parse_count("1.5k") == 1500
    assert parse_bytes("75GB") == 75e9 and parse_bytes("1.25GiB") == 1.25 * 2**30
    assert parse_rate("2GB/s") == 2e9 and parse_rate("800 MB/s") == 800e6
    assert parse_duration("200us") == pytest.approx(200e-6) and parse_duration("2h") == 7200
    for fn, bad in ((parse_count, "-1"), (parse_bytes, "-5GB"), (parse_rate, "0GB/s"), (parse_duration, "0s")):
        with pytest.raises(ConfigError):
            fn(bad)


def test_pure_functions_reject_nonsense():
    with pytest.raises(ConfigError):
        checkpoint_size(0, Parallelism(8))
    with pytest.raises(ConfigError):
        Parallelism(8, zero_stage=4)
    with pytest.raises(ConfigError):
        data_read_bw(4e6, 2, 0)
    with pytest.raises(ConfigError):
        weight_load_times(-1)
    with pytest.raises(ConfigError):
        fetch_rule(0.1, 0, 15e-3)
    with pytest.raises(ConfigError):
        required_write_bw(1e12, 30, margin=0.5)


def test_tables_render_every_section(capsys):
    assert main(["plan", "--preset", "405b", "--gpus", "2048", "--async-window", "45s"]) == 0
    out = capsys.readouterr().out
    for title in ("Checkpoint size", "Checkpoint write", "Lustre", "Training data", "Weight load", "KV cache",
                  "Storage cost"):
        assert title in out
    assert "token IDs need 4 bytes" in out                                  # 405B's 128K vocabulary
    plan = build_plan(PlanInputs(model=preset("405b"), gpus=2048))
    assert plan["kv"]["serve_gpus"] == 8                                     # 405 GB FP8 needs 8 × 80 GB
    assert math.isfinite(plan["cost"]["total"])


def test_commit_metadata_load_grows_with_ranks_not_tensors(capsys):
    from tierio.plan.checkpoint import commit_load

    small, big = commit_load(64, 10, 1e9), commit_load(1024, 3000, 1e9)
    assert small.mode == "inline" and small.files_created == 64 + 1 and small.requests["DELETE"] == 64
    assert big.mode == "referenced" and big.files_created == 2 * 1024 + 1 and big.manifest_bytes < 200e3
    assert big.listing_requests == big.listing_polls * 3  # 2,049 files: three pages per look
    assert commit_load(1, 3000, 1e9).requests["LIST"] == 0
    assert main(["plan", "--only", "commit", "--gpus", "128", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["commit"]["ranks"] == 128 and doc["commit"]["files_created"] > 128
