"""`tierio plan`: size checkpoint, data, weight-load and KV-cache storage before buying it."""

from __future__ import annotations

import argparse
from dataclasses import replace

from typing import TYPE_CHECKING

from tierio.cli.parsers import LazyHelp
from tierio.errors import ConfigError
from tierio.plan.model import PRESETS, preset
from tierio.plan.quantities import (
    parse_bytes, parse_count, parse_duration, parse_fraction, parse_money, parse_rate,
)

if TYPE_CHECKING:
    from tierio.plan.report import PlanInputs

# the report and the serving model load numpy and the KV rule: imported when a plan is made


def _sections_list() -> str:
    from tierio.plan.report import SECTIONS

    return ", ".join(SECTIONS)


def _load_paths() -> str:
    from tierio.plan.serving import LOAD_PATHS

    return ", ".join(LOAD_PATHS)

EXAMPLES = """\
examples:
  tierio plan                                   the worked example: 1,024 GPUs, 70B, ZeRO-3, 30 s async window
  tierio plan --preset 405b --gpus 2048 --async-window 45s
  tierio plan --gpus 128 --interval-steps 100 --storage-bw 100GB/s --snapshot-time 4s --misc 1GB --only checkpoint,write
  tierio plan --preset llama3-70b --only kv,weights --context 32768 --kv-budget 75GB
  tierio probe /mnt/nvme --json > probe.json && tierio plan --measured probe.json --only write,weights
  tierio plan --json | jq .bandwidth.lustre
  tierio plan --gpus 24 --fs auto --only fs          the chapter's filesystem rule, with the reason
  tierio plan --idle-fraction 12% --only idle,roi    what idle GPUs cost, and what the fixes return
  tierio plan --preset 405b --gpus 2048 --recovery-target 5min --only recovery,nvme

Every figure, its formula and its units: docs/sizing.md.
Sizes and rates are decimal (GB = 1e9 B) unless written with GiB; counts take K, M, B, T (70B = 70e9).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="size storage: checkpoints, bandwidth, Lustre OSTs, weight loads, KV cache, cost",
        description="Size the storage of a training or serving cluster from the model and the job. "
                    "Defaults reproduce the worked 1,024-GPU / 70B example; change what differs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    g = p.add_argument_group("model")
    g.add_argument("--preset", default="70b", help=f"model shape: {', '.join(PRESETS)} (default 70b)")
    g.add_argument("--params", help="parameter count, overrides the preset (e.g. 13B)")
    g.add_argument("--layers", help="transformer layers (KV cache)")
    g.add_argument("--kv-heads", help="KV heads per layer (KV cache)")
    g.add_argument("--head-dim", help="head dimension (KV cache)")
    g.add_argument("--vocab", help="vocabulary size (decides 2- or 4-byte token IDs)")
    g = p.add_argument_group("training job")
    g.add_argument("--gpus", default="1024", help="world size (default 1024)")
    g.add_argument("--tp", default="1", help="tensor-parallel degree (default 1)")
    g.add_argument("--pp", default="1", help="pipeline-parallel degree (default 1)")
    g.add_argument("--zero", default="3", choices=["0", "1", "2", "3"], help="ZeRO stage (default 3)")
    g.add_argument("--gpus-per-node", default="8", help="GPUs per node (default 8)")
    g.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd or none (default adamw)")
    g.add_argument("--weight-dtype", default="bf16", help="training weight dtype (default bf16)")
    g.add_argument("--no-grads", action="store_true", help="leave gradients out of the checkpoint")
    g.add_argument("--misc", default="0", help="RNG/step/LR state added once (default 0)")
    g.add_argument("--batch-tokens", default="4M", help="tokens per global batch (default 4M)")
    g.add_argument("--token-bytes", default="2", help="bytes per stored token ID (default 2)")
    g.add_argument("--step-time", default="25s", help="seconds per training step (default 25s)")
    g.add_argument("--interval-steps", default="1000", help="steps between checkpoints (default 1000)")
    g.add_argument("--async-window", default="30s", help="time a background write may take (default 30s)")
    g.add_argument("--margin", default="2", help="safety margin on required bandwidth (default 2)")
    g.add_argument("--tensors-per-rank", help="tensor slices each rank saves (default: from the model's layers)")
    g.add_argument("--commit-spread", default="5s", help="time from the first to the last rank's shard durable (default 5s)")
    g.add_argument("--mtbf", help="the job's mean time between failures (default: --gpu-mtbf / --gpus)")
    g.add_argument("--gpu-mtbf", default="50000h", help="one GPU's mean time between job interruptions (default 50000h)")
    g.add_argument("--restart-time", default="0s", help="restart and restore after a failure, added to the work lost (default 0s)")
    g = p.add_argument_group("write paths")
    g.add_argument("--single-writer-bw", default="10GB/s", help="one writer's bandwidth (default 10GB/s)")
    g.add_argument("--storage-bw", help="aggregate write bandwidth of the shared tier (default: the planned OSTs)")
    g.add_argument("--node-bw", default="25GB/s", help="one node's storage link (default 25GB/s)")
    g.add_argument("--snapshot-bw", default="20GB/s", help="GPU→pinned host copy per GPU (default 20GB/s)")
    g.add_argument("--snapshot-time", help="blocking snapshot time, overrides --snapshot-bw (e.g. 4s)")
    g.add_argument("--measured", metavar="FILE", help="use bandwidths from `tierio probe --json` output")
    g = p.add_argument_group("Lustre and cost")
    g.add_argument("--ost-bw", default="2GB/s", help="sustained write bandwidth per OST (default 2GB/s)")
    g.add_argument("--ost-round", default="16", help="round OSTs up to a multiple of this (default 16; 1 = none)")
    g.add_argument("--osts-per-node", default="1", help="OSTs per storage node (default 1)")
    g.add_argument("--ost-node-cost", default="25K", help="price of a storage node in $ (default 25K)")
    g.add_argument("--gpu-hour-cost", default="3", help="$ per GPU-hour (default 3)")
    g.add_argument("--object-price", default="0.02", help="object storage $ per GB-month (default 0.02)")
    g.add_argument("--years", default="3", help="years to cost (default 3)")
    g.add_argument("--archive-per-day", help="bytes archived per day (default: one full checkpoint)")
    g.add_argument("--retention-days", help="days the archive keeps a checkpoint (default: forever)")
    g = p.add_argument_group("serving")
    g.add_argument("--serve-dtype", default="fp8", help="weight dtype when serving (default fp8)")
    g.add_argument("--load-bw", action="append", default=[], metavar="PATH=RATE",
                   help=LazyHelp(lambda: f"override or add a load path bandwidth; paths: {_load_paths()}"))
    g.add_argument("--kv-dtype", default="fp8", help="KV-cache dtype (default fp8)")
    g.add_argument("--context", default="8192", help="context length in tokens (default 8192)")
    g.add_argument("--hbm-per-gpu", default="80GB", help="HBM per GPU (default 80GB)")
    g.add_argument("--serve-gpus", help="GPUs per serving replica, e.g. TP (default: smallest power of two that fits)")
    g.add_argument("--serve-overhead", default="15GB", help="activations + runtime per replica (default 15GB)")
    g.add_argument("--kv-budget", help="HBM for KV cache per replica, overrides the derivation (e.g. 75GB)")
    g.add_argument("--nvme-capacity", default="10TB", help="NVMe given to KV overflow (default 10TB)")
    g.add_argument("--nvme-bw", default="110GB/s", help="NVMe read bandwidth (default 110GB/s)")
    g.add_argument("--fetch-latency", default="200us", help="latency of one NVMe KV fetch (default 200us)")
    g.add_argument("--decode-latency", default="15ms", help="decode time per token (default 15ms)")
    g.add_argument("--fetch-fraction", default="0.1", help="share of tokens needing a fetch (default 0.1)")
    g.add_argument("--fetch-budget", default="5%", help="tolerated decode slowdown (default 5%%)")
    g = p.add_argument_group("DataLoader")
    g.add_argument("--workers", default="8", help="DataLoader workers per GPU (default 8)")
    g.add_argument("--prefetch", default="4", help="prefetch_factor (default 4)")
    g.add_argument("--micro-batch", default="32", help="sequences per micro-batch (default 32)")
    g.add_argument("--seq-len", default="4096", help="sequence length (default 4096)")
    g.add_argument("--loader-token-bytes", default="2", help="bytes per token in a batch (default 2)")
    g = p.add_argument_group("operator questions")
    g.add_argument("--fs", default="auto", help="shared filesystem: auto (the chapter's rule by GPU count), "
                   "nfs, lustre, weka, gpfs (default auto)")
    g.add_argument("--idle-fraction", default="15%", help="measured share of GPU time idle on storage (default 15%%)")
    g.add_argument("--recovery-target", default="10min", help="longest acceptable restore (default 10min)")
    g.add_argument("--object-bw", default="5GB/s", help="aggregate GET throughput of the object store (default 5GB/s)")
    g.add_argument("--dataset-cache", default="2TB", help="dataset cache per node on NVMe (default 2TB)")
    g.add_argument("--nvme-keep", default="3", help="checkpoints kept on node-local NVMe (default 3)")
    g.add_argument("--kv-spill", help="NVMe per node for KV spill (default: --nvme-capacity)")
    g.add_argument("--nvme-per-node", default="30.72TB", help="NVMe a node has (default 30.72TB: 8 × 3.84 TB)")
    g.add_argument("--padding-before", default="90.2%", help="padding share of tokens unpacked (default 90.2%%)")
    g.add_argument("--padding-after", default="2%", help="padding share once packed (default 2%%)")
    g.add_argument("--wait-share", default="15%", help="data-wait share of step time measured (default 15%%)")
    g.add_argument("--wait-share-after", default="0%", help="data-wait share after the DataLoader fix (default 0%%)")
    g.add_argument("--restarts-per-day", default="100", help="serving restarts per node per day (default 100)")
    g.add_argument("--serve-nodes", default="50", help="serving nodes (default 50)")
    g.add_argument("--restart-from", default="nfs", help="load path restarts use now (default nfs)")
    g.add_argument("--restart-to", default="gds", help="load path after the fix (default gds)")
    a("--only", help=LazyHelp(lambda: f"comma-separated sections: {_sections_list()} (default all)"))
    a("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=run)


def _int(text: str, what: str, minimum: int = 1) -> int:
    value = parse_count(text, what, allow_zero=minimum == 0)
    if value != int(value) or value < minimum:
        raise ConfigError(f"{what} must be a whole number of at least {minimum}, got {text!r}")
    return int(value)


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Turn command-line strings into PlanInputs; every bad value raises ConfigError naming the flag."""
    from tierio.plan.measured import load_measured
    from tierio.plan.report import PlanInputs
    model = preset(args.preset)
    overrides = {}
    if args.params:
        overrides["params"] = parse_count(args.params, "--params")
    for flag in ("layers", "kv_heads", "head_dim", "vocab"):
        if getattr(args, flag):
            overrides[flag] = _int(getattr(args, flag), "--" + flag.replace("_", "-"))
    if overrides:
        model = replace(model, **overrides)
    load_bw = {}
    for item in args.load_bw:
        name, sep, rate = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--load-bw {item!r}: write PATH=RATE, e.g. nfs=10GB/s")
        load_bw[name.strip()] = parse_rate(rate, f"--load-bw {name}")
    opt = lambda v, fn, what: None if v is None else fn(v, what)  # noqa: E731
    return PlanInputs(
        model=model, gpus=_int(args.gpus, "--gpus"), tp=_int(args.tp, "--tp"), pp=_int(args.pp, "--pp"),
        zero_stage=int(args.zero), gpus_per_node=_int(args.gpus_per_node, "--gpus-per-node"),
        optimizer=args.optimizer, weight_dtype=args.weight_dtype, include_grads=not args.no_grads,
        misc_bytes=parse_bytes(args.misc, "--misc", allow_zero=True),
        batch_tokens=parse_count(args.batch_tokens, "--batch-tokens"),
        token_bytes=parse_count(args.token_bytes, "--token-bytes"),
        step_s=parse_duration(args.step_time, "--step-time"),
        interval_steps=parse_count(args.interval_steps, "--interval-steps"),
        async_window_s=parse_duration(args.async_window, "--async-window"),
        margin=parse_count(args.margin, "--margin"),
        single_writer_bw=parse_rate(args.single_writer_bw, "--single-writer-bw"),
        storage_bw=opt(args.storage_bw, parse_rate, "--storage-bw"),
        node_bw=parse_rate(args.node_bw, "--node-bw"),
        snapshot_bw=parse_rate(args.snapshot_bw, "--snapshot-bw"),
        snapshot_s=opt(args.snapshot_time, parse_duration, "--snapshot-time"),
        ost_bw=parse_rate(args.ost_bw, "--ost-bw"), ost_round=_int(args.ost_round, "--ost-round"),
        osts_per_node=_int(args.osts_per_node, "--osts-per-node"),
        ost_node_cost=parse_money(args.ost_node_cost, "--ost-node-cost"),
        gpu_hour_cost=parse_money(args.gpu_hour_cost, "--gpu-hour-cost"),
        object_price=parse_money(args.object_price, "--object-price"),
        years=parse_count(args.years, "--years"),
        archive_per_day=opt(args.archive_per_day, parse_bytes, "--archive-per-day"),
        retention_days=opt(args.retention_days, parse_count, "--retention-days"),
        serve_dtype=args.serve_dtype, load_bw=load_bw, kv_dtype=args.kv_dtype,
        context=_int(args.context, "--context"), hbm_per_gpu=parse_bytes(args.hbm_per_gpu, "--hbm-per-gpu"),
        serve_gpus=opt(args.serve_gpus, _int, "--serve-gpus"),
        serve_overhead=parse_bytes(args.serve_overhead, "--serve-overhead", allow_zero=True),
        kv_budget=opt(args.kv_budget, parse_bytes, "--kv-budget"),
        nvme_capacity=parse_bytes(args.nvme_capacity, "--nvme-capacity"),
        nvme_bw=parse_rate(args.nvme_bw, "--nvme-bw"),
        fetch_latency_s=parse_duration(args.fetch_latency, "--fetch-latency"),
        decode_latency_s=parse_duration(args.decode_latency, "--decode-latency"),
        fetch_fraction=parse_fraction(args.fetch_fraction, "--fetch-fraction"),
        fetch_budget=parse_fraction(args.fetch_budget, "--fetch-budget"),
        workers=_int(args.workers, "--workers"), prefetch=_int(args.prefetch, "--prefetch"),
        micro_batch=_int(args.micro_batch, "--micro-batch"), seq_len=_int(args.seq_len, "--seq-len"),
        loader_token_bytes=parse_count(args.loader_token_bytes, "--loader-token-bytes"),
        measured=load_measured(args.measured) if args.measured else None,
        tensors_per_rank=opt(args.tensors_per_rank, _int, "--tensors-per-rank"),
        commit_spread_s=parse_duration(args.commit_spread, "--commit-spread"),
        mtbf_s=opt(args.mtbf, parse_duration, "--mtbf"),
        gpu_mtbf_s=parse_duration(args.gpu_mtbf, "--gpu-mtbf"),
        restart_s=parse_duration(args.restart_time, "--restart-time", allow_zero=True),
        **_operator_inputs(args, opt),
    )


def _operator_inputs(args: argparse.Namespace, opt) -> dict:
    """The operator questions' flags (plan.operator) as PlanInputs fields."""
    frac = lambda flag: parse_fraction(getattr(args, flag.strip("-").replace("-", "_")), flag)  # noqa: E731
    return dict(
        fs=args.fs, idle_fraction=frac("--idle-fraction"),
        recovery_target_s=parse_duration(args.recovery_target, "--recovery-target"),
        object_bw=parse_rate(args.object_bw, "--object-bw"),
        dataset_cache=parse_bytes(args.dataset_cache, "--dataset-cache", allow_zero=True),
        nvme_keep=_int(args.nvme_keep, "--nvme-keep"), kv_spill=opt(args.kv_spill, parse_bytes, "--kv-spill"),
        nvme_per_node=parse_bytes(args.nvme_per_node, "--nvme-per-node"),
        padding_before=frac("--padding-before"), padding_after=frac("--padding-after"),
        wait_share=frac("--wait-share"), wait_share_after=frac("--wait-share-after"),
        restarts_per_day=parse_count(args.restarts_per_day, "--restarts-per-day", allow_zero=True),
        serve_nodes=_int(args.serve_nodes, "--serve-nodes"), restart_from=args.restart_from,
        restart_to=args.restart_to,
    )


def _sections(text: str | None) -> tuple[str, ...]:
    from tierio.plan.report import SECTIONS

    if not text:
        return SECTIONS
    chosen = tuple(s.strip().lower() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise ConfigError(f"--only {text!r}: unknown section {', '.join(unknown) or '(none)'}; "
                          f"use some of {', '.join(SECTIONS)}")
    return chosen


def run(args: argparse.Namespace) -> int:
    from tierio.cli.output import print_json, print_table, say
    from tierio.plan.report import build_plan, tables

    sections = _sections(args.only)
    plan = build_plan(inputs_from_args(args))
    if args.json:
        keep = {"model", "parallelism", "measured", "notes", *sections}
        print_json({k: v for k, v in plan.items() if k in keep})
        return 0
    for title, columns, rows in tables(plan, sections):
        print_table(title, columns, rows)
    for note in plan["notes"]:
        say(f"note: {note}")
    return 0
