"""A whole storage plan from one set of inputs: JSON-ready figures plus tables for people.

The defaults are the worked example of a 1,024-GPU cluster training a 70B model (ZeRO-3,
4M-token batches, 25 s steps, checkpoint every 1,000 steps, 30 s async window, 2 GB/s per OST)
and the Llama-3 70B serving example (FP8 weights and KV, TP=2, 8K context).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tierio.errors import ConfigError
from tierio.plan import bandwidth, checkpoint, cost, serving
from tierio.plan.measured import Measured
from tierio.plan.operator_report import OPERATOR_SECTIONS, operator_plan, operator_tables
from tierio.plan.model import ModelShape, dtype_bytes, preset
from tierio.plan.quantities import fmt_bytes, fmt_money, fmt_num, fmt_pct, fmt_rate, fmt_seconds

SECTIONS = ("checkpoint", "write", "interval", "commit", "bandwidth", "data", "weights", "kv", "cost", *OPERATOR_SECTIONS)


@dataclass
class PlanInputs:
    """Every input of a plan, in base units (bytes, seconds, bytes/s, dollars)."""

    model: ModelShape = field(default_factory=lambda: preset("70b"))
    # training layout
    gpus: int = 1024
    tp: int = 1
    pp: int = 1
    zero_stage: int = 3
    gpus_per_node: int = 8
    optimizer: str = "adamw"
    weight_dtype: str = "bf16"
    include_grads: bool = True
    misc_bytes: float = 0.0
    # training loop
    batch_tokens: float = 4e6
    token_bytes: float = 2
    step_s: float = 25.0
    interval_steps: float = 1000
    async_window_s: float = 30.0
    margin: float = 2.0
    # bandwidths of the write paths
    single_writer_bw: float = 10e9
    storage_bw: float | None = None          # None: the planned Lustre (OSTs × per-OST bandwidth)
    node_bw: float = 25e9                    # one 200 Gb/s storage NIC per node
    snapshot_bw: float = 20e9                # device → pinned host copy per GPU
    snapshot_s: float | None = None
    # Lustre and money
    ost_bw: float = 2e9
    ost_round: int = 16
    osts_per_node: int = 1
    ost_node_cost: float = 25e3
    gpu_hour_cost: float = 3.0
    object_price: float = 0.02               # $ per GB-month
    years: float = 3.0
    archive_per_day: float | None = None     # None: one full checkpoint per day
    retention_days: float | None = None
    # serving
    serve_dtype: str = "fp8"
    load_bw: dict[str, float] = field(default_factory=dict)
    kv_dtype: str = "fp8"
    context: int = 8192
    hbm_per_gpu: float = 80e9
    serve_gpus: int | None = None            # None: smallest power of two that holds the weights
    serve_overhead: float = 15e9
    kv_budget: float | None = None
    nvme_capacity: float = 10e12
    nvme_bw: float = 110e9
    fetch_latency_s: float = 200e-6
    decode_latency_s: float = 15e-3
    fetch_fraction: float = 0.1
    fetch_budget: float = 0.05
    # DataLoader
    workers: int = 8
    prefetch: int = 4
    micro_batch: int = 32
    seq_len: int = 4096
    loader_token_bytes: float = 2
    measured: Measured | None = None
    # commit metadata load
    tensors_per_rank: int | None = None      # None: from the model's layers and the optimizer
    commit_spread_s: float = 5.0             # first to last rank's shard durable
    # failures: the job's MTBF is given, or one GPU's divided by the GPUs
    mtbf_s: float | None = None
    gpu_mtbf_s: float = 50_000 * 3600.0      # ~ one interruption per 50,000 GPU-hours at 16K-GPU scale
    restart_s: float = 0.0                   # restart and restore after a failure
    # day-one operator questions (plan.operator): the chapter's figures by default
    fs: str = "auto"
    idle_fraction: float = 0.15
    recovery_target_s: float = 600.0
    object_bw: float = 5e9                   # aggregate GET throughput of the object store
    dataset_cache: float = 2e12              # per node
    nvme_keep: int = 3                       # checkpoints kept on node-local NVMe
    kv_spill: float | None = None            # None: nvme_capacity
    nvme_per_node: float = 8 * 3.84e12       # eight 3.84 TB drives
    padding_before: float = 0.902            # (4096 − 400) / 4096: 400-token documents padded to 4,096
    padding_after: float = 0.02              # packing 98% full
    wait_share: float = 0.15
    wait_share_after: float = 0.0
    restarts_per_day: float = 100
    serve_nodes: int = 50
    restart_from: str = "nfs"
    restart_to: str = "gds"


def build_plan(inp: PlanInputs) -> dict[str, Any]:
    """Compute every section of the plan; numbers stay in base units for machines."""
    m = inp.model
    par = checkpoint.Parallelism(inp.gpus, inp.tp, inp.pp, inp.zero_stage, inp.gpus_per_node)
    notes: list[str] = []
    size = checkpoint.checkpoint_size(m.params, par, inp.optimizer, inp.weight_dtype, inp.include_grads, inp.misc_bytes)
    interval = checkpoint.interval_seconds(inp.interval_steps, inp.step_s)

    need = bandwidth.required_write_bw(size.bytes_total, inp.async_window_s, inp.margin)
    osts = bandwidth.lustre_osts(need.target, inp.ost_bw, inp.ost_round)
    tax = bandwidth.stripe_tax(size.bytes_total, inp.ost_bw, osts.specified)

    single_bw = inp.single_writer_bw
    measured: dict[str, Any] | None = None
    if inp.measured is not None:
        measured = {"source": inp.measured.source, "fs_type": inp.measured.fs_type}
        w, r = inp.measured.write, inp.measured.read
        if w is not None:
            single_bw = w.bytes_per_s
            measured["write"] = asdict(w)
            notes.append(f"single-writer bandwidth is the measured {w.op} of {w.target} ({w.mode}): {fmt_rate(w.bytes_per_s)}")
        if r is not None:
            measured["read"] = asdict(r)
    storage_bw = inp.storage_bw if inp.storage_bw is not None else osts.aggregate_bw
    writes = checkpoint.write_costs(
        size, par, single_writer_bw=single_bw, storage_bw=storage_bw, node_bw=inp.node_bw,
        snapshot_bw=inp.snapshot_bw, interval_s=interval, gpu_hour_cost=inp.gpu_hour_cost,
        snapshot_s=inp.snapshot_s, async_window_s=inp.async_window_s)

    data = bandwidth.data_read_bw(inp.batch_tokens, inp.token_bytes, inp.step_s)
    if inp.token_bytes < bandwidth.token_id_bytes(m.vocab):
        notes.append(f"{m.name} has a {m.vocab:,}-entry vocabulary: token IDs need "
                     f"{bandwidth.token_id_bytes(m.vocab)} bytes, not {inp.token_bytes:g} (--token-bytes)")
    pinned = bandwidth.pinned_memory(inp.workers, inp.prefetch, inp.micro_batch, inp.seq_len,
                                     inp.loader_token_bytes, inp.gpus_per_node)

    weight_bytes = m.params * dtype_bytes(inp.serve_dtype)
    paths = dict(serving.LOAD_PATHS)
    for name, bw in inp.load_bw.items():
        paths[name] = (bw, paths.get(name, (0, "given on the command line"))[1])
    if inp.measured is not None and inp.measured.read is not None:
        r = inp.measured.read
        paths[f"measured: {r.target}"] = (r.bytes_per_s, f"tierio probe, {r.mode} {r.op}")
    loads = serving.weight_load_times(weight_bytes, paths)

    kv_tok = serving.kv_bytes_per_token(m.layers, m.kv_heads, m.head_dim, dtype_bytes(inp.kv_dtype))
    if inp.context < 1:
        raise ConfigError(f"context length must be at least 1 token, got {inp.context!r}")
    kv_user = kv_tok * inp.context
    serve_gpus = inp.serve_gpus or serving.replica_gpus(inp.hbm_per_gpu, weight_bytes, inp.serve_overhead)
    if inp.kv_budget is not None:
        budget, budget_how = inp.kv_budget, "given"
    else:
        budget = serving.kv_budget(inp.hbm_per_gpu, serve_gpus, weight_bytes, inp.serve_overhead)
        budget_how = (f"{serve_gpus} × {fmt_bytes(inp.hbm_per_gpu)} HBM − {fmt_bytes(weight_bytes)} weights "
                      f"− {fmt_bytes(inp.serve_overhead)} overhead")
    hbm_users = serving.users_per_budget(budget, kv_user)
    nvme_users = serving.users_per_budget(inp.nvme_capacity, kv_user)
    rule = serving.fetch_rule(inp.fetch_fraction, inp.fetch_latency_s, inp.decode_latency_s, inp.fetch_budget)

    tensors = inp.tensors_per_rank if inp.tensors_per_rank is not None else \
        checkpoint.tensors_per_rank(m.layers, inp.optimizer, inp.weight_dtype)
    commit = checkpoint.commit_load(par.world_size, tensors, size.per_rank_written, spread_s=inp.commit_spread_s)

    interval_plan = _interval(inp, writes, interval)

    hw = cost.ost_hardware_cost(osts.specified, inp.ost_node_cost, inp.osts_per_node)
    daily = inp.archive_per_day if inp.archive_per_day is not None else size.bytes_total
    archive = cost.archive_cost(daily, inp.object_price, inp.years, inp.retention_days)

    plan = {
        "model": asdict(m),
        "parallelism": {**asdict(par), "dp": par.dp, "nodes": par.nodes},
        "checkpoint": {
            "components": [asdict(c) for c in size.components],
            "bytes_total": size.bytes_total,
            "bytes_per_param": size.bytes_per_param,
            "per_rank_held": size.per_rank_held,
            "per_rank_written": size.per_rank_written,
        },
        "write": {
            "interval_s": interval,
            "checkpoints_per_day": 86400 / interval,
            "single_writer_bw": single_bw,
            "storage_bw": storage_bw,
            "storage_bw_source": "given" if inp.storage_bw is not None else "planned Lustre (OSTs × per-OST bandwidth)",
            "node_bw": inp.node_bw,
            "snapshot_bw": inp.snapshot_bw,
            "strategies": [asdict(w) for w in writes],
        },
        "interval": interval_plan,
        "commit": asdict(commit),
        "bandwidth": {
            "async_window_s": inp.async_window_s,
            "required_write": asdict(need),
            "lustre": asdict(osts),
            "stripe_tax": asdict(tax),
        },
        "data": {**asdict(data), "batch_tokens": inp.batch_tokens, "token_bytes": inp.token_bytes,
                 "step_s": inp.step_s, "pinned_memory": asdict(pinned),
                 "dataloader": {"workers": inp.workers, "prefetch": inp.prefetch, "micro_batch": inp.micro_batch,
                                "seq_len": inp.seq_len, "bytes_per_token": inp.loader_token_bytes}},
        "weights": {"dtype": inp.serve_dtype, "bytes": weight_bytes, "paths": [asdict(x) for x in loads]},
        "kv": {
            "dtype": inp.kv_dtype, "context": inp.context, "serve_gpus": serve_gpus, "bytes_per_token": kv_tok, "bytes_per_user": kv_user,
            "hbm_budget": budget, "hbm_budget_how": budget_how, "hbm_users": hbm_users,
            "nvme_capacity": inp.nvme_capacity, "nvme_users": nvme_users,
            "nvme_resume_s": serving.resume_seconds(kv_user, inp.nvme_bw), "nvme_bw": inp.nvme_bw,
            "fetch_rule": asdict(rule),
        },
        "cost": {"hardware": asdict(hw), "archive": asdict(archive), "total": hw.total + archive.total,
                 "gpu_hour_cost": inp.gpu_hour_cost},
        "measured": measured,
        "notes": notes,
    }
    return plan | operator_plan(inp, plan)


def _interval(inp: PlanInputs, writes: list[checkpoint.WriteCost], planned_s: float) -> dict[str, Any]:
    """Young/Daly's interval for the async strategy (blocking = the snapshot, bounded below by the
    background write) next to the planned one; the job's MTBF is given or one GPU's / GPUs."""
    # imported here: importing tierio.ckpt loads torch, which `tierio plan --help` must not pay for
    from tierio.ckpt.saving.interval import interval_at, optimal_interval

    mtbf = inp.mtbf_s if inp.mtbf_s is not None else inp.gpu_mtbf_s / inp.gpus
    snap = next(w for w in writes if w.strategy == "async")
    best = optimal_interval(snap.blocking_s, mtbf, snap.background_s, inp.restart_s)
    planned = interval_at(planned_s, snap.blocking_s, mtbf, snap.background_s, inp.restart_s)
    return {"mtbf_s": mtbf, "mtbf_source": "given" if inp.mtbf_s is not None else "one GPU's MTBF / GPUs",
            "step_s": inp.step_s, "optimum": asdict(best), "optimum_steps": best.interval_s / inp.step_s,
            "planned": asdict(planned), "planned_queues": planned_s < snap.background_s}


def tables(plan: dict[str, Any], sections: tuple[str, ...] = SECTIONS) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) for each requested section, formatted for people."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    m, par = plan["model"], plan["parallelism"]
    ck, wr, bw = plan["checkpoint"], plan["write"], plan["bandwidth"]
    world = par["world_size"]
    if "checkpoint" in sections:
        rows = [[c["name"], f"{c['bytes_per_param']:g} B" if c["bytes_per_param"] else "—",
                 fmt_bytes(c["bytes_total"]),
                 fmt_bytes(c["bytes_total"] / world if c["zero_sharded"] else c["bytes_total"] / (par["tp"] * par["pp"])),
                 c["note"]] for c in ck["components"]]
        rows.append(["total", f"{ck['bytes_per_param']:g} B", fmt_bytes(ck["bytes_total"]),
                     fmt_bytes(ck["per_rank_written"]), f"held per rank: {fmt_bytes(ck['per_rank_held'])}"])
        out.append((f"Checkpoint size — {m['name']} ({m['params'] / 1e9:g}e9 params), {world:,} GPUs, "
                    f"ZeRO-{par['zero_stage']}, dp={par['dp']}",
                    ["component", "per param", "total", "written per rank", "note"], rows))
    if "write" in sections:
        rows = [[w["strategy"], fmt_seconds(w["blocking_s"]),
                 fmt_seconds(w["background_s"]) if w["background_s"] else "—", fmt_pct(w["overhead"]),
                 fmt_num(w["gpu_hours_per_ckpt"]), fmt_money(w["cost_per_ckpt"]), fmt_money(w["cost_per_day"]),
                 w["note"]] for w in wr["strategies"]]
        out.append((f"Checkpoint write — every {wr['interval_s']:,.0f} s of training "
                    f"({wr['checkpoints_per_day']:.2f}/day); single writer {fmt_rate(wr['single_writer_bw'])}, "
                    f"storage {fmt_rate(wr['storage_bw'])}, snapshot {fmt_rate(wr['snapshot_bw'])}/GPU",
                    ["strategy", "GPUs wait", "background", "overhead", "GPU-h/ckpt", "$/ckpt", "$/day", "note"], rows))
    if "interval" in sections:
        out.append(_interval_table(plan["interval"]))
    if "commit" in sections:
        c = plan["commit"]
        rq = c["requests"]
        rows = [
            ["tensor slices per rank", "every tensor sharded over all ranks (or --tensors-per-rank)", f"{c['tensors_per_rank']:,}"],
            ["record per rank", "a rank's manifest entry", fmt_bytes(c["record_bytes"])],
            ["manifest", f"records {c['mode']}", fmt_bytes(c["manifest_bytes"])],
            ["files created per checkpoint", "shards + records + manifest", f"{c['files_created']:,}"],
            ["committer's listings", f"{c['listing_polls']} looks × pages of 1,000 files", f"{c['listing_requests']:,}"],
            ["requests per checkpoint", "PUT / GET / HEAD / LIST / DELETE",
             f"{rq['PUT']:,} / {rq['GET']:,} / {rq['HEAD']:,} / {rq['LIST']:,} / {rq['DELETE']:,}"],
            ["requests per rank", "", f"{c['requests_per_rank']:.1f}"],
        ]
        out.append((f"Checkpoint commit — metadata load on the shared tier, {c['ranks']:,} ranks",
                    ["figure", "arithmetic", "value"], rows))
    if "bandwidth" in sections:
        need, lu, tax = bw["required_write"], bw["lustre"], bw["stripe_tax"]
        rows = [
            ["checkpoint / async window", f"{fmt_bytes(ck['bytes_total'])} / {bw['async_window_s']:g} s",
             fmt_rate(need["base"])],
            [f"with {need['margin']:g}× safety margin", "", fmt_rate(need["target"])],
            ["OSTs (minimum)", f"{fmt_rate(need['target'])} / {fmt_rate(lu['per_ost_bw'])}", str(lu["minimum"])],
            [f"OSTs (specified, multiple of {lu['round_to']})", "", f"{lu['specified']} → {fmt_rate(lu['aggregate_bw'])}"],
            ["write time, stripe count 1", f"{fmt_bytes(ck['bytes_total'])} / {fmt_rate(tax['bw_c1'])}",
             fmt_seconds(tax["seconds_c1"])],
            [f"write time, stripe count -1 ({tax['osts']} OSTs)", "", fmt_seconds(tax["seconds_full"])],
            ["bandwidth lost to stripe count 1", "", f"{fmt_rate(tax['bw_lost'])} ({tax['speedup']:g}×)"],
            ["stripe the directory", "lfs setstripe -c -1 -S 4m /lustre/checkpoints", ""],
        ]
        out.append(("Checkpoint bandwidth and Lustre", ["figure", "arithmetic", "value"], rows))
    if "data" in sections:
        d, pm, dl = plan["data"], plan["data"]["pinned_memory"], plan["data"]["dataloader"]
        rows = [
            ["data per step", f"{d['batch_tokens']:,.0f} tokens × {d['token_bytes']:g} B", fmt_bytes(d["bytes_per_step"])],
            ["read bandwidth", f"{fmt_bytes(d['bytes_per_step'])} / {d['step_s']:g} s", fmt_rate(d["bandwidth"])],
            ["pinned memory per GPU",
             f"{dl['workers']} workers × {dl['prefetch']} prefetch × {dl['micro_batch']} × {dl['seq_len']} × "
             f"{dl['bytes_per_token']:g} B", fmt_bytes(pm["per_gpu"])],
            ["pinned memory per node", f"× {par['gpus_per_node']} GPUs", fmt_bytes(pm["per_node"])],
        ]
        out.append(("Training data", ["figure", "arithmetic", "value"], rows))
    if "weights" in sections:
        w = plan["weights"]
        rows = [[p["path"], fmt_rate(p["bandwidth"]), fmt_seconds(p["seconds"]), p["note"]] for p in w["paths"]]
        out.append((f"Weight load — {fmt_bytes(w['bytes'])} ({w['dtype']})", ["path", "bandwidth", "load time", "note"], rows))
    if "kv" in sections:
        kv, fr = plan["kv"], plan["kv"]["fetch_rule"]
        rows = [
            ["KV bytes per token", f"2 × {m['layers']} layers × {m['kv_heads']} KV heads × {m['head_dim']} × "
             f"{kv['bytes_per_token'] / (2 * m['layers'] * m['kv_heads'] * m['head_dim']):g} B",
             f"{kv['bytes_per_token']:,.0f} B"],
            ["KV bytes per user", f"{kv['context']:,} tokens", f"{fmt_bytes(kv['bytes_per_user'])} "
             f"({kv['bytes_per_user'] / 2**30:.3g} GiB)"],
            ["HBM KV budget", kv["hbm_budget_how"], fmt_bytes(kv["hbm_budget"])],
            ["users in HBM", "floor(budget / per user)", f"{kv['hbm_users']:,}"],
            ["extra users on NVMe", f"{fmt_bytes(kv['nvme_capacity'])} / per user", f"{kv['nvme_users']:,}"],
            ["resume one user from NVMe", f"per user / {fmt_rate(kv['nvme_bw'])}", fmt_seconds(kv["nvme_resume_s"])],
            ["fetch penalty per token", f"{fr['fetch_fraction']:g} × {fmt_seconds(fr['fetch_latency_s'])}",
             fmt_seconds(fr["penalty_s"])],
            ["fetch overhead", f"penalty / {fmt_seconds(fr['decode_latency_s'])} decode",
             f"{fmt_pct(fr['overhead'])} ({'viable' if fr['viable'] else 'NOT viable'} at ≤ {fmt_pct(fr['budget'])})"],
            ["largest viable fetch fraction", f"{fmt_pct(fr['budget'])} × decode / fetch latency",
             fmt_pct(fr["max_fraction"])],
        ]
        out.append((f"KV cache — {kv['dtype']} KV, {kv['context']:,}-token context", ["figure", "arithmetic", "value"], rows))
    if "cost" in sections:
        c = plan["cost"]
        hw, ar = c["hardware"], c["archive"]
        keep = "kept forever" if ar["retention_days"] is None else f"kept {ar['retention_days']:g} days"
        rows = [
            ["parallel-FS hardware", f"{hw['nodes']} nodes ({hw['osts']} OSTs) × {fmt_money(hw['node_cost'])}",
             fmt_money(hw["total"])],
            ["object-store archive", f"{fmt_bytes(ar['daily_bytes'])}/day, {keep}, "
             f"${ar['price_per_gb_month']:g}/GB-month, {ar['years']:g} years", fmt_money(ar["total"])],
            ["archive at the end", fmt_bytes(ar["final_stored_bytes"]), f"{fmt_money(ar['final_monthly'])}/month"],
            [f"total over {ar['years']:g} years", "", fmt_money(c["total"])],
        ]
        out.append(("Storage cost", ["item", "arithmetic", "cost"], rows))
    return out + operator_tables(plan, sections)


def _interval_table(iv: dict[str, Any]) -> tuple[str, list[str], list[list[str]]]:
    best, planned = iv["optimum"], iv["planned"]
    c, m, r = best["cost_s"], iv["mtbf_s"], best["restart_s"]
    rows = [
        ["blocking cost per save (C)", "async snapshot", fmt_seconds(c)],
        ["background write (W)", "lower bound on the interval", fmt_seconds(best["write_s"])],
        ["mean time between failures (M)", iv["mtbf_source"], fmt_seconds(m)],
        ["Young/Daly optimum", f"√(2 × {c:.3g} s × {m:,.0f} s)", fmt_seconds(best["young_daly_s"])],
        ["interval", f"max(optimum, W): {best['bound']}",
         f"{fmt_seconds(best['interval_s'])} = {iv['optimum_steps']:,.1f} steps of {iv['step_s']:g} s"],
        ["work lost per failure", "(interval + C) / 2" + (" + restart" if r else ""),
         fmt_seconds(best["lost_per_failure_s"])],
        ["time lost (saves + failures)", "C / interval + lost / M", fmt_pct(best["waste"])],
        ["planned interval", "", fmt_seconds(planned["interval_s"])
         + (" (shorter than the write: saves queue)" if iv["planned_queues"] else "")],
        ["work lost per failure, planned", "", fmt_seconds(planned["lost_per_failure_s"])],
        ["time lost, planned", "", fmt_pct(planned["waste"])],
    ]
    return ("Checkpoint interval — least work lost (Young/Daly)", ["figure", "arithmetic", "value"], rows)
