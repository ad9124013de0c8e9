"""The options of every `tierio bench` target, in a module that imports nothing heavy.

The benchmarks themselves load torch, numpy and more; `tierio bench TARGET --help` shows these
options without importing them (the target's module is imported when it runs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def io(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="directory on the disk under test (default: a temporary directory under the current one)")
    p.add_argument("--size", default="4GiB", help="file size for the disk comparison (default 4GiB)")
    p.add_argument("--s3-size", default="1GiB", help="object size for the S3 comparison (default 1GiB)")
    p.add_argument("--repeat", type=int, default=2, help="repetitions of every measurement; the best of each is kept (default 2)")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 comparison")


def ckpt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="directory on the disk under test (default: a new temporary directory)")
    p.add_argument("--size", default="2GiB", help="checkpoint state size (default 2GiB)")
    p.add_argument("--tensors", type=int, default=96, help="number of tensors, fp32 and bf16 mixed (default 96)")
    p.add_argument("--repeat", type=int, default=5, help="steady-state repetitions of each tierio save, and the rounds of "
                                                         "the interleaved comparisons (at most 3 of the reads; at most 5 "
                                                         "with --ranks) (default 5)")
    p.add_argument("--keep", action="store_true", help="keep the files written (default: delete them)")
    p.add_argument("--ranks", type=int, default=1, help="run the multi-rank benchmark with this many gloo processes "
                                                         "(multi-rank persist, DCP, resharding; see bench/cluster.py)")
    p.add_argument("--commit-scale", metavar="N,N,...", help="measure the commit of this many simulated ranks instead, "
                                                              "e.g. 1,64,1024")
    p.add_argument("--commit-tensors", type=int, default=64, help="tensor slices per simulated rank (default 64)")
    p.add_argument("--s3", action="store_true", help="with --commit-scale: also on a local SeaweedFS bucket")
    p.add_argument("--no-integrations", action="store_true", help="skip the Lightning and Trainer save-stall ratios")


def weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="2GiB", help="model size (default 2GiB; use e.g. 256MiB for a quick run)")
    p.add_argument("--shards", type=int, default=4, help="number of safetensors shards (default 4)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under /tmp)")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 / weight-cache part")
    p.add_argument("--no-torch-load", action="store_true", help="skip the torch.load peer")
    p.add_argument("--tp-size", default="1GiB", help="least size of the Llama-shaped model of the tensor-parallel "
                   "figures (default 1GiB; whole layers of a Llama-3-8B shape, so it ends up larger)")
    p.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel figures")
    p.add_argument("--no-group", action="store_true", help="skip the cooperative load of 4 gloo ranks from SeaweedFS")
    p.add_argument("--only", choices=["group"], help="run only this part: 'group', the cooperative load (its two ratios)")
    p.add_argument("--repeat", type=int, default=2,
                   help="rounds; every method (S3 ones too) runs once per round, interleaved, and keeps its best (default 2)")


def data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=int, default=1_000_000, help="documents to pack (default 1,000,000)")
    p.add_argument("--seq-len", type=int, default=4096, help="pack / window length (default 4096)")
    p.add_argument("--loader-size", default="256MiB", help="token file for the loader test (default 256MiB)")
    p.add_argument("--stream-size", default="512MiB", help="packed shards for the streaming test (default 512MiB)")
    p.add_argument("--shard-size", default="64MiB", help="shard size (default 64MiB)")
    p.add_argument("--batch-size", type=int, default=256, help="loader batch size in windows (default 256: 1M tokens per batch)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions per figure (default 3)")
    p.add_argument("--passes", type=int, default=4, help="passes over the token file per loader measurement (default 4)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary directory)")
    p.add_argument("--no-s3", dest="skip_s3", action="store_true", help="skip the SeaweedFS streaming figures (and the peers)")
    p.add_argument("--skip-s3", dest="skip_s3", action="store_true", help=argparse.SUPPRESS)  # the old name (docs/cli.md)
    p.add_argument("--peer-samples", type=int, default=200_000,
                   help="samples of 1,024 uint16 tokens in the comparison with litdata and MosaicML Streaming (default 200,000)")
    p.add_argument("--skip-peers", action="store_true",
                   help="skip litdata and MosaicML Streaming (tierio's own figures on the same samples still run)")
    p.add_argument("--build-size", default="64MiB",
                   help="JSONL text for the Ray build against the in-process builder and its peers (default 64MiB)")
    p.add_argument("--no-cluster", action="store_true",
                   help="skip the Ray build and mixture figures")


def parquet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="directory on the disk under test (default: a new temporary directory)")
    p.add_argument("--tokens", type=int, default=50_000_000, help="tokens in the corpus (default 50,000,000)")
    p.add_argument("--vocab-size", type=int, help="pass a vocabulary size to the build (default: none, as the CLI)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions of each side (default 3)")
    p.add_argument("--keep", action="store_true", help="keep the files written (default: delete them)")


def kv(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dram-size", default="1GiB", help="bytes of blocks for the DRAM get (default 1GiB)")
    p.add_argument("--nvme-size", default="2GiB", help="bytes of blocks for the NVMe put and get (default 2GiB)")
    p.add_argument("--device-size", default="1GiB",
                   help="bytes of blocks for the device-tier get, where CUDA is available (default 1GiB)")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under /tmp)")
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds, each method keeps its best (default 2)")
    p.add_argument("--prompt-blocks", type=int, default=8, help="cached blocks of the TTFT prompt (default 8)")
    p.add_argument("--model-layers", type=int, default=6, help="layers of the TTFT model (default 6)")
    p.add_argument("--no-model", action="store_true", help="skip the transformers parts (TTFT, miss overhead)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads for the model parts, with and without tierio alike (default: torch's "
                        "own choice). On a CPU shared with other work, 1 avoids threads waiting for a busy core")


def crash(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", action="append", help="run only these scenarios (repeatable; default all)")
    p.add_argument("--limit", type=int, help="crash at a deterministic sample of this many points per scenario")
    p.add_argument("--jobs", type=int, default=2, help="trials run at once")
    p.add_argument("--dir", help="where trial directories go (default: the system's temporary directory)")


def integrations(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="work directory on the disk under test (default: a temporary directory)")
    p.add_argument("--size", default="512MiB", help="state saved behind the Python-heavy steps (default 512MiB)")
    p.add_argument("--preempt-size", default="2GiB", help="state of the 2-rank preempted job (default 2GiB)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the step timings (default 3)")
    p.add_argument("--repeat", type=int, default=3, help="saves per framework stall figure (default 3)")
    p.add_argument("--ddp-size", default="512MiB",
                   help="state of the DDP jobs (4 and 2 torchrun ranks of each framework; default 512MiB)")
    p.add_argument("--no-frameworks", action="store_true", help="skip the Lightning and Trainer ratios (stalls, DDP)")


ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "io": io,
    "ckpt": ckpt,
    "weights": weights,
    "data": data,
    "parquet": parquet,
    "kv": kv,
    "crash": crash,
    "integrations": integrations,
}
