"""Preparing a corpus on Ray (``pip install 'tierio[ray]'``): one part per input file, built in Ray
tasks, published atomically, named in input order by a manifest written from the records.

``build_on_ray(inputs, out)`` plans the parts on the driver (file names and sizes only), skips the
parts whose record in ``out`` matches their input and settings, and runs one Ray task per part
left, ``workers`` at a time. Each task tokenizes its input (a Hugging Face ``tokenizers``
tokenizer, or token ids) with the in-process builder into a scratch directory, then publishes the
part (``tierio.data.parts``). A task that dies is run again by Ray (``retries``): its part's bytes
depend only on its input, so the result is the same, byte for byte, and nothing half-written is
ever listed. The finishing step on the driver sees only the tasks' records, never a token: it
writes ``parts.json``. With no ``address``, ``ray.init`` starts a local Ray of ``workers`` CPUs.

``TokenPartsDatasink`` is the same build as a Ray Data sink, for a pipeline that already has a
dataset of part specs: ``ds.write_datasink(TokenPartsDatasink(out, settings))``. ``build_on_ray``
schedules its tasks itself: Ray Data's resource budget admits one write task until the first has
finished (measured: the second worker started 1 s into an 8 s build of 8 parts on 2 CPUs).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.data import Datasink

from tierio.data.builder import build_inputs
from tierio.data.documents import load_tokenizer
from tierio.data.options import RayBuildOptions
from tierio.data.parts import (
    MANIFEST_KEY, PartRecord, PartSettings, PartSpec, manifest_of, plan_parts, publish_part, read_record,
)
from tierio.errors import ConfigError
from tierio.stats import Stats
from tierio.storage.url import as_store

log = logging.getLogger(__name__)


@dataclass
class PartsBuildStats(Stats):
    """What a build did: parts built and skipped, totals, the rate, and what the finishing step moved."""

    output: str
    parts: int
    built: int
    skipped: int
    documents: int
    tokens: int
    token_bytes: int
    dtype: str
    seconds: float
    tokens_per_s: float
    finish_bytes: int  # bytes the finishing step read and wrote (records in, manifest out)


@dataclass
class BuildProgress(Stats):
    """Parts published so far (of ``parts``), their documents and tokens, and the rate since the start."""

    done: int
    parts: int
    documents: int
    tokens: int
    tokens_per_s: float


def build_part(spec: PartSpec, settings: PartSettings, out_url: str, scratch: str | None) -> PartRecord:
    """Build one part from its input with the in-process builder and publish it (runs in a Ray task)."""
    parquet = None
    if settings.column is not None or settings.text_column is not None:
        from tierio.data.parquet import ParquetColumns

        parquet = ParquetColumns(ids=settings.column, text=settings.text_column, tokenizer=settings.tokenizer,
                                 append_eos=settings.append_eos)
    with tempfile.TemporaryDirectory(prefix=f"{spec.name}-", dir=scratch) as tmp:
        prefix = Path(tmp) / spec.name
        st = build_inputs([spec.input], prefix, vocab_size=settings.vocab_size, parquet=parquet, key=settings.key,
                          tokenizer=settings.tokenizer, text_key=settings.text_key, append_eos=settings.append_eos)
        return publish_part(as_store(out_url), spec, prefix, st.dtype, (st.documents, st.sequences, st.tokens))


class TokenPartsDatasink(Datasink):
    """A Ray Data sink whose rows are parts to build (``PartSpec`` fields); each write task builds
    and publishes its parts, and the driver writes ``parts.json`` from the records they return.

    ``published``: records of parts already there (a rerun's skipped parts), named in the manifest too."""

    def __init__(self, out_url: str, settings: PartSettings, scratch: str | None = None,
                 published: Sequence[PartRecord] = ()) -> None:
        self.out_url = out_url
        self.settings = settings
        self.scratch = scratch
        self.published = list(published)
        self.records: list[PartRecord] = []
        self.manifest_bytes = 0

    @staticmethod
    def rows(specs: Iterable[PartSpec]) -> list[dict[str, Any]]:
        """The dataset rows of these parts, for ``ray.data.from_items(rows, override_num_blocks=len(rows))``."""
        return [{"index": s.index, "input": s.input, "fingerprint": s.fingerprint} for s in specs]

    def get_name(self) -> str:
        return "TokenParts"

    def write(self, blocks: Iterable[Any], ctx: Any) -> list[dict[str, Any]]:
        out = []
        for block in blocks:
            for row in block.to_pylist() if hasattr(block, "to_pylist") else block.to_dict("records"):
                spec = PartSpec(int(row["index"]), str(row["input"]), str(row["fingerprint"]))
                out.append(build_part(spec, self.settings, self.out_url, self.scratch).to_dict())
        return out

    def on_write_complete(self, write_result: Any) -> None:
        returns = write_result.write_returns if hasattr(write_result, "write_returns") else write_result
        self.records = [PartRecord(**r) for batch in returns for r in batch]
        man = manifest_of(self.published + self.records)
        raw = man.to_bytes()
        as_store(self.out_url).put_buffers(MANIFEST_KEY, [raw])
        self.manifest_bytes = len(raw)


def _build_one(spec: PartSpec, settings: PartSettings, out_url: str, scratch: str | None) -> dict[str, Any]:
    return build_part(spec, settings, out_url, scratch).to_dict()


def _run_tasks(todo: Sequence[PartSpec], sink: TokenPartsDatasink, workers: int, retries: int) -> list[dict[str, Any]]:
    """One Ray task per part, at most ``workers`` in flight (one CPU each); their records, in the
    order they finished. A failed task cancels the others and raises its error (parts already
    published stay: a rerun skips them)."""
    task = ray.remote(_build_one).options(num_cpus=1, max_retries=retries)
    queue, running, records = list(todo), [], []
    try:
        while queue or running:
            while queue and len(running) < max(1, workers):
                running.append(task.remote(queue.pop(0), sink.settings, sink.out_url, sink.scratch))
            done, running = ray.wait(running, num_returns=1)
            records += ray.get(done)
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        raise
    return records


def build_on_ray(inputs: Sequence[str | Path], out: str | Path, options: RayBuildOptions | None = None,
                 **overrides: Any) -> PartsBuildStats:
    """Build ``inputs`` (files or directories; one part per file) into the parts dataset ``out`` (a
    directory or a store URL) on Ray. See the module doc and ``RayBuildOptions``."""
    o = RayBuildOptions.resolve(options, overrides)
    settings = _settings(o)
    store = as_store(out)
    specs = plan_parts(inputs, settings)
    t0 = time.perf_counter()
    done: list[PartRecord] = []
    todo: list[PartSpec] = []
    listed = set(store.list("part-"))  # one listing, then a read per record that exists
    for spec in specs:  # a part whose record matches its input is already built
        rec = read_record(store, spec.name) if f"{spec.name}.json" in listed else None
        if rec is not None and rec.fingerprint == spec.fingerprint:
            done.append(rec)
        else:
            todo.append(spec)
    finish_read = sum(len(r.to_bytes()) for r in done)
    sink = TokenPartsDatasink(store.url, settings, o.scratch_dir, done)
    started = _connect(o)
    watcher = _Progress(store, [s.name for s in specs], o.progress, t0)
    try:
        sink.on_write_complete([_run_tasks(todo, sink, o.workers, o.retries)])
    finally:
        watcher.stop()
        if started:
            ray.shutdown()
    return _stats(store.url, sink, time.perf_counter() - t0, finish_read)


def _settings(o: RayBuildOptions) -> PartSettings:
    vocab = o.vocab_size
    if vocab is None and o.tokenizer is not None:  # one dtype for every part, from the tokenizer
        vocab = max(load_tokenizer(o.tokenizer).get_vocab_size(), (o.append_eos or 0) + 1)
    if vocab is None:
        raise ConfigError("a parts build needs the vocabulary size to give every part one token dtype: pass "
                          "--vocab-size (or --tokenizer, whose vocabulary is used)")
    return PartSettings(o.key, None if o.tokenizer is None else str(o.tokenizer), o.text_key, o.column,
                        o.text_column, vocab, o.append_eos)


def _connect(o: RayBuildOptions) -> bool:
    """Use the Ray this process is connected to, or connect to ``address``, or start a local one."""
    if ray.is_initialized():
        return False
    ray.init(address=o.address, num_cpus=None if o.address else o.workers, include_dashboard=False,
             log_to_driver=False, logging_level=logging.WARNING)
    return True


def _stats(url: str, sink: TokenPartsDatasink, seconds: float, finish_read: int) -> PartsBuildStats:
    man = manifest_of(sink.published + sink.records)
    token_bytes = sum(r.bin_bytes for r in man.parts)
    return PartsBuildStats(url, len(man.parts), len(sink.records), len(sink.published), man.documents, man.tokens,
                           token_bytes, man.dtype, round(seconds, 3), round(man.tokens / seconds, 1) if seconds else 0.0,
                           finish_read + sink.manifest_bytes)


class _Progress:
    """Reports parts as their records appear in the output (one listing a second, each record read once)."""

    def __init__(self, store: Any, names: list[str], report: Callable[[BuildProgress], None] | None, t0: float) -> None:
        self.store, self.names, self.report, self.t0 = store, set(names), report, t0
        self.total = len(names)
        self.seen: dict[str, PartRecord] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierio-ray-build-progress", daemon=True)
        if report is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        try:
            new = [k[:-5] for k in self.store.list("part-") if k.endswith(".json") and k[:-5] in self.names
                   and k[:-5] not in self.seen]
            for name in new:
                rec = read_record(self.store, name)
                if rec is not None:
                    self.seen[name] = rec
        except Exception as e:  # progress is advice: a failed listing must not fail the build
            log.debug("progress listing failed: %s", e)
            return
        docs = sum(r.documents for r in self.seen.values())
        tokens = sum(r.tokens for r in self.seen.values())
        dt = time.perf_counter() - self.t0
        self.report(BuildProgress(len(self.seen), self.total, docs, tokens, tokens / dt if dt > 0 else 0.0))

    def stop(self) -> None:
        if self.report is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()


__all__ = ["BuildProgress", "PartsBuildStats", "TokenPartsDatasink", "build_on_ray", "build_part"]
