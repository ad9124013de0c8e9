"""`tierio bench <target>`: benchmarks that print ratios against peers and the hardware limit."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tierio.cli.output import print_json, print_table
from tierio.cli.parsers import own_examples

TARGETS = {
    "io": "the I/O engine vs fio (disk) and the aws CLI (S3)",
    "ckpt": "checkpoint save/restore vs fio, torch.save and torch.distributed.checkpoint",
    "weights": "weight loading vs fio, safetensors, torch.load and download-then-load",
    "data": "sequence packing, loader and streaming throughput",
    "parquet": "building a dataset from Parquet vs reading the column with pyarrow",
    "kv": "the KV cache vs memcpy, fio and recomputing the prefill",
    "crash": "every crash point of a save, promotion, cache fill and dataset build, each killed and checked",
    "integrations": "checkpoints inside training: framework save stalls, the GIL tax, preemption to durable",
}

EPILOG = """\
examples:
  tierio bench io --json                  disk and S3 ratios as one JSON object
  tierio bench io --size 8GiB --dir /mnt/nvme
  tierio bench ckpt --size 512MiB         a quick, smaller checkpoint run
  tierio bench kv --no-model              the KV cache's tiers only (no transformers model)
  tierio bench weights --size 256MiB --no-s3   a quick weight-load run on the local disk only
  tierio bench data --no-s3               packing and loader figures without SeaweedFS
  tierio bench parquet --tokens 5000000   a smaller Parquet corpus
  tierio bench crash --limit 20           a sample of 20 crash points per scenario
  tierio bench integrations --no-frameworks   the GIL tax and preemption only
Each run compares against its peers in the same run and prints ratios (> 1 means tierio is faster,
except rss_overhead where lower is better). Nothing is installed by the benchmark: missing peers
(fio, awscli) are reported with the command to install them.
"""


def _lazy(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """A parser class whose arguments are added only when its command is on the line.

    A target's description is read from its module's source, which costs a parse: done when
    argparse hands the rest of the line to that target's parser, and never otherwise."""

    class LazyTarget(base):  # type: ignore[misc, valid-type]
        load: Callable[[argparse.ArgumentParser], None] | None = None

        def ensure_loaded(self) -> None:
            if self.load is not None:
                load, self.load = self.load, None
                load(self)

        def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
            self.ensure_loaded()
            return super().parse_known_args(args, namespace)

    return LazyTarget


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Descriptor 1 points at stderr for the block, for this process and the ones it starts, so
    that stdout carries the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _load_target(name: str, t: argparse.ArgumentParser) -> None:
    """A target's options (tierio.bench.options) and its module's docstring, read without importing
    the module: the benchmarks import torch at module level, and `bench ckpt --help` must not."""
    from tierio.bench.options import ARGUMENTS

    spec = importlib.util.find_spec(f"tierio.bench.{name}")
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text()), clean=False) if spec and spec.origin else None
    t.description = (doc or TARGETS[name]).strip()
    ARGUMENTS[name](t)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark tierio against its peers and the hardware limit",
        description="Benchmarks that compare tierio with its peers and with fio in one run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True, parser_class=_lazy(type(p)))
    for name, help_text in TARGETS.items():
        if importlib.util.find_spec(f"tierio.bench.{name}") is None:
            continue  # target not built yet
        t = targets.add_parser(name, help=help_text, description=help_text, epilog=own_examples(EPILOG, f"tierio bench {name}"),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        t.load = lambda t, name=name: _load_target(name, t)
        t.add_argument("--json", action="store_true", help="print one JSON object (ratios and raw figures)")
        t.set_defaults(handler=lambda args, name=name: _run(importlib.import_module(f"tierio.bench.{name}"), args))


def _run(module, args) -> int:
    if args.json:
        with _stdout_to_stderr():  # peers (litdata, datatrove, their workers) print to stdout
            result = module.run(args)
        print_json(result)
        return 0
    result = module.run(args)
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
