"""load() and load_into(): safetensors weights into tensors at disk bandwidth.

CPU target, local files (the default): each shard (or each needed byte range of it) is mapped
copy-on-write and populated through the page cache in large windows, several in flight; the
tensors are views of the mapping. ``mapped=False`` reads by O_DIRECT into one private huge-page
arena per shard instead (see memory.py for what each costs, and docs/weights.md for the choice).
GPU target: GPUDirect Storage through kvikio when it works; otherwise windows go through a
bounded ring of pinned buffers and are copied to the device on per-thread CUDA streams while
the next windows are being read. load_into streams through the same ring into existing tensors.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from tierio import events
from tierio.errors import ConfigError, NotFoundError
from tierio.format.safetensors import TensorEntry, torch_dtype
from tierio.io import gds
from tierio.io.engine import submit
from tierio.io.numa import placement
from tierio.weights import engine, presharded, sliced
from tierio.weights.engine import Counters, Extent, Hook, Progress
from tierio.io.buffers import align_up
from tierio.weights.options import LoadOptions
from tierio.weights.record import SUM_WINDOW, checksum_hook
from tierio.weights.sources import ModelSource, Shard, resolve
from tierio.weights.stats import LoadStats
from tierio.weights.tp import TensorParallel

log = logging.getLogger(__name__)


def cpu_time() -> float:
    """CPU seconds of this process, all threads, user + system (I/O threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Timer:
    """Adds the wall and CPU seconds of a ``with`` block to ``stats``."""

    def __init__(self, stats: LoadStats) -> None:
        self.stats = stats

    def __enter__(self) -> Timer:
        self.t0, self.c0, self.b0 = time.perf_counter(), cpu_time(), self.stats.bytes
        return self

    def __exit__(self, exc_type, *exc) -> None:
        seconds = time.perf_counter() - self.t0
        self.stats.seconds += seconds
        self.stats.cpu_seconds += cpu_time() - self.c0
        if exc_type is None:
            events.emit(events.WeightsLoaded(self.stats.source, self.stats.bytes - self.b0, seconds))


def as_device(device: str | torch.device) -> torch.device:
    """The torch device a load targets (ConfigError for unknown names or missing CUDA)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r} ({exc}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for but CUDA is not available on this machine; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass
class ReadSpec:
    """One load as the reader sees it: where tensors go and how the bytes are read (from the
    caller's ``LoadOptions``, or set by the weight cache)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype | None = None
    keys: list[str] | None = None  # None: every tensor
    mapped: bool | None = None  # None: whole tensors mapped, tensor-parallel slices private
    direct: bool = True
    chunk_size: int = engine.DEFAULT_CHUNK
    depth: int = engine.DEFAULT_DEPTH
    use_gds: bool | None = None
    progress: Progress | None = None
    whole_files: bool = False  # read every byte of every shard (a cache fill must see them all)
    hook: Hook | None = None  # sees every window while it is in memory (the weight cache writes it)
    numa_node: int | None = None  # the staging ring's NUMA node (io.numa)
    shard: TensorParallel | None = None  # one tensor-parallel rank's slices (tierio.weights.tp)
    slice_gap: int | None = None  # holes read through between a strided slice's pieces (None: by source)
    merge_gap: int = engine.MERGE_GAP  # holes between wanted tensors read through rather than skipped


@dataclass
class ReadPlan:
    """What one load reads: the wanted tensors by shard, the extents holding them, and the name
    each stored tensor is returned under."""

    selected: dict[Shard, list[tuple[str, TensorEntry]]]
    extents: list[Extent]
    names: dict[tuple[int, str], str]  # (shard id, stored name) -> returned name
    order: list[str]  # returned names, in the order the caller gets them
    counters: Counters

    def tensor(self, ext: Extent, e: TensorEntry) -> str:
        return self.names[(id(ext.shard), e.name)]


def _select(src: ModelSource, keys: Iterable[str] | None) -> dict[Shard, list[tuple[str, TensorEntry]]]:
    """Wanted tensors grouped by shard, in file order."""
    table = src.tensors()
    if keys is None:
        wanted = list(table)
    else:
        wanted = list(dict.fromkeys(keys))
        missing = [k for k in wanted if k not in table]
        if missing:
            raise NotFoundError(f"{src.url} has no tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}; `tierio weights inspect` lists them")
    by_shard: dict[int, list[tuple[str, TensorEntry]]] = {}
    order: dict[int, Shard] = {}
    for name in wanted:
        shard, e = table[name]
        by_shard.setdefault(id(shard), []).append((name, e))
        order[id(shard)] = shard
    return {order[i]: sorted(v, key=lambda t: t[1].begin) for i, v in by_shard.items()}


def _view(base: torch.Tensor, off: int, e: TensorEntry, stats: LoadStats) -> torch.Tensor:
    """A tensor of ``e`` from the uint8 buffer ``base`` at byte ``off`` (copied only if misaligned)."""
    dt = torch_dtype(e.dtype)
    raw = base[off : off + e.nbytes]
    if off % dt.itemsize:
        raw = raw.clone()  # a fresh allocation is aligned; views of misaligned bytes are not allowed
        stats.copied_tensors += 1
    return raw.view(dt).view(e.shape)


def _convert(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # Only floating-point tensors change dtype (integer ids, masks and counters keep theirs),
    # as transformers does for torch_dtype.
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def load(
    source: str | Any,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keys: Iterable[str] | None = None,
    options: LoadOptions | None = None,
    shard: TensorParallel | None = None,
    **overrides: Any,
) -> dict[str, torch.Tensor]:
    """Load tensors from a .safetensors file, a model directory, a tierio checkpoint or an s3:// URL.

    ``keys`` limits the load to those tensors (only their byte ranges are read); ``dtype``
    converts floating-point tensors; ``shard`` (a :class:`~tierio.weights.tp.TensorParallel`)
    loads one tensor-parallel rank's part of every tensor, reading only its byte ranges;
    ``options`` (or keyword overrides of its fields, see :class:`LoadOptions`): ``stats`` (a LoadStats) receives bytes, seconds and CPU time;
    ``progress(done, total)`` is called from the reader threads as each window of bytes lands.

    ``mapped`` chooses the memory CPU tensors of local files live in. ``True`` (the default for
    whole tensors): copy-on-write views of the files, populated through the page cache in parallel
    before returning; several processes loading the same model share its pages, and writing to a
    tensor copies only that page. Files must then not be truncated or rewritten in place while the
    tensors live (replacing them by a rename, as tierio's writers and weight cache do, is safe).
    ``False``: private memory filled by O_DIRECT reads (``direct=False``: through the page cache),
    independent of the files; it costs more CPU, most of it spent faulting in the new memory. It is
    the default for a tensor-parallel rank's slices: a rank's small, scattered ranges read through
    the mapping took twice as long as by O_DIRECT into private memory (docs/weights.md).
    GPU targets and remote sources ignore ``mapped``.
    """
    o = LoadOptions.resolve(options, overrides)
    stats = o.stats if o.stats is not None else LoadStats()
    opts = ReadSpec(as_device(device), dtype, list(keys) if keys is not None else None, mapped=o.mapped, direct=o.direct,
                    chunk_size=int(o.chunk_bytes), depth=o.depth, use_gds=o.use_gds, progress=o.progress, shard=shard,
                    slice_gap=o.slice_gap_bytes, numa_node=staging_node(o, stats))
    with Timer(stats):
        src, opts = _source(source, opts, stats)
        out = load_resolved(src, opts, stats)
    return out


def staging_node(o: LoadOptions, stats: LoadStats) -> int | None:
    """The NUMA node the staging ring is placed on, and the placement reported in the stats."""
    if o.numa_node is None:
        return None
    where = placement(o.numa_node)
    stats.extra["staging_numa"] = where.to_dict()
    return where.node


def _source(source: str | Any, opts: ReadSpec, stats: LoadStats) -> tuple[ModelSource, ReadSpec]:
    """The source to read; a rank of a pre-sharded directory reads its own file whole, each window
    checked against the index's xxh3 while it is in memory."""
    root = presharded.is_presharded(source) if opts.shard is not None else None
    if root is None:
        return (source if isinstance(source, ModelSource) else resolve(source)), opts
    assert opts.shard is not None
    src, record = presharded.open_rank(root, opts.shard)
    stats.extra["tp"] = f"rank {opts.shard.rank} of {opts.shard.size} (pre-sharded)"
    hook = checksum_hook(record, "pre-sharded", "re-shard the model (tierio weights shard)")
    chunk = align_up(opts.chunk_size, SUM_WINDOW)  # whole checksum windows
    return src, ReadSpec(**{**vars(opts), "shard": None, "whole_files": True, "hook": hook, "chunk_size": chunk})


def load_resolved(src: ModelSource, opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor]:
    """The loader proper, for an already resolved source: plan the reads, read them into the
    memory the target wants, then name, convert and order the tensors."""
    if opts.shard is not None:
        return _load_sliced(src, opts, stats)
    return _read_plan(plan_reads(src, opts), src, opts, stats)


def _read_plan(plan: ReadPlan, src: ModelSource, opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor]:
    stats.source = stats.source or src.url
    stats.device = str(opts.device)
    out = None
    if opts.device.type == "cpu" and opts.mapped is not False:
        out = _read_mapped(plan, src, opts, stats)
    if out is None and opts.device.type == "cuda":
        out = _load_cuda(plan, opts, stats)
    elif out is None:
        out = _read_arenas(plan, opts, stats)
    return _finish(plan, out, opts, stats)


def _load_sliced(src: ModelSource, opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor]:
    """One tensor-parallel rank's slices: contiguous ones through the plain loader as narrower
    entries, strided ones through ``sliced.read_strided``; then converted and ordered."""
    assert opts.shard is not None
    spec = sliced.with_rules(opts.shard, src)
    names = list(dict.fromkeys(opts.keys)) if opts.keys is not None else list(src.tensors())
    how = sliced.split(src, spec, names, opts.slice_gap)
    # the slices' holes are read through by the same measured gap as a strided slice's
    gap = opts.slice_gap if opts.slice_gap is not None else sliced.default_gap(src.shards[0])
    # slices go to private memory unless mapping is asked for: read through the mapping, a rank's
    # smaller, scattered ranges took twice as long (docs/weights.md, "tensor parallel")
    whole = ReadSpec(**{**vars(opts), "dtype": None, "keys": None, "shard": None, "merge_gap": gap,
                        "mapped": opts.mapped is True})
    # The strided slices' small reads wait on the device's latency, the contiguous ones on its
    # bandwidth: both run at once (on the shared pool, whose nested waits cannot deadlock).
    strided = submit(partial(sliced.read_strided, how.strided, chunk_size=opts.chunk_size, depth=opts.depth,
                             direct=opts.direct, gap=opts.slice_gap)) if how.strided else None
    try:
        out = dict(_read_plan(plan_reads(src, whole, how.selected), src, whole, stats)) if how.selected else {}
    except BaseException:
        if strided is not None:
            strided.settle()
        raise
    for name, take in how.cuts.items():
        out[name] = sliced.cut(out[name], take)
    if strided is not None:
        counters = strided.result()
        sliced.assemble(out, how.strided, opts.device)
        stats.add_read(counters, files=0)
        stats.tensors += len(how.strided)
    stats.extra["tp"] = f"rank {spec.rank} of {spec.size}"
    return {n: _convert(out[n], opts.dtype) for n in names}


def plan_reads(src: ModelSource, opts: ReadSpec, selected: dict[Shard, list[tuple[str, TensorEntry]]] | None = None) -> ReadPlan:
    """The extents to read for ``opts.keys`` (every byte of every shard with ``whole_files``), or
    for the entries ``selected`` by shard (a tensor-parallel rank's slices)."""
    if selected is None:
        selected = _select(src, opts.keys)
    extents: list[Extent] = []
    names: dict[tuple[int, str], str] = {}
    for shard, items in selected.items():
        extents += engine.plan_extents(shard, [e for _, e in items], whole_file=opts.whole_files, merge_gap=opts.merge_gap)
        for name, e in items:
            names[(id(shard), e.name)] = name
    if opts.whole_files:  # the cache fill must see every byte, also of shards holding no wanted tensor
        have = {id(s) for s in selected}
        extents += [engine.Extent(s, 0, s.size) for s in src.shards if id(s) not in have and s.size]
    engine.check_entries_fit(extents)
    order = list(dict.fromkeys(opts.keys)) if opts.keys is not None else [n for items in selected.values() for n, _ in items]
    counters = Counters(total=sum(x.end - x.start for x in extents), progress=opts.progress)
    return ReadPlan(selected, extents, names, order, counters)


def _read_mapped(plan: ReadPlan, src: ModelSource, opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor] | None:
    """CPU tensors as views of copy-on-write mappings of local files; None when not possible."""
    if not all(x.shard.path is not None for x in plan.extents):
        return None
    try:
        maps = engine.map_extents(plan.extents, chunk_size=opts.chunk_size, depth=opts.depth, hook=opts.hook,
                                  counters=plan.counters)
    except OSError as exc:  # a filesystem that cannot map files (some FUSE mounts): read instead
        log.warning("cannot map %s (%s); reading into private memory instead", src.url, exc)
        return None
    stats.method = "mapped"
    out: dict[str, torch.Tensor] = {}
    for ext, m in zip(plan.extents, maps):
        base = m.tensor()
        for e in ext.entries:
            out[plan.tensor(ext, e)] = _view(base, ext.offset_of(e), e, stats)
    return out


def _read_arenas(plan: ReadPlan, opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor]:
    """Tensors in private host memory (one arena per extent); moved to the device if it is not the CPU."""
    stats.method = "host-arena"
    arenas = engine.read_to_arenas(plan.extents, chunk_size=opts.chunk_size, depth=opts.depth, direct=opts.direct,
                                   hook=opts.hook, counters=plan.counters)
    out: dict[str, torch.Tensor] = {}
    for ext, arena in zip(plan.extents, arenas):
        if not ext.entries:
            continue
        base = arena.tensor()
        for e in ext.entries:
            t = _view(base, ext.offset_of(e), e, stats)
            out[plan.tensor(ext, e)] = t if opts.device.type == "cpu" else t.to(opts.device)
    return out


def _finish(plan: ReadPlan, out: dict[str, torch.Tensor], opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor]:
    for items in plan.selected.values():  # empty tensors own no bytes in the file
        for name, e in items:
            if e.nbytes == 0:
                out[name] = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=opts.device)
    ordered = {name: _convert(out[name], opts.dtype) for name in plan.order}
    stats.tensors += len(ordered)
    stats.add_read(plan.counters, files=len({id(x.shard) for x in plan.extents}))
    return ordered


# -- GPU ---------------------------------------------------------------------------------------
_streams = threading.local()


def _thread_stream(dev: torch.device):
    s = getattr(_streams, "s", None)
    if s is None or s.device != dev:
        s = torch.cuda.Stream(device=dev)
        _streams.s = s
    return s


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy pinned host bytes to the device on this thread's stream and wait for it (the staging
    buffer is reused right after); other threads keep reading meanwhile."""
    stream = _thread_stream(dst.device)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()


def _load_cuda(plan: ReadPlan, opts: ReadSpec, stats: LoadStats) -> dict[str, torch.Tensor]:
    dev = opts.device
    dev_bufs = [torch.empty(ext.capacity, dtype=torch.uint8, device=dev) for ext in plan.extents]
    by_ext = {id(e): b for e, b in zip(plan.extents, dev_bufs)}
    if not _read_gds(plan, dev_bufs, opts, stats):
        stats.method = "pinned-ring"

        def sink(ext: Extent, rel: int, view: memoryview, n: int, buf) -> None:
            copy_to_device(by_ext[id(ext)][rel : rel + n], buf.tensor()[:n])

        engine.read_through_ring(plan.extents, sink, chunk_size=opts.chunk_size, depth=opts.depth, direct=opts.direct,
                                 hook=opts.hook, counters=plan.counters, numa_node=opts.numa_node)
    torch.cuda.synchronize(dev)
    out = {}
    for ext, base in zip(plan.extents, dev_bufs):
        for e in ext.entries:
            out[plan.tensor(ext, e)] = _view(base, ext.offset_of(e), e, stats)
    return out


def _read_gds(plan: ReadPlan, dev_bufs: list[torch.Tensor], opts: ReadSpec, stats: LoadStats) -> bool:
    """GPUDirect Storage reads of local files straight into device memory; False to use the ring."""
    want = gds.available() if opts.use_gds is None else (opts.use_gds and gds.available())
    if not want or opts.hook is not None or not all(x.shard.path is not None for x in plan.extents):
        return False
    try:
        for ext, buf in zip(plan.extents, dev_bufs):
            n = ext.end - ext.start
            got = gds.read_to_device(ext.shard.path, buf[:n], ext.start)
            if got != n:
                raise OSError(f"short GDS read of {ext.shard.where}: {got} of {n} bytes")
            plan.counters.add("direct_bytes", n)
    except Exception as exc:  # kvikio present but not working: say so once and fall back
        log.warning("GPUDirect Storage read failed (%s); using the pinned staging ring", exc)
        plan.counters.direct_bytes = 0  # the ring reads every extent again
        return False
    stats.method = "gds"
    return True


def first_use(tensors: Mapping[str, torch.Tensor], stats: LoadStats | None = None) -> float:
    """One pass over every tensor, one read per page: what a server's first forward pass (or copy
    to the device) meets first. Returns its seconds and adds them to ``stats.first_use_seconds``."""
    t0 = time.perf_counter()
    for t in tensors.values():
        if t.numel() and t.device.type == "cpu":
            t.reshape(-1).view(torch.uint8)[::4096].sum()
    seconds = time.perf_counter() - t0
    if stats is not None:
        stats.first_use_seconds += seconds
    return seconds


# -- inspect -----------------------------------------------------------------------------------
def inspect(source: str | Any) -> dict[str, Any]:
    """Shards, tensors (dtype, shape, bytes) and totals of a source, from headers only."""
    src = source if isinstance(source, ModelSource) else resolve(source)
    table = src.tensors()
    return {
        "source": src.url,
        "kind": src.kind,
        "files": [{"file": s.key, "bytes": s.size, "tensors": len(s.header.tensors), "metadata": s.header.metadata} for s in src.shards],
        "tensors": {n: {"dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes, "file": s.key} for n, (s, e) in table.items()},
        "total_bytes": src.total_bytes,
        "tensor_bytes": sum(e.nbytes for _, e in table.values()),
    }


__all__ = ["LoadOptions", "LoadStats", "ReadSpec", "Timer", "as_device", "copy_to_device", "first_use", "inspect", "load", "load_resolved"]
