"""`tierio weights`: inspect, fetch into the local cache, and load model weights."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tierio.cli.output import byte_progress, print_json, print_table
from tierio.cli.parsers import action_group, alias, leaf
from tierio.errors import ConfigError
from tierio.units import fmt_rate, human_bytes, parse_size

EPILOG = """\
examples:
  tierio weights inspect ./llama/                        shards, tensors, dtypes and sizes (headers only)
  tierio weights load ./llama/ --device cpu              load every tensor; bytes, seconds, GB/s, CPU s/GB
  tierio weights load ./llama/ --cold                    the same from disk: the page cache dropped first
  tierio weights load ./llama/ --private                 the same into private memory (O_DIRECT, no file mapping)
  tierio weights load model.safetensors --keys lm_head.weight
  tierio weights inspect ./llama/ --tensors              every tensor, not only the first 20
  tierio weights load ./llama/ --tp 4 --rank 1           rank 1's tensor-parallel slices only (rules from config.json)
  tierio weights shard ./llama/ ./llama-tp4 --tp 4       one file per rank; then: load ./llama-tp4 --tp 4 --rank 1
  torchrun --nproc-per-node 4 -m tierio weights load "s3://models/llama?endpoint=..." --group
  torchrun --nproc-per-node 4 -m tierio weights load "s3://models/llama?endpoint=..." --group --cache-dir /nvme/weights
                                                         the same through each node's cache: filled once, then read from it
  tierio weights fetch "s3://models/llama?endpoint=http://127.0.0.1:8333" --cache-dir /nvme/weights
  tierio weights load "s3://models/llama?endpoint=http://127.0.0.1:8333" --cache-dir /nvme/weights --device cuda
  tierio weights cache --cache-dir /nvme/weights         what the cache holds, least recently used first

The cache directory defaults to $TIERIO_WEIGHT_CACHE or ~/.cache/tierio/weights.
"""

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16", "fp32": "float32", "float32": "float32"}


def _cache_root(args) -> Path:
    return Path(args.cache or os.environ.get("TIERIO_WEIGHT_CACHE") or "~/.cache/tierio/weights").expanduser()


def _cache(args):
    from tierio.weights import WeightCache

    return WeightCache(_cache_root(args), parse_size(args.max_size))


def _stats_rows(d: dict) -> list[list[str]]:
    rows = [
        ["source", d["source"]], ["method", d["method"]], ["device", d["device"]],
        ["files", str(d["files"])], ["tensors", str(d["tensors"])], ["bytes", human_bytes(d["bytes"])],
        ["seconds", f"{d['seconds']:.3f}"], ["throughput", fmt_rate(d["bytes"] / d["seconds"]) if d["seconds"] else "-"],
        ["CPU s per GB", f"{d['cpu_s_per_gb']:.3f}"],
        ["O_DIRECT bytes", human_bytes(d["direct_bytes"])], ["page-cache bytes", human_bytes(d["buffered_bytes"])],
        ["remote bytes", human_bytes(d["remote_bytes"])],
    ]
    rows += [[k.replace("_", " "), str(v)] for k, v in d.get("extra", {}).items()]
    return rows


# what a fetch that found its model cached has nothing to report on: it moved no byte
_MOVED = {"method", "files", "tensors", "bytes", "throughput", "CPU s per GB", "O_DIRECT bytes",
          "page-cache bytes", "remote bytes"}


def cmd_inspect(args) -> int:
    from tierio.weights import inspect

    info = inspect(args.source)
    if args.json:
        print_json(info)
        return 0
    # tensor names are what --keys takes, so they get the width: a file is named once in the files
    # table and referred to by its number (no file column at all for a single file)
    number = {f["file"]: i for i, f in enumerate(info["files"], 1)}
    print_table(f"{info['source']} ({info['kind']})", ["#", "file", "bytes", "tensors"],
                [[number[f["file"]], f["file"], human_bytes(f["bytes"]), f["tensors"]] for f in info["files"]])
    tensors = list(info["tensors"].items())
    shown = tensors if args.all else tensors[:20]
    several = len(number) > 1
    print_table(f"tensors ({len(tensors)}, {human_bytes(info['tensor_bytes'])})",
                ["name", "dtype", "shape", "bytes"] + (["file #"] if several else []),
                [[n, t["dtype"], "x".join(map(str, t["shape"])) or "scalar", human_bytes(t["bytes"])]
                 + ([number.get(t["file"], t["file"])] if several else []) for n, t in shown])
    if len(shown) < len(tensors):
        print(f"... {len(tensors) - len(shown)} more (--tensors lists every tensor)")
    return 0


def cmd_load(args) -> int:
    import torch

    from tierio.weights import LoadStats, load

    # checked here, in the flag's words: torch's own message lists twenty device types, and the
    # loader's advice is Python (device='cpu'), not the flag to type
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ConfigError(f"--device {args.device}: use cpu, cuda or cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: no CUDA device on this machine; use --device cpu")
    dtype = None
    if args.dtype:
        if args.dtype not in DTYPES:
            raise ConfigError(f"unknown --dtype {args.dtype!r}; use one of {', '.join(sorted(DTYPES))}")
        dtype = getattr(torch, DTYPES[args.dtype])
    keys = args.keys.split(",") if args.keys else None
    stats = LoadStats()
    mapped = False if args.private or args.buffered else None  # None: tierio's choice per load
    cold = _drop_page_cache(args.source) if args.cold else None
    shard = _tp(args)
    with byte_progress("loading", quiet=args.json) as progress:
        if args.group:
            tensors = _load_group(args, dtype, keys, shard, stats, progress)
        elif shard is not None:
            tensors = load(args.source, device=args.device, dtype=dtype, keys=keys, stats=stats, shard=shard,
                           direct=not args.buffered, mapped=mapped, progress=progress)
        elif args.cache or args.via_cache:
            tensors = _cache(args).load(args.source, device=args.device, dtype=dtype, keys=keys, stats=stats,
                                        verify=args.verify, mapped=mapped, progress=progress)
        else:
            tensors = load(args.source, device=args.device, dtype=dtype, keys=keys, stats=stats,
                           direct=not args.buffered, mapped=mapped, progress=progress)
    d = stats.to_dict()
    d["loaded_tensors"] = len(tensors)
    if cold is not None:
        d.setdefault("extra", {})["page cache before the load"] = cold
    if args.json:
        print_json(d)
    else:
        print_table("weights load", ["", "value"], _stats_rows(d))
    return 0


def _load_group(args, dtype, keys, shard, stats, progress):
    """A cooperative load over the torchrun world (gloo): each byte read from the source once."""
    import torch.distributed as dist

    from tierio.weights import TensorParallel, load_group

    if args.device != "cpu":
        raise ConfigError("--group loads into CPU memory: drop --device (move the tensors after the load)")
    if "RANK" not in os.environ:
        raise ConfigError("--group needs torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the environment): "
                          "torchrun --nproc-per-node N -m tierio weights load SOURCE --group")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo")
    try:
        if shard is not None and args.rank is None:  # each rank of the group takes its own slices
            shard = TensorParallel(dist.get_rank() % args.tp, args.tp)
        cache = _cache(args) if args.cache or args.via_cache else None  # each node's cache: warm nodes serve, cold ones fill
        tensors = load_group(args.source, keys=keys, shard=shard, stats=stats, progress=progress, cache=cache)
        if made:
            dist.barrier()  # every rank's exchange is over before the group goes
    finally:
        if made:  # its gloo threads must not live to the interpreter's exit (tierio.dist.release_group)
            dist.destroy_process_group()
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in tensors.items()}


def _tp(args):
    """The tensor-parallel rank of --tp/--rank (None without --tp)."""
    from tierio.weights import TensorParallel

    if args.tp is None:
        if args.rank is not None:
            raise ConfigError("--rank needs --tp N (the tensor-parallel degree)")
        return None
    if (args.cache or args.via_cache) and not args.group:
        raise ConfigError("--tp alone reads a rank's slices from the source, not through the weight cache: "
                          "drop --cache-dir, or load as a group (--group) whose nodes fill and share their caches")
    return TensorParallel(args.rank or 0, args.tp)


def cmd_shard(args) -> int:
    from tierio.weights import shard_model

    report = shard_model(args.source, args.out, args.tp)
    d = report.to_dict()
    if args.json:
        print_json(d)
    else:
        print_table("weights shard", ["", "value"], [["out", d["out"]], ["tensor-parallel ranks", str(d["tp"])],
                    ["files", str(len(d["files"]))], ["bytes written", human_bytes(d["bytes"])],
                    ["source bytes", human_bytes(d["source_bytes"])]])
    return 0


def _drop_page_cache(source: str) -> str:
    """Make `--cold` true for a local model: drop its files' pages and say what was left.

    POSIX_FADV_DONTNEED drops clean pages that no process maps; what is still resident afterwards
    is reported, so the label states what the load met instead of promising a cold read."""
    from tierio.io.pagecache import evict, resident_fraction

    path = Path(source.removeprefix("file://"))
    if "://" in source.removeprefix("file://") or not path.exists():
        return "not dropped (remote source: read over the network)"
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    total = sum(f.stat().st_size for f in files) or 1
    for f in files:
        evict(f)
    left = sum(resident_fraction(f) * f.stat().st_size for f in files) / total
    return "dropped (cold)" if left < 0.01 else f"could not drop all of it: {left:.0%} still resident"


def cmd_fetch(args) -> int:
    from tierio.weights import LoadStats

    stats = LoadStats(source=str(args.source), device="none")
    with byte_progress("fetching", quiet=args.json) as progress:
        path = _cache(args).fetch(args.source, stats=stats, progress=progress)
    d = stats.to_dict()
    d["path"] = str(path)
    if args.json:
        print_json(d)
        return 0
    rows = [r for r in _stats_rows(d) if r[0] != "tensors"]  # a fetch loads none; the path is "cache entry"
    if d["extra"].get("cache") == "hit":  # zeros would read as a copy that moved nothing
        rows = [r for r in rows if r[0] not in _MOVED] + [["copied", "nothing: the cache holds an up-to-date copy"]]
    print_table("weights fetch", ["", "value"], rows)
    return 0


def cmd_cache(args) -> int:
    root = _cache_root(args)
    try:
        root.stat()  # a file on the way is NotADirectoryError: the funnel reports it
    except FileNotFoundError:
        # listing is read-only: a cache that was never filled is shown empty, not created
        if args.json:
            print_json({"root": str(root), "max_bytes": parse_size(args.max_size), "used_bytes": 0, "entries": []})
        else:
            print(f"no weight cache at {root} yet (tierio weights fetch fills it)")
        return 0
    c = _cache(args)
    entries = c.entries()
    if args.json:
        print_json({"root": str(c.root), "max_bytes": c.max_bytes, "used_bytes": sum(e.bytes for e in entries),
                    "entries": [{"name": e.name, "source": e.source, "bytes": e.bytes, "last_used": e.last_used, "path": str(e.path)} for e in entries]})
        return 0
    print_table(f"weight cache {c.root} ({human_bytes(sum(e.bytes for e in entries))} of {human_bytes(c.max_bytes)})",
                ["source", "bytes", "path"], [[e.source, human_bytes(e.bytes), str(e.path)] for e in entries])
    return 0


def register(sub) -> None:
    ws = action_group(sub, "weights", help="inspect, cache and load model weights (safetensors)",
                      description="Load safetensors weights at disk bandwidth; keep a local NVMe cache of remote models.",
                      epilog=EPILOG)

    def common(q, cache: bool = True):
        q.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        if cache:
            q.add_argument("--cache-dir", dest="cache", metavar="DIR",
                           help="weight cache directory (default $TIERIO_WEIGHT_CACHE or ~/.cache/tierio/weights)")
            alias(q, "--cache", dest="cache", metavar="DIR")
            q.add_argument("--max-size", default="200GiB", help="cache size limit, evicting least recently used models (default 200GiB)")
            q.set_defaults(setting_flags={"max_bytes": "--max-size"})  # a too-small cache's error names the flag

    q = leaf(ws, "inspect", help="list shards and tensors from the headers", epilog=EPILOG)
    q.add_argument("source", metavar="SOURCE", help=".safetensors file, model directory, tierio checkpoint or s3:// URL")
    q.add_argument("--tensors", dest="all", action="store_true", help="list every tensor (default: the first 20)")
    alias(q, "--all", dest="all", action="store_true")
    common(q, cache=False)
    q.set_defaults(handler=cmd_inspect)

    q = leaf(ws, "load", help="load weights and report bytes, seconds, GB/s, CPU s/GB", epilog=EPILOG)
    q.add_argument("source", metavar="SOURCE", help=".safetensors file, model directory, tierio checkpoint or s3:// URL")
    q.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    q.add_argument("--dtype", help="convert floating-point tensors: bf16, fp16 or fp32")
    q.add_argument("--keys", help="comma-separated tensor names to load (default all)")
    q.add_argument("--via-cache", action="store_true", help="go through the weight cache (implied by --cache)")
    q.add_argument("--cold", action="store_true",
                   help="drop the model's files from the page cache first and report what stayed resident")
    q.add_argument("--verify", choices=["size", "full"], default="size", help="cache hits: check sizes only, or every window's xxh3")
    q.add_argument("--private", action="store_true",
                   help="CPU: read into private memory by O_DIRECT instead of mapping the files copy-on-write "
                        "(independent of the files afterwards; more CPU per GB); --tp slices are read so already")
    q.add_argument("--buffered", action="store_true", help="like --private, but read through the page cache (never O_DIRECT)")
    q.add_argument("--tp", type=int, metavar="N", help="load one tensor-parallel rank's slices of an N-way group "
                   "(rules chosen from config.json; a directory written by `weights shard` reads only the rank's file)")
    q.add_argument("--rank", type=int, metavar="R", help="the tensor-parallel rank to load with --tp "
                   "(default 0; with --group, the process's rank modulo N)")
    q.add_argument("--group", action="store_true", help="under torchrun: a cooperative load, each rank reading a "
                   "disjoint part from the source and sharing it with the others (node-local memory on a node, gloo across nodes)")
    common(q)
    q.set_defaults(handler=cmd_load)

    q = leaf(ws, "shard", help="write one safetensors file per tensor-parallel rank, plus an index", epilog=EPILOG)
    q.add_argument("source", metavar="SOURCE", help="local .safetensors file or model directory (with config.json)")
    q.add_argument("out", metavar="OUT", help="directory to write the rank files and tierio-tp.json into")
    q.add_argument("--tp", type=int, required=True, metavar="N", help="the tensor-parallel degree to cut for")
    common(q, cache=False)
    q.set_defaults(handler=cmd_shard)

    q = leaf(ws, "fetch", help="copy a remote model into the local cache (verified, atomic)", epilog=EPILOG)
    q.add_argument("source", metavar="SOURCE", help="s3:// URL or shared-filesystem path of a model")
    common(q)
    q.set_defaults(handler=cmd_fetch)

    q = leaf(ws, "cache", help="list the models in the cache", epilog=EPILOG)
    common(q)
    q.set_defaults(handler=cmd_cache)
