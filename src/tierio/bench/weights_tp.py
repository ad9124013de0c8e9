"""`tierio bench weights`, the tensor-parallel part: one rank's slices of a Llama-shaped model, cold.

The model has the shapes of Llama-3-8B (hidden 4096, intermediate 14336, 32 query and 8 key/value
heads) with a 32000-token vocabulary and as many whole layers as reach ``--tp-size``, in two
shards, with its config.json, so the rules come from the preset as for any real model.

* bytes: each of the 4 ranks loads its slices (page cache dropped first) and the busiest rank's
  bytes read are divided by the bytes of its slices (replicated tensors count whole), with the
  default gap between a strided slice's pieces, with gap 0 (exactly the slices), and from a
  pre-sharded copy;
* time, rank 1, interleaved rounds (bench.common.alternate), cold: loading the whole model and
  slicing it, against the sliced load (default gap, and gap 0: exactly the slices), and against
  the pre-sharded load.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from tierio.bench.common import alternate, drop_caches, require_tool
from tierio.io.buffers import align_down, align_up
from tierio.io.engine import ByteRange, Windowing
from tierio.io.engine import plan as regions
from tierio.weights import LoadStats, TensorParallel, load, shard_model
from tierio.weights.sliced import cut, split, with_rules
from tierio.weights.sources import ModelSource, resolve

TP = 4
SECTOR = 512  # the grid tierio's exact reader widens pieces to (the device's logical block here)
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}


def _shapes(layers: int) -> dict[str, tuple[int, int]]:
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return out


def make_llama(directory: Path, size: int) -> Path:
    """A Llama-shaped model of at least ``size`` bytes (random bf16) in two shards, with config.json."""
    from safetensors.torch import save_file

    per_layer = sum(math.prod(s) * 2 for n, s in _shapes(1).items() if ".layers." in n)
    layers = max(1, math.ceil((size - 2 * 32000 * 4096 * 2) / per_layer))
    shapes = _shapes(layers)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = list(shapes)
    index = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        tensors = {n: torch.from_numpy(rng.integers(0, 1 << 16, math.prod(shapes[n]), dtype=np.uint16))
                   .view(torch.bfloat16).view(shapes[n]) for n in part}
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(tensors, str(directory / fname))
        index.update({n: fname for n in part})
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (directory / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    return directory


def _full_then_slice(model: Path, spec: TensorParallel) -> dict[str, torch.Tensor]:
    """The peer: every rank loads the whole model and keeps its slices (copies of strided ones)."""
    whole = load(model)
    out = {}
    for name, t in whole.items():
        take = spec.take(name, tuple(t.shape))
        out[name] = t if take is None else cut(t, take)
    return out


def _busiest(model: Path, **kw) -> float:
    """Bytes read by the busiest of the TP ranks ÷ the bytes of its slices."""
    worst = (0, 1)
    for rank in range(TP):
        drop_caches([model])
        st = LoadStats()
        got = load(model, shard=TensorParallel(rank, TP), stats=st, **kw)
        worst = max(worst, (st.bytes, sum(t.numel() * t.element_size() for t in got.values())))
    return worst[0] / worst[1]


def _fio_jobs(src: ModelSource, spec: TensorParallel | None) -> list[list[str]]:
    """fio jobs reading what ``spec``'s rank reads with ``slice_gap_bytes=0`` (every file whole
    when None), O_DIRECT on the device's 512-byte grid as tierio's exact reader widens its pieces:
    a job per contiguous region (8 MiB blocks, depth 8) and per column of strided pieces (one piece
    per block, the holes skipped with ``rw=read:HOLE``, depth 128)."""
    if spec is None:
        return [job for sh in src.shards for job in _sequential(str(sh.path), 0, align_up(sh.size, SECTOR))]
    plan = split(src, spec, list(src.tensors()), gap=0)
    jobs = []
    for shard, entries in plan.selected.items():
        ranges = [ByteRange(shard.data_offset + e.begin, shard.data_offset + e.end) for _, e in entries]
        for r in regions(ranges, Windowing(8 << 20, 8, grid=SECTOR)):  # touching ranges merged, starts on the grid
            jobs += _sequential(str(shard.path), r.start, align_up(r.end, SECTOR) - r.start)
    for it in plan.strided:
        pieces, k = it.pieces(), len(it.take.ranges)
        for j in range(k):  # each range of a row repeats at the same stride
            col = pieces[j::k]
            off, n = int(col[0, 0]), int(col[0, 1])
            stride = int(col[1, 0] - col[0, 0]) if len(col) > 1 else n
            lo = align_down(off, SECTOR)
            bs = align_up(off + n, SECTOR) - lo
            jobs.append([f"--filename={it.shard.path}", f"--rw=read:{max(0, stride - bs)}", f"--bs={bs}",
                         "--iodepth=128", f"--offset={lo}", f"--size={stride * len(col)}"])
    return jobs


def _sequential(path: str, offset: int, size: int) -> list[list[str]]:
    """fio jobs reading [offset, offset + size) in 8 MiB blocks (fio refuses a block larger than
    the job and skips a last partial one: the tail is a job of its own)."""
    whole = size // (8 << 20) * (8 << 20)
    parts = [(offset, whole, 8 << 20), (offset + whole, size - whole, size - whole)]
    return [[f"--filename={path}", "--rw=read", f"--bs={bs}", "--iodepth=8", f"--offset={lo}", f"--size={n}"]
            for lo, n, bs in parts if n]


def _fio_seconds(jobs: list[list[str]]) -> float:
    """Seconds for fio to run ``jobs`` all at once: the longest job's runtime (threads, started
    together; fio's own start-up, a large part of its wall time, is not the device's)."""
    fio = require_tool("fio", "apt-get install fio")
    args = [fio, "--ioengine=libaio", "--direct=1", "--readonly", "--thread", "--output-format=json"]
    for i, job in enumerate(jobs):
        args += [f"--name=tp{i}", *job]
    done = subprocess.run(args, check=True, capture_output=True, text=True)
    ran = json.loads(done.stdout[done.stdout.index("{"):])["jobs"]
    if len(ran) != len(jobs):  # fio drops the jobs after one it refuses, and still exits 0
        raise RuntimeError(f"fio ran {len(ran)} of {len(jobs)} jobs: {done.stderr.strip()}")
    return max(j["read"]["runtime"] for j in ran) / 1000.0


def run_tp(work: Path, size: int, rounds: int) -> tuple[dict, dict[str, float], dict[str, float]]:
    """(figures, ratios, extra ratios) of the tensor-parallel part."""
    model = make_llama(work / "llama", size)
    pre = work / "llama-tp4"
    try:
        shard_model(model, pre, TP)
        spec = with_rules(TensorParallel(1, TP), resolve(model))
        res: dict = {"model_bytes": resolve(model).total_bytes, "ranks": TP}
        ratios = {"tp_busiest_rank_bytes_vs_slice": _busiest(model)}
        extra = {"tp_exact_busiest_rank_bytes_vs_slice": _busiest(model, slice_gap_bytes=0),
                 "tp_presharded_busiest_rank_bytes_vs_slice": _busiest(pre)}

        def timed(fn):
            def run() -> float:
                t0 = time.perf_counter()
                out = fn()
                seconds = time.perf_counter() - t0
                del out
                return seconds
            return run

        sides = {"full_then_slice": timed(lambda: _full_then_slice(model, spec)),
                 "sliced": timed(lambda: load(model, shard=spec)),
                 "sliced_exact": timed(lambda: load(model, shard=spec, slice_gap_bytes=0)),
                 "presharded": timed(lambda: load(pre, shard=TensorParallel(1, TP)))}
        src = resolve(model)
        exact_jobs, whole_jobs = _fio_jobs(src, spec), _fio_jobs(src, None)
        sides.update({"fio_whole": lambda: _fio_seconds(whole_jobs), "fio_exact_slice": lambda: _fio_seconds(exact_jobs)})
        secs = alternate(sides, max(1, rounds), before=lambda: drop_caches([work]))
        res["seconds"] = secs
        ratios["tp_load_vs_full_then_slice"] = min(secs["full_then_slice"]) / min(secs["sliced"])
        extra["tp_exact_load_vs_full_then_slice"] = min(secs["full_then_slice"]) / min(secs["sliced_exact"])
        extra["tp_presharded_vs_full_then_slice"] = min(secs["full_then_slice"]) / min(secs["presharded"])
        # The device's own bound on the ratio with exact bytes: fio reading the whole files ÷ fio
        # reading exactly the rank's slices (the same pieces, widened to the same grid).
        extra["tp_fio_whole_vs_fio_exact_slice"] = min(secs["fio_whole"]) / min(secs["fio_exact_slice"])
        extra["tp_exact_load_vs_fio_exact_slice"] = min(secs["fio_exact_slice"]) / min(secs["sliced_exact"])
        # The most the time ratio can be while reading only the slice's bytes: the same whole load
        # and slice ÷ fio reading exactly the slice.
        extra["tp_full_then_slice_vs_fio_exact_slice"] = min(secs["full_then_slice"]) / min(secs["fio_exact_slice"])
        return res, ratios, extra
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["make_llama", "run_tp"]
