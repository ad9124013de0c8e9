"""The operator sections of a plan (fs, idle, recovery, nvme, roi): figures from ``plan.operator``
over the inputs and the checkpoint/weights figures already planned, and their tables."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tierio.errors import ConfigError
from tierio.plan import operator
from tierio.plan.quantities import fmt_bytes, fmt_money, fmt_num, fmt_pct, fmt_rate, fmt_seconds

OPERATOR_SECTIONS = ("fs", "idle", "recovery", "nvme", "roi")


def operator_plan(inp: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """``inp``: the PlanInputs; ``plan``: the sections already built (checkpoint, write, weights, ...)."""
    par, ck = plan["parallelism"], plan["checkpoint"]
    node_part = ck["per_rank_written"] * par["gpus_per_node"]
    shared_bw = min(plan["write"]["storage_bw"], par["nodes"] * inp.node_bw)
    tiers = [("local NVMe", node_part, inp.nvme_bw, "each node reads its own part, all nodes at once"),
             ("shared filesystem", ck["bytes_total"], shared_bw,
              f"min(storage {fmt_rate(plan['write']['storage_bw'])}, {par['nodes']} nodes × {fmt_rate(inp.node_bw)})"),
             ("object store", ck["bytes_total"], inp.object_bw, "aggregate GET throughput (--object-bw)")]
    loads = {p["path"]: p["seconds"] for p in plan["weights"]["paths"]}
    for name in (inp.restart_from, inp.restart_to):
        if name not in loads:
            raise ConfigError(f"--restart-from/--restart-to {name!r} is not a load path: use one of {', '.join(loads)}")
    gpus, price = par["world_size"], inp.gpu_hour_cost
    return {
        "fs": asdict(operator.choose_filesystem(gpus, inp.fs)) | {"requested": inp.fs,
                                                                  "osts_for_bandwidth": plan["bandwidth"]["lustre"]["specified"]},
        "idle": asdict(operator.gpu_time_cost(gpus, inp.idle_fraction, price)),
        "recovery": {"target_s": inp.recovery_target_s,
                     "tiers": [asdict(operator.recovery_time(n, b, bw, inp.restart_s, inp.recovery_target_s, note))
                               for n, b, bw, note in tiers]},
        "nvme": asdict(operator.nvme_capacity(inp.dataset_cache, node_part, inp.nvme_keep,
                                              inp.kv_spill if inp.kv_spill is not None else inp.nvme_capacity,
                                              inp.nvme_per_node)),
        "roi": {
            "packing": {"padding_before": inp.padding_before, "padding_after": inp.padding_after,
                        **asdict(operator.gpu_time_cost(gpus, operator.freed_share(
                            1 - inp.padding_before, 1 - inp.padding_after), price))},
            "dataloader": {"wait_before": inp.wait_share, "wait_after": inp.wait_share_after,
                           **asdict(operator.gpu_time_cost(gpus, operator.freed_share(
                               1 - inp.wait_share, 1 - inp.wait_share_after), price))},
            "restarts": {"from": inp.restart_from, "to": inp.restart_to, **asdict(operator.restart_savings(
                inp.restarts_per_day, inp.serve_nodes, par["gpus_per_node"], loads[inp.restart_from],
                loads[inp.restart_to], price))},
        },
    }


def operator_tables(plan: dict[str, Any], sections: tuple[str, ...]) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    cols = ["figure", "arithmetic", "value"]
    if "fs" in sections:
        fs = plan["fs"]
        rows = [["by GPU count", fs["reason"], fs["by_scale"]],
                ["OSTs for checkpoint bandwidth", "see the bandwidth section", str(fs["osts_for_bandwidth"])],
                ["filesystem of this plan", f"--fs {fs['requested']}",
                 fs["fs"] + ("" if fs["fits"] else " (below what this scale needs)")]]
        out.append(("Filesystem choice", cols, rows))
    if "idle" in sections:
        i = plan["idle"]
        rows = [["GPU-hours idle per day", f"{i['gpus']:,} GPUs × {fmt_pct(i['share'])} × 24 h", fmt_num(i["gpu_hours_per_day"])],
                ["$ lost per hour", f"{i['gpus']:,} × {fmt_pct(i['share'])} × {fmt_money(i['gpu_hour_cost'])}",
                 fmt_money(i["per_hour"])],
                ["$ lost per day", "× 24", fmt_money(i["per_day"])], ["$ lost per year", "× 365", fmt_money(i["per_year"])]]
        out.append((f"GPUs idle on storage — {fmt_pct(i['share'])} of the time (--idle-fraction)", cols, rows))
    if "recovery" in sections:
        r = plan["recovery"]
        rows = [[t["tier"], f"{fmt_bytes(t['bytes'])} / {fmt_rate(t['bandwidth'])}"
                 + (f" + {fmt_seconds(t['restart_s'])} restart" if t["restart_s"] else "") + f" ({t['note']})",
                 f"{fmt_seconds(t['seconds'])} {'✓' if t['meets_target'] else '✗ over the target'}"] for t in r["tiers"]]
        out.append((f"Recovery time against the {fmt_seconds(r['target_s'])} target (--recovery-target)", cols, rows))
    if "nvme" in sections:
        n = plan["nvme"]
        rows = [["dataset cache", "--dataset-cache", fmt_bytes(n["dataset_cache"])],
                ["checkpoint staging", f"{fmt_bytes(n['checkpoint_per_node'])} per node × {n['kept_steps']} steps kept",
                 fmt_bytes(n["checkpoint_staging"])],
                ["KV spill", "--kv-spill (default --nvme-capacity)", fmt_bytes(n["kv_spill"])],
                ["needed per node", "sum", fmt_bytes(n["total"])],
                ["NVMe per node", "--nvme-per-node", f"{fmt_bytes(n['per_node'])} {'✓ fits' if n['fits'] else '✗ too small'}"]]
        out.append(("Node-local NVMe capacity", cols, rows))
    if "roi" in sections:
        out.append(_roi_table(plan["roi"]))
    return out


def _roi_table(roi: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    p, d, r = roi["packing"], roi["dataloader"], roi["restarts"]
    rows = [
        ["sequence packing", f"1 − (1 − {fmt_pct(p['padding_before'])}) / (1 − {fmt_pct(p['padding_after'])}) = "
         f"{fmt_pct(p['share'])} of GPU time × {p['gpus']:,} GPUs × 24 h × {fmt_money(p['gpu_hour_cost'])}",
         f"{fmt_money(p['per_day'])}/day"],
        ["DataLoader fix", f"1 − (1 − {fmt_pct(d['wait_before'])}) / (1 − {fmt_pct(d['wait_after'])}) = "
         f"{fmt_pct(d['share'])} of GPU time × {d['gpus']:,} GPUs × 24 h × {fmt_money(d['gpu_hour_cost'])}",
         f"{fmt_money(d['per_day'])}/day"],
        ["serving restarts", f"{fmt_num(r['restarts_per_day'])}/day × {r['nodes']} nodes × "
         f"({fmt_seconds(r['slow_s'])} {r['from']} − {fmt_seconds(r['fast_s'])} {r['to']}) = "
         f"{fmt_num(r['node_hours_per_day'])} node-h × {r['gpus_per_node']} GPUs = {fmt_num(r['gpu_hours_per_day'])} GPU-h",
         f"{fmt_money(r['per_day'])}/day"],
    ]
    return ("Return on fixes", ["fix", "arithmetic", "value"], rows)
