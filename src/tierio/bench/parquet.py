"""`tierio bench parquet`: building a token dataset from Parquet against reading the column with pyarrow alone.

One corpus written by pyarrow in the run: documents of 200-2000 random token ids (so nothing
compresses them away) in a list<int32> column, row groups of 5,000 documents. Both sides read
the same file from the page cache (it is read once, untimed, first), so the ratio shows what the
build adds to the read: the checks, the conversion, writing and syncing the .bin/.idx pair, and
the narrowing to uint16 when no vocabulary size is given.

  parquet_build_vs_pyarrow_read   tokens/s of `tierio data build FILE OUT --column input_ids`
                                  ÷ tokens/s of pyarrow reading the column into numpy, the faster
                                  of ParquetFile.iter_batches and the multi-threaded read_table
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierio.bench import common
from tierio.errors import ConfigError

TARGETS = {"parquet_build_vs_pyarrow_read": (">=", 0.5)}
COLUMN = "input_ids"


def write_corpus(path: Path, tokens: int, seed: int = 0) -> dict[str, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 2000, size=max(1, tokens // 1100))
    ids = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    table = pa.table({COLUMN: pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))})
    pq.write_table(table, path, row_group_size=5000)
    return {"documents": len(lengths), "tokens": len(ids), "file_bytes": path.stat().st_size}


def pyarrow_read(path: Path) -> dict[str, float]:
    """Seconds for pyarrow alone to bring the column's token ids into numpy, both ways."""
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=16384, columns=[COLUMN]):
        n += len(batch.column(0).flatten().to_numpy())
    batches = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = pq.read_table(path, columns=[COLUMN])
    m = sum(len(chunk.flatten().to_numpy()) for chunk in table.column(0).chunks)
    whole = time.perf_counter() - t0
    assert n == m
    return {"iter_batches_s": batches, "read_table_s": whole}


def tierio_build(path: Path, out: Path, vocab_size: int | None) -> float:
    from tierio.data.builder import build_inputs
    from tierio.data.parquet import ParquetColumns

    t0 = time.perf_counter()
    build_inputs([str(path)], out, vocab_size=vocab_size, parquet=ParquetColumns(ids=COLUMN))
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.tokens < 10_000 or args.repeat < 1:
        raise ConfigError("--tokens must be at least 10,000 and --repeat at least 1")
    work = common.work_dir(args.dir, "parquet")
    log = common.logger("parquet")
    try:
        corpus = work / "corpus.parquet"
        log(f"writing {args.tokens:,} tokens with pyarrow")
        facts = write_corpus(corpus, args.tokens)
        pyarrow_read(corpus)  # untimed: the file is in the page cache for both sides from here on
        reads, builds = [], []
        for i in range(args.repeat):
            log(f"round {i + 1}/{args.repeat}: pyarrow read, tierio build")
            reads.append(min(pyarrow_read(corpus).values()))
            builds.append(tierio_build(corpus, work / f"out{i}", args.vocab_size))
            for suffix in (".bin", ".idx"):
                (work / f"out{i}{suffix}").unlink(missing_ok=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    read_s, build_s = statistics.median(reads), statistics.median(builds)
    tokens = facts["tokens"]
    ratios = {"parquet_build_vs_pyarrow_read": (tokens / build_s) / (tokens / read_s)}
    return {
        "benchmark": "parquet",
        "directory": str(work),
        "machine": common.machine_facts(),
        **facts,
        "vocab_size": args.vocab_size,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "met": common.check_targets(ratios, TARGETS),
        "pyarrow_read_s": read_s,
        "pyarrow_tokens_per_s": tokens / read_s,
        "build_s": build_s,
        "build_tokens_per_s": tokens / build_s,
    }
