"""`tierio bench kv`: the KV cache against memcpy, fio and recomputing the prefill.

One run on one machine, every peer measured in the same run; rounds interleave tierio and its
peer and each keeps its best.

* ``dram_get_vs_memcpy``: a batched get of ``--dram-size`` (default 1 GiB) of blocks from the DRAM
  tier into a faulted destination, against one ``np.copyto`` of the same bytes into the same buffer.
* ``nvme_put_vs_fio_write``: a put of ``--nvme-size`` (default 2 GiB) of blocks through a small DRAM
  tier until every block is on the NVMe slabs (the write-back path), against fio's O_DIRECT
  sequential write of the same size (8 MiB blocks, queue depth 8, libaio) in the same directory.
* ``nvme_get_vs_fio_read``: a batched get of those blocks from NVMe (verified against their xxh3)
  with the page cache dropped, against fio's O_DIRECT read of the same size.
  Blocks are Llama-3-8B BF16 KV (32 layers × 8 KV heads × 128 × 2 B × 2) of ``--block-tokens``
  tokens: 32 MiB at the default 256.
* ``ttft_dram_hit_vs_recompute`` / ``ttft_nvme_hit_vs_recompute``: time to first token of a long
  prompt (``--prompt-blocks`` whole blocks plus 16 tokens) on a transformers Llama built from a
  config with random weights, recomputed, against the same prompt with its prefix loaded from DRAM,
  and from NVMe in a freshly opened cache (DRAM empty, as after a restart; page cache dropped).
  The model is sized so the prefill takes over a second on a small CPU; ``recompute_ttft_s`` says
  what it took here.
* ``device_get_vs_memcpy`` (only where CUDA is available; otherwise ``"device"`` says why it was
  skipped): a batched get of ``--device-size`` (default 1 GiB) of blocks from the device tier into a
  CUDA tensor, against one device-to-device ``copy_`` of the same bytes into the same tensor; and
  ``device_put_vs_memcpy``, a put of those blocks from a CUDA tensor into a new cache's device tier,
  against the same copy. They have no target: they tell what the tier's per-block copies cost on this GPU.
* ``lookup_keys_per_s``: keys resolved per second by ``lookup`` of 1,000-block chains.
* ``miss_overhead``: tokens per second of the greedy reference loop (prefill, then decode) with
  tierio at a 0% hit rate (every prompt new: hashed, looked up, its blocks stored) ÷ without;
  prompts alternate between the two, each side keeps its best.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from tierio.bench.common import drop_caches, machine_facts, run_fio
from tierio.io.buffers import HostBuffer
from tierio.kv import BlockLayout, KVCache, KVConfig, KVTier, Namespace
from tierio.units import MiB, parse_size

TARGETS = {
    "dram_get_vs_memcpy": (">=", 0.8),
    "nvme_get_vs_fio_read": (">=", 0.8),
    "nvme_put_vs_fio_write": (">=", 0.8),
    "ttft_dram_hit_vs_recompute": (">=", 10.0),
    "ttft_nvme_hit_vs_recompute": (">=", 5.0),
    "lookup_keys_per_s": (">=", 1_000_000),
    "miss_overhead": (">=", 0.97),
}

# Llama-3-8B's KV in BF16: what a serving node of a mid-size model moves per block.
IO_LAYOUT = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}


def _fill(buf: HostBuffer, seed: int) -> None:
    """Distinct, cheap bytes: one random MiB tiled (a block's checksum still covers all of it)."""
    tile = np.frombuffer(np.random.default_rng(seed).bytes(MiB), dtype=np.uint8)
    arr = buf.array
    for at in range(0, arr.size, MiB):
        arr[at:at + MiB] = tile[: min(MiB, arr.size - at)]


def _chain(cache: KVCache, blocks: int, seed: int) -> list[bytes]:
    return cache.hash_blocks(np.random.default_rng(seed).integers(0, 128_000, blocks * cache.layout.tokens))


def _timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# -- DRAM --------------------------------------------------------------------------------------------
def bench_dram(size: int, layout: BlockLayout, rounds: int) -> dict:
    n = max(1, size // layout.block_bytes)
    nbytes = n * layout.block_bytes
    src, dst = HostBuffer(nbytes), HostBuffer(nbytes)
    _fill(src, 1)
    with KVCache(layout, Namespace("bench-kv"), KVConfig(dram_bytes=n * layout.block_bytes)) as cache:
        keys = _chain(cache, n, 1)
        stored = cache.put(keys, src.array[:nbytes]).result()
        assert stored.stored == n, stored
        gets, copies = [], []
        for _ in range(max(1, rounds) + 1):  # the first round warms caches and threads: dropped
            res, t = _timed(lambda: cache.get(keys, dst.array[:nbytes]).result())
            assert res.blocks == n and res.tiers == [KVTier.DRAM] * n, res
            gets.append(t)
            _, t = _timed(lambda: np.copyto(dst.array[:nbytes], src.array[:nbytes]))
            copies.append(t)
        if not np.array_equal(dst.array[:nbytes], src.array[:nbytes]):
            raise AssertionError("the DRAM get delivered other bytes than were put")
    get_s, copy_s = min(gets[1:]), min(copies[1:])
    return {"bytes": nbytes, "blocks": n, "get_seconds": get_s, "memcpy_seconds": copy_s,
            "get_bytes_per_s": nbytes / get_s, "memcpy_bytes_per_s": nbytes / copy_s,
            "all_get_seconds": gets[1:], "all_memcpy_seconds": copies[1:]}


# -- NVMe --------------------------------------------------------------------------------------------
def bench_nvme(size: int, layout: BlockLayout, work: Path, rounds: int) -> dict:
    n = max(2, size // layout.block_bytes)
    nbytes = n * layout.block_bytes
    half = (n + 1) // 2  # the source repeats after half the blocks (fewer bytes to allocate); keys differ
    src, dst = HostBuffer(half * layout.block_bytes), HostBuffer(nbytes)
    _fill(src, 2)
    sources = [src.array[(i % half) * layout.block_bytes:((i % half) + 1) * layout.block_bytes] for i in range(n)]
    cfg = KVConfig(dram_bytes=16 * layout.block_bytes if layout.block_bytes <= 64 * MiB else 4 * layout.block_bytes,
                   nvme_dir=work / "kv", nvme_bytes=(n + 2) * layout.block_bytes, admit_uses=1)
    puts, gets, fio_w, fio_r = [], [], [], []
    with KVCache(layout, Namespace("bench-kv"), cfg) as cache:
        for r in range(max(1, rounds)):
            fio_w.append(run_fio(work, "write", nbytes)["bytes_per_s"])
            keys = _chain(cache, n, 100 + r)  # new blocks each round: the previous round's are evicted
            drop_caches()

            def put_all(keys=keys):
                res = cache.put(keys, sources).result()
                cache.flush()  # every block on NVMe, the last ones still in DRAM written down too
                return res

            res, t = _timed(put_all)
            assert res.stored == n, res
            puts.append(nbytes / t)
            cache.evict(keys, KVTier.DRAM)
            assert cache.lookup(keys).tiers == [KVTier.NVME] * n
            fio_r.append(run_fio(work, "read", nbytes)["bytes_per_s"])
            drop_caches([work / "kv"])
            got, t = _timed(lambda keys=keys: cache.get(keys, dst.array[:nbytes]).result())
            assert got.blocks == n and got.tiers == [KVTier.NVME] * n, got
            gets.append(nbytes / t)
        for i in (0, half, n - 1):
            if not np.array_equal(dst.array[i * layout.block_bytes:(i + 1) * layout.block_bytes], sources[i]):
                raise AssertionError(f"block {i} read back from NVMe differs from what was put")
        st = cache.stats()
    return {"bytes": nbytes, "blocks": n, "direct": st.tiers[1].direct, "put_bytes_per_s": max(puts),
            "get_bytes_per_s": max(gets), "fio_write_bytes_per_s": max(fio_w), "fio_read_bytes_per_s": max(fio_r),
            "all_put_bytes_per_s": puts, "all_get_bytes_per_s": gets, "all_fio_write_bytes_per_s": fio_w,
            "all_fio_read_bytes_per_s": fio_r, "integrity_errors": st.counters.integrity_errors,
            "fetch_latency_s": st.fetch_latency_s}


# -- the device tier ---------------------------------------------------------------------------------
def device_unavailable() -> str | None:
    """Why the device tier cannot be measured here, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "CUDA is not available: there is no device tier to measure"


def bench_device(size: int, layout: BlockLayout, rounds: int) -> dict:
    import torch

    n = max(1, size // layout.block_bytes)
    nbytes = n * layout.block_bytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    cfg = KVConfig(dram_bytes=2 * layout.block_bytes, device_bytes=(n + 1) * layout.block_bytes)
    puts, gets, copies = [], [], []

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    for _ in range(max(1, rounds) + 1):  # the first round warms up: dropped
        with KVCache(layout, Namespace("bench-kv"), cfg) as cache:  # a new cache: the put stores every block
            keys = _chain(cache, n, 4)
            torch.cuda.synchronize()
            stored, t = _timed(lambda: cache.put(keys, src).result())
            assert stored.stored == n and cache.lookup(keys).tiers == [KVTier.DEVICE] * n, stored
            puts.append(t)
            res, t = _timed(lambda: cache.get(keys, dst).result())
            assert res.blocks == n and res.tiers == [KVTier.DEVICE] * n, res
            gets.append(t)
            _, t = _timed(copy)
            copies.append(t)
            dst.zero_()
            cache.get(keys, dst).result()
            if not torch.equal(dst, src):
                raise AssertionError("the device get delivered other bytes than were put")
            device = cache.stats().device
    put_s, get_s, copy_s = min(puts[1:]), min(gets[1:]), min(copies[1:])
    return {"device": device, "bytes": nbytes, "blocks": n, "put_seconds": put_s, "get_seconds": get_s,
            "memcpy_seconds": copy_s, "put_bytes_per_s": nbytes / put_s, "get_bytes_per_s": nbytes / get_s,
            "memcpy_bytes_per_s": nbytes / copy_s, "all_put_seconds": puts[1:], "all_get_seconds": gets[1:],
            "all_memcpy_seconds": copies[1:]}


# -- lookups -----------------------------------------------------------------------------------------
def bench_lookup(chain: int = 1000, repeat: int = 300) -> dict:
    layout = BlockLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", tokens=16)
    with KVCache(layout, Namespace("bench-kv-lookup"), KVConfig(dram_bytes=(chain + 8) * 4096)) as cache:
        keys = _chain(cache, chain, 3)
        cache.put(keys, np.zeros(chain * layout.block_bytes, dtype=np.uint8)).result()
        assert cache.lookup(keys).blocks == chain
        best = float("inf")
        for _ in range(3):
            _, t = _timed(lambda: [cache.lookup(keys) for _ in range(repeat)])
            best = min(best, t)
    return {"chain_blocks": chain, "lookups": repeat, "seconds": best, "keys_per_s": chain * repeat / best}


# -- the model parts ---------------------------------------------------------------------------------
def bench_model(args, work: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierio.integrations.hf_kv import PrefixCache, greedy_generate, layout_for

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=args.model_layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
    model = LlamaForCausalLM(cfg).eval()
    bt = args.block_tokens
    block = layout_for(model, bt).block_bytes
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32000, (1, args.prompt_blocks * bt + 16), generator=gen)
    rounds = max(2, args.repeat)
    out: dict = {"torch_threads": torch.get_num_threads(),
                 "model": {"layers": args.model_layers, "hidden": 512, "params": sum(p.numel() for p in model.parameters()),
                           "prompt_tokens": ids.shape[1], "cached_tokens": args.prompt_blocks * bt, "block_bytes": block}}
    reference = greedy_generate(model, ids, 1)
    recompute = min([reference.ttft_s] + [greedy_generate(model, ids, 1).ttft_s for _ in range(rounds - 1)])
    out["recompute_ttft_s"] = recompute
    dram_cfg = KVConfig(dram_bytes=(args.prompt_blocks + 4) * block)
    with PrefixCache.open(model, dram_cfg, block_tokens=bt) as pc:
        pc.generate(ids, 1)
        runs = [pc.generate(ids, 1) for _ in range(rounds + 1)]
    assert all(r.cached_tokens == args.prompt_blocks * bt and r.tokens == reference.tokens for r in runs)
    out["dram_hit_ttft_s"] = min(r.ttft_s for r in runs)
    nvme_cfg = KVConfig(dram_bytes=(args.prompt_blocks + 4) * block, nvme_dir=work / "kv-ttft",
                        nvme_bytes=(args.prompt_blocks + 4) * block, admit_uses=1)
    with PrefixCache.open(model, nvme_cfg, block_tokens=bt) as pc:
        pc.generate(ids, 1)  # stored, then written down when it closes
    nvme = []
    for _ in range(rounds + 1):
        with PrefixCache.open(model, nvme_cfg, block_tokens=bt) as pc:  # a restarted server: DRAM empty
            drop_caches([work / "kv-ttft"])
            r = pc.generate(ids, 1)
            assert r.cached_tokens == args.prompt_blocks * bt and r.tokens == reference.tokens, r
            assert pc.kv.stats().counters.served_nvme == args.prompt_blocks
            nvme.append(r.ttft_s)
    out["nvme_hit_ttft_s"] = min(nvme)
    out["miss"] = _miss_overhead(model, bt, max(3, rounds))
    return out


def _miss_overhead(model, bt: int, rounds: int, prompts: int = 2, new_tokens: int = 16) -> dict:
    """Generated tokens per second of the reference loop, without tierio and with it at a 0% hit
    rate (every prompt is new). Prompts alternate between the two loops (ABAB…, then BABA…) so
    drift of a shared machine falls on both alike; each side keeps its best prompt (every prompt is
    the same work), and the ratio of total tokens over total time is reported beside it."""
    import torch

    from tierio.integrations.hf_kv import PrefixCache, greedy_generate, layout_for

    gen = torch.Generator().manual_seed(11)
    block = layout_for(model, bt).block_bytes
    secs = {"without": [], "with": []}

    def new_prompt() -> torch.Tensor:
        return torch.randint(0, 32000, (1, 4 * bt + 16), generator=gen)

    with PrefixCache.open(model, KVConfig(dram_bytes=64 * block), block_tokens=bt) as pc:
        greedy_generate(model, new_prompt(), new_tokens)  # both loops once, untimed: first calls pay one-off costs
        pc.generate(new_prompt(), new_tokens)
        runs = {"without": lambda p: greedy_generate(model, p, new_tokens), "with": lambda p: pc.generate(p, new_tokens)}
        for r in range(rounds):
            for _ in range(prompts):
                for side in (("without", "with") if r % 2 == 0 else ("with", "without")):
                    res, t = _timed(lambda side=side: runs[side](new_prompt()))
                    assert res.cached_tokens == 0 and len(res.tokens) == new_tokens
                    secs[side].append(t)
        parts = _tierio_seconds(pc, new_prompt)
    tps = {side: new_tokens / min(s) for side, s in secs.items()}
    total = {side: len(s) * new_tokens / sum(s) for side, s in secs.items()}
    return {"tokens_per_s_without": tps["without"], "tokens_per_s_with": tps["with"],
            "total_ratio": total["with"] / total["without"], "tierio_seconds_per_prompt": parts,
            "ratio_from_parts": min(secs["without"]) / (min(secs["without"]) + parts),
            "all_seconds_without": secs["without"], "all_seconds_with": secs["with"], "prompt_tokens": 4 * bt + 16,
            "new_tokens": new_tokens}


def _tierio_seconds(pc, new_prompt, reps: int = 5) -> float:
    """What tierio adds to a missed prompt, timed alone (best of ``reps``): hashing its blocks,
    the lookup, and cutting its blocks out of the model's cache and storing them. On a machine
    shared with other work this is steadier than the difference of two whole loops."""
    prompt = new_prompt()
    pre = pc.prefill(prompt, store=False)  # a real cache of the right shape to cut blocks from
    best = float("inf")
    for _ in range(reps):
        other = new_prompt()  # fresh keys: a miss, and new blocks to store
        t0 = time.perf_counter()
        keys = pc.kv.hash_blocks(other[0])
        pc.kv.lookup(keys)
        pc.store_blocks(pre.cache, keys)
        best = min(best, time.perf_counter() - t0)
    return best


# -- the benchmark -----------------------------------------------------------------------------------
def run(args) -> dict:
    layout = BlockLayout(**IO_LAYOUT, tokens=args.block_tokens)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tierio-bench-kv-"))
    work = base / "tierio-bench-kv"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict = {"bench": "kv", "machine": machine_facts(), "dir": str(work), "layout": layout.describe(),
                 "block_bytes": layout.block_bytes}
    try:
        res["dram"] = dram = bench_dram(parse_size(args.dram_size), layout, args.repeat)
        res["nvme"] = nvme = bench_nvme(parse_size(args.nvme_size), layout, work, args.repeat)
        res["lookup"] = look = bench_lookup()
        ratios = {
            "dram_get_vs_memcpy": dram["memcpy_seconds"] / dram["get_seconds"],
            "nvme_get_vs_fio_read": nvme["get_bytes_per_s"] / nvme["fio_read_bytes_per_s"],
            "nvme_put_vs_fio_write": nvme["put_bytes_per_s"] / nvme["fio_write_bytes_per_s"],
        }
        skipped = device_unavailable()
        if skipped is None:
            res["device"] = device = bench_device(parse_size(args.device_size), layout, args.repeat)
            ratios["device_get_vs_memcpy"] = device["memcpy_seconds"] / device["get_seconds"]
            ratios["device_put_vs_memcpy"] = device["memcpy_seconds"] / device["put_seconds"]
        else:
            res["device"] = {"skipped": skipped}
        if not args.no_model:
            res["model"] = m = bench_model(args, work)
            ratios["ttft_dram_hit_vs_recompute"] = m["recompute_ttft_s"] / m["dram_hit_ttft_s"]
            ratios["ttft_nvme_hit_vs_recompute"] = m["recompute_ttft_s"] / m["nvme_hit_ttft_s"]
            ratios["miss_overhead"] = m["miss"]["tokens_per_s_with"] / m["miss"]["tokens_per_s_without"]
        ratios["lookup_keys_per_s"] = look["keys_per_s"]
        res["ratios"] = {k: round(v, 3) if k != "lookup_keys_per_s" else round(v) for k, v in ratios.items()}
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
