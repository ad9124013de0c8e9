"""`tierio bench data`, the cluster part: corpus preparation on Ray and weighted mixtures.

  ray_build_vs_inprocess  tokens/s of ``build_on_ray`` with 2 workers (Ray already started, as on
                          a cluster; its start-up is reported as ``ray_start_s``) / the in-process
                          builder on the same JSONL text and tokenizer
  finish_bytes_vs_tokens  bytes the Ray build's finishing step reads and writes / token bytes
  ray_build_vs_datatrove  the same tokens/s / datatrove's DocumentTokenizer on its local executor
                          (same files, tokenizer and 2 workers; no document shuffle)
  ray_build_vs_litdata_optimize
                          the same / litdata ``optimize`` tokenizing each file (2 workers, local disk)
  blend_samples_per_s_vs_single
                          samples/s of a 3-source BlendedDataset of token windows / one source,
                          each through ``build_loader`` with 2 workers, batches of 64, from the
                          first batch on (about 100,000 windows per pass)

Sides run in interleaved rounds (``common.alternate``); each keeps its best. Peers missing are named.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierio.bench import common

TARGETS = {
    "ray_build_vs_inprocess": (">=", 0.9),
    "finish_bytes_vs_tokens": ("<=", 0.01),
    "ray_build_vs_datatrove": (">=", 1.2),
    "ray_build_vs_litdata_optimize": (">=", 1.2),
    "blend_samples_per_s_vs_single": (">=", 0.9),
}
VOCAB = 20_000


def _corpus(work: Path, nbytes: int, files: int = 8) -> tuple[list[Path], Path]:
    """JSONL text files of ``nbytes`` in all (words of a 20,000-word vocabulary) and a WordLevel tokenizer."""
    import tokenizers

    d = work / "text"
    d.mkdir(parents=True, exist_ok=True)
    vocab = {"<eos>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(work / "tokenizer.json"))
    rng = np.random.default_rng(0)
    paths = []
    for f in range(files):
        p = d / f"{f:03d}.jsonl"
        with open(p, "w") as out:
            written = 0
            while written < nbytes // files:
                words = rng.zipf(1.3, int(rng.integers(50, 600))) % VOCAB
                line = json.dumps({"text": " ".join(f"w{w}" for w in words.tolist())}) + "\n"
                out.write(line)
                written += len(line)
        paths.append(p)
    return paths, work / "tokenizer.json"


def bench_build(work: Path, nbytes: int, repeat: int, with_peers: bool) -> dict[str, Any]:
    import ray

    from tierio.data.builder import build_inputs
    from tierio.data.raybuild import build_on_ray

    files, tok = _corpus(work, nbytes)
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - t0
    stats: dict[str, Any] = {}

    def inprocess() -> float:
        shutil.rmtree(work / "one", ignore_errors=True)
        (work / "one").mkdir()
        t = time.perf_counter()
        st = build_inputs(files, work / "one" / "corpus", vocab_size=VOCAB + 2, tokenizer=tok, append_eos=0)
        stats["tokens"] = st.tokens
        return st.tokens / (time.perf_counter() - t)

    def on_ray() -> float:
        shutil.rmtree(work / "parts", ignore_errors=True)
        st = build_on_ray(files, work / "parts", tokenizer=tok, append_eos=0, workers=2)
        stats["finish"] = st.finish_bytes / st.token_bytes
        return st.tokens / st.seconds

    runs = {"inprocess": inprocess, "ray": on_ray}
    peers: dict[str, str] = {}
    if with_peers:
        for name, make in (("datatrove", _datatrove), ("litdata", _litdata)):
            run = make(files, tok, work, stats)
            if isinstance(run, str):
                peers[name] = run
            else:
                runs[name] = run
    try:
        got = common.alternate(runs, repeat)
    finally:
        ray.shutdown()
    best = {k: max(v) for k, v in got.items()}
    ratios = {"ray_build_vs_inprocess": common.ratio(best["ray"], best["inprocess"]),
              "finish_bytes_vs_tokens": round(stats["finish"], 6)}
    for name, key in (("datatrove", "ray_build_vs_datatrove"), ("litdata", "ray_build_vs_litdata_optimize")):
        if name in best:
            ratios[key] = common.ratio(best["ray"], best[name])
    return {"ratios": ratios, "tokens_per_s": {k: round(v) for k, v in best.items()}, "samples": got,
            "ray_start_s": round(ray_start, 2), "input_bytes": sum(f.stat().st_size for f in files),
            "tokens": stats.get("tokens"), "missing_peers": peers}


def _datatrove(files: list[Path], tok: Path, work: Path, stats: dict[str, Any]) -> Any:
    try:
        from datatrove.executor import LocalPipelineExecutor
        from datatrove.pipeline.readers import JsonlReader
        from datatrove.pipeline.tokens import DocumentTokenizer
    except ImportError:
        return "pip install datatrove"

    def run() -> float:
        out = work / "dt"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        LocalPipelineExecutor(pipeline=[
            JsonlReader(str(files[0].parent), text_key="text", glob_pattern="*.jsonl"),
            DocumentTokenizer(str(out / "tokens"), tokenizer_name_or_path=str(tok), eos_token="<eos>",
                              shuffle_documents=False),
        ], tasks=len(files), workers=2, logging_dir=str(out / "logs"), skip_completed=False).run()
        return stats["tokens"] / (time.perf_counter() - t)

    return run


def _litdata(files: list[Path], tok: Path, work: Path, stats: dict[str, Any]) -> Any:
    from tierio.bench.data_peers import import_litdata

    litdata = import_litdata()
    if litdata is None:
        return "pip install --no-deps litdata tifffile obstore (beside your torch build)"

    def run() -> float:
        out = work / "lit"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        litdata.optimize(fn=_litdata_tokenize(str(tok)), inputs=[str(f) for f in files], output_dir=str(out),
                         num_workers=2, chunk_bytes="64MB", item_loader=litdata.TokensLoader())
        return stats["tokens"] / (time.perf_counter() - t)

    return run


class _litdata_tokenize:  # noqa: N801 - a picklable function for litdata's worker processes
    def __init__(self, tokenizer: str) -> None:
        self.tokenizer = tokenizer

    def __call__(self, path: str):
        from tierio.data.builder import iter_text_docs

        for ids in iter_text_docs(path, self.tokenizer, append_eos=0):
            yield ids.astype(np.uint16)


def bench_blend(work: Path, repeat: int, batch: int = 64, seq_len: int = 1024) -> dict[str, Any]:
    """The same loader over one token-window source and over a blend of three."""
    from tierio.data import TokenWindowDataset, build_indexed
    from tierio.data.blend import BlendedDataset
    from tierio.data.loader import build_loader, loader_settings

    rng = np.random.default_rng(1)
    sources = []
    for i, tokens in enumerate((200_000_000, 100_000_000, 100_000_000)):
        # ~200k windows in the single source and in the blend: a pass takes about half a second, and
        # a pass is timed whole on both sides (a source is not read past its end, so no epoch starts)
        build_indexed([rng.integers(0, 50_000, tokens, dtype=np.int32)], work / f"blend{i}", vocab_size=50_000)
        sources.append(TokenWindowDataset(work / f"blend{i}", seq_len))
    blend = BlendedDataset(sources, [0.5, 0.3, 0.2])
    workers = 2
    # both sides take the same batches and stop with batches still to come: a side that ran to its
    # last batch would drain with idle workers while the other's keep prefetching, on the same cores
    in_flight = workers * (loader_settings().prefetch_factor or 1)
    n = (min(len(blend), len(sources[0])) // batch - in_flight) * batch

    def through(ds: Any) -> float:
        """Samples/s from the first batch on: the workers' start, the same for both sides and
        once per epoch in a job, is left out."""
        loader = build_loader(ds, batch, num_workers=workers)
        t, seen = 0.0, 0
        for b in loader:
            if not t:
                t = time.perf_counter()
                continue
            seen += len(b["input_ids"])
            if seen + batch >= n:
                break
        rate = seen / (time.perf_counter() - t)
        del loader
        return rate

    # at least five rounds: a pass is a fraction of a second, and the VM's pauses are as long
    got = common.alternate({"single": lambda: through(sources[0]), "blend": lambda: through(blend)}, max(repeat, 5))
    best = {k: max(v) for k, v in got.items()}
    return {"ratios": {"blend_samples_per_s_vs_single": common.ratio(best["blend"], best["single"])},
            "samples_per_s": {k: round(v) for k, v in best.items()}, "samples": got, "blend_size": len(blend)}


__all__ = ["TARGETS", "bench_blend", "bench_build"]
