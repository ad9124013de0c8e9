"""`tierio bench <target>`: benchmarks that print ratios against peers and the hardware limit."""

from __future__ import annotations

import argparse
import importlib
import math

from tierio.cli.output import print_json, print_table

TARGETS = {
    "io": "the I/O engine vs fio (disk) and the aws CLI (S3)",
    "ckpt": "checkpoint save/restore vs fio, torch.save and torch.distributed.checkpoint",
    "weights": "weight loading vs fio, safetensors, torch.load and download-then-load",
    "data": "sequence packing, loader and streaming throughput",
    "parquet": "building a dataset from Parquet vs reading the column with pyarrow",
    "kv": "the KV cache vs memcpy, fio and recomputing the prefill",
    "crash": "every crash point of a save, promotion, cache fill and dataset build, each killed and checked",
}

EPILOG = """\
examples:
  tierio bench io --json                  disk and S3 ratios as one JSON object
  tierio bench io --size 8GiB --dir /mnt/nvme
  tierio bench ckpt --size 512MiB         a quick, smaller checkpoint run
  tierio bench kv --no-model              the KV cache's tiers only (no transformers model)
Each run compares against its peers in the same run and prints ratios (> 1 means tierio is faster,
except rss_overhead where lower is better). Nothing is installed by the benchmark: missing peers
(fio, awscli) are reported with the command to install them.
"""


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark tierio against its peers and the hardware limit",
        description="Benchmarks that compare tierio with its peers and with fio in one run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    for name, help_text in TARGETS.items():
        try:
            module = importlib.import_module(f"tierio.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tierio.bench.{name}":
                continue
            raise
        t = targets.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(t)
        t.add_argument("--json", action="store_true", help="print one JSON object (ratios and raw figures)")
        t.set_defaults(handler=lambda args, m=module: _run(m, args))


def _run(module, args) -> int:
    result = module.run(args)
    if args.json:
        print_json(result)
        return 0
    targets = getattr(module, "TARGETS", {})
    rows = []
    for name, value in result.get("ratios", {}).items():
        goal = targets.get(name)
        if goal is None or not isinstance(value, (int, float)) or math.isnan(value):
            verdict = ""
        else:
            ok = value >= goal[1] if goal[0] == ">=" else value <= goal[1]
            verdict = "met" if ok else "NOT met"
        rows.append((name, f"{value:.3f}" if isinstance(value, float) else str(value), f"{goal[0]} {goal[1]}" if goal else "", verdict))
    print_table(f"tierio bench {args.target}", ["ratio", "value", "target", ""], rows)
    return 0
