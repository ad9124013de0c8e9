"""WeightCache: a local NVMe copy of models that live on slow or remote storage (S3, NFS, Lustre).

A thin user of the node-local cache (:class:`tierio.storage.cache.NodeCache`), which owns pins,
least-recently-used eviction, reservations, atomic fills and fork safety. An entry is a directory
holding the model's files under their relative names at the source, plus a record::

    entries/<name>/                       the model's files (name derived from the URL by the cache)
    entries/<name>/.tierio-cache.json     the record: source, kind, sizes, source mtimes, window xxh3
    locks/<name>.lock                     shared while a process loads the model, exclusive to fill it

Pipelined fill: the shards are downloaded in ordered windows with several ranged GETs in
flight into the reused staging ring; every window is checksummed and written to the cache file
by O_DIRECT while it is in memory, and then:

* CPU loads (mapped, the default): the kernel is asked to read the written window back into the
  page cache in the background, so when the download ends the cache files are resident
  and the tensors are mapped views of them. No memory is zeroed and the CPU copies nothing but
  the socket reads, which counts where the download shares its cores with the network stack.
* GPU loads: the window is also copied to the device from the staging buffer.
* ``mapped=False`` CPU loads: the download lands in private memory (an arena per shard) and is
  written from there.

Verification: a fill is committed only if every file has the source's size and the copy parses to
the same tensors as the source; each window's xxh3 is recorded, so ``verify="full"`` can re-check
a cached copy later. Hostile input: every name of the source's listing is checked before any
directory is made (a name that could leave the entry is a FormatError), and the record is read as
untrusted bytes (bounded JSON, typed fields, relative names only): a damaged record is a miss.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError, StoreUnavailableError, os_error
from tierio.format.shard import MANIFEST, parse_record_name
from tierio.io.durable import fsync_tree, write_new_synced
from tierio.io.paths import open_beneath
from tierio.storage.base import check_key, list_sizes, read_bytes
from tierio.stats import Stats
from tierio.storage.download import WindowWriter
from tierio.storage.cache import CacheOptions, FillPlan, NodeCache, entry_name, make_parents
from tierio.weights import engine
from tierio.weights.engine import Progress
from tierio.weights.loader import LoadStats, ReadSpec, Timer, as_device, load_resolved
from tierio.weights.options import LoadOptions
# The record moved to weights.record; its names stay importable from here.
from tierio.weights.record import (KINDS, MAX_FILES, RECORD, RECORD_LIMIT, SUM_WINDOW, VERSION,  # noqa: F401
                                   CacheRecord, FileRecord, checksum_hook, stale_reason)
from tierio.weights.sources import ModelSource, Shard, resolve
from tierio.units import parse_size

log = logging.getLogger(__name__)
# The files beside the shards worth caching: what a load, a tokenizer or a generation config reads.
# Nothing else of a model directory is copied (optimizer states, READMEs, planted files).
COMPANIONS = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "sentencepiece.bpe.model", "preprocessor_config.json", "chat_template.json", "chat_template.jinja",
})
MAX_COMPANION_BYTES = 256 << 20  # the largest tokenizers are tens of MB; anything bigger is not one


@dataclass
class CacheEntry(Stats):
    name: str
    source: str  # empty when the entry's record cannot be read
    bytes: int
    last_used: float
    path: Path


def _wanted_companion(src: ModelSource, key: str) -> bool:
    """An allow-listed file in the shards' directory: configs, tokenizer files, a ``*.index.json``;
    for a tierio checkpoint, its step's manifest and rank records (what resolving the copy reads)."""
    folder, _, name = key.rpartition("/")
    if folder != src.shards[0].key.rpartition("/")[0]:
        return False
    if src.kind == "tierio":
        return name == MANIFEST or parse_record_name(name) is not None
    return name in COMPANIONS or name.endswith(".index.json")


def companion_sizes(src: ModelSource) -> dict[str, int]:
    """The companion files a fill copies, with their sizes at the source (counted in the fill's
    reservation). A local file that is a symbolic link (or passes through one), or is not a
    regular file, is skipped with a warning: a link planted in a shared model directory must not
    bring its target into the node cache."""
    shard_keys = {s.key for s in src.shards}
    keys = [k for k in src.keys if k not in shard_keys and _wanted_companion(src, k)]
    if src.store is not None:
        sizes = list_sizes(src.store, "")
        found = {k: sizes[k] for k in keys if k in sizes}
    else:
        found = {}
        for k in keys:
            try:
                fd = open_beneath(src.root, k, os.O_RDONLY)  # type: ignore[arg-type]
            except (FormatError, NotFoundError) as exc:
                log.warning("not caching %s/%s: %s", src.root, k, exc)
                continue
            try:
                found[k] = os.fstat(fd).st_size
            finally:
                os.close(fd)
    for k, size in list(found.items()):
        if size > MAX_COMPANION_BYTES:
            log.warning("not caching %s/%s: %d bytes is more than a config or tokenizer file holds", src.url, k, size)
            del found[k]
    return found


def _read_companion(src: ModelSource, key: str, size: int) -> bytes:
    """A companion's bytes, exactly the ``size`` planned (opened without following a link)."""
    if src.store is not None:
        data = read_bytes(src.store, key, 0, size)
    else:
        fd = open_beneath(src.root, key, os.O_RDONLY)  # type: ignore[arg-type]
        try:
            data = os.pread(fd, size + 1, 0)
        except OSError as exc:
            raise os_error(exc, f"{src.root}/{key}", "reading") from exc
        finally:
            os.close(fd)
    if len(data) != size:
        raise IntegrityError(f"{src.url}/{key} changed size during the cache fill ({size} -> {len(data)} bytes); fetch again")
    return data


def check_listing(src: ModelSource) -> None:
    """Every name the fill will write must stay inside the entry: checked before any directory is made."""
    where = f"the listing of {src.url}"
    for key in [*src.keys, *(s.key for s in src.shards)]:
        check_key(key, where)
    if not src.shards:
        raise NotFoundError(f"{src.url} holds no tensor files to cache")


# -- one request through the cache ----------------------------------------------------------------
@dataclass(frozen=True)
class CacheLoad:
    """A load through the cache: the load options, and how a hit is verified ("size" or "full")."""

    options: ReadSpec
    verify: str = "size"

    @property
    def maps_after_fill(self) -> bool:
        """CPU loads that map the files need only the download written; they map the entry after."""
        return self.options.device.type == "cpu" and self.options.mapped is not False


class CacheRequest:
    """One fetch or load through the cache, as named steps: a hit is checked (``usable``) and
    loaded (``load_hit``); a miss is planned (``plan``), written (``write``: companion files,
    then the shards downloaded through the writers), verified and recorded (``verify``), and
    loaded (the tensors of the fill, or ``map_filled``)."""

    def __init__(self, cache: WeightCache, url: str, load: CacheLoad | None, stats: LoadStats,
                 progress: Progress | None) -> None:
        self.cache, self.url, self.load, self.stats, self.progress = cache, url, load, stats, progress
        self.src: ModelSource | None = None  # resolved on a miss
        self.record: CacheRecord | None = None  # of the entry used
        self.tensors: dict[str, torch.Tensor] | None = None  # loaded while filling
        self._files: dict[str, FileRecord] = {}
        self._companions: dict[str, int] = {}  # planned companion files -> size at the source
        self._checked_source: list[ModelSource | None] = []

    # -- a hit ------------------------------------------------------------------------------------
    def usable(self, entry: Path) -> bool:
        try:
            record = CacheRecord.read(entry)
        except (NotFoundError, FormatError) as exc:
            log.warning("cached copy of %s has no usable record (%s); fetching it again", self.url, exc)
            return False
        why = stale_reason(record, entry, self._source_now())
        if why is not None:
            log.info("cached copy of %s is stale (%s); fetching again", self.url, why)
            return False
        self.record = record
        return True

    def _source_now(self) -> ModelSource | None:
        """The source's sizes and mtimes (once per request), or None when not checked or unreachable."""
        if not self._checked_source:
            src = None
            if self.cache.check_source:
                try:
                    src = resolve(self.url, read_headers=False)
                except (StoreUnavailableError, OSError) as exc:
                    log.warning("source %s unreachable (%s); using the cached copy as is", self.url, exc)
            self._checked_source.append(src)
        return self._checked_source[0]

    def load_hit(self, entry: Path, record: CacheRecord) -> dict[str, torch.Tensor]:
        assert self.load is not None
        full = self.load.verify == "full"
        opts = replace(self.load.options, chunk_size=record.chunk, depth=self.cache.depth, whole_files=full,
                       hook=checksum_hook(record) if full else None, progress=self.progress)
        return load_resolved(resolve(record.local_path(entry)), opts, self.stats)

    # -- a miss -----------------------------------------------------------------------------------
    def plan(self) -> FillPlan:
        src = self.src or resolve(self.url)  # a group's fill has resolved it already
        check_listing(src)
        self.src = src
        self._companions = companion_sizes(src)
        size = src.total_bytes + sum(self._companions.values())  # every byte the fill writes is reserved
        return FillPlan(size, self.write, f"model {self.url}", verify=self.verify)

    def write(self, target: Path) -> None:
        """The fill: companion files first, then every shard through its writer."""
        assert self.src is not None
        self._files = self._copy_companions(target)
        writers = {id(s): WindowWriter(make_parents(target, s.key, self.src.url), direct=True,
                                       prefetch=self.load is not None and self.load.maps_after_fill)
                   for s in self.src.shards}
        try:
            self._download(writers)
            for s in self.src.shards:
                w = writers.pop(id(s))
                w.close(s.size)  # drop the O_DIRECT padding of the last window
                if w.written != s.size:
                    raise IntegrityError(f"cache copy of {s.where} got {w.written} of {s.size} bytes")
                self._files[s.key] = FileRecord(s.size, s.mtime, dict(sorted(w.sums.items())))
        finally:
            for w in writers.values():
                w.abort()

    def _copy_companions(self, target: Path) -> dict[str, FileRecord]:
        """The allow-listed small files beside the shards (see ``companion_sizes``), each written
        and fsynced before the entry can be published."""
        src = self.src
        assert src is not None
        out = {}
        for key, size in self._companions.items():
            write_new_synced(make_parents(target, key, src.url), _read_companion(src, key, size))
            out[key] = FileRecord(size)
        return out

    def _download(self, writers: dict[int, WindowWriter]) -> None:
        src, cache, stats = self.src, self.cache, self.stats
        assert src is not None

        def hook(shard: Shard, offset: int, view: memoryview, n: int) -> None:
            writers[id(shard)].write(offset, view, n)

        if self.load is None or self.load.maps_after_fill:
            extents = [engine.Extent(s, 0, s.size) for s in src.shards if s.size]
            counters = engine.Counters(total=sum(x.end for x in extents), progress=self.progress)
            engine.read_through_ring(extents, None, chunk_size=cache.chunk_size, depth=cache.depth, hook=hook,
                                     counters=counters)
            stats.add_read(counters, len(src.shards))  # each way counted: a local source reads O_DIRECT or buffered
            stats.method = "cache-fill"
        else:
            opts = replace(self.load.options, chunk_size=cache.chunk_size, depth=cache.depth, whole_files=True,
                           hook=hook, progress=self.progress)
            self.tensors = load_resolved(src, opts, stats)
            stats.method += "+cache-fill"

    def verify(self, target: Path) -> None:
        """The copy must parse to the source's tensors; then the record commits what was checked."""
        src = self.src
        assert src is not None
        record = CacheRecord(self.url, src.kind, self._files, [s.key for s in src.shards], self.cache.chunk_size, time.time())
        got = {s.key: s.header.tensors for s in resolve(record.local_path(target)).shards}  # type: ignore[union-attr]
        for s in src.shards:
            if got.get(s.key) != s.header.tensors:  # type: ignore[union-attr]
                raise IntegrityError(f"cache copy of {s.where} has a different header than the source; the source changed during the copy")
        write_new_synced(target / RECORD, record.to_json().encode())
        try:
            fsync_tree(target)  # the names of every file; the cache's rename then publishes them
        except OSError as exc:
            raise os_error(exc, target, "syncing the cache entry") from exc
        self.record = record

    def map_filled(self, entry: Path) -> dict[str, torch.Tensor]:
        """Map the committed, verified copy (resident by now: the fill read each window back)."""
        assert self.load is not None and self.record is not None
        local = LoadStats()
        opts = replace(self.load.options, chunk_size=self.cache.chunk_size, depth=self.cache.depth, mapped=True, progress=None)
        out = load_resolved(resolve(self.record.local_path(entry)), opts, local)
        self.stats.method = f"{local.method}+cache-fill"
        self.stats.tensors += local.tensors
        self.stats.copied_tensors += local.copied_tensors
        return out


# -- the cache ------------------------------------------------------------------------------------
class WeightCache:
    """A size-bounded, multi-process-safe local cache of models from slow or remote storage.

    ``wait_timeout``: seconds a fill waits for room while every model it could evict is being
    loaded by some process (default 0: fail at once, naming the models in use)."""

    def __init__(self, root: str | Path, max_bytes: int | str | None, *, check_source: bool = True,
                 chunk_bytes: int | str = engine.DEFAULT_CHUNK, depth: int = 16, wait_timeout: float = 0.0,
                 **deprecated: Any) -> None:
        if "chunk_size" in deprecated:  # the old name, one release
            warnings.warn("WeightCache: 'chunk_size' is deprecated, use 'chunk_bytes'", DeprecationWarning, stacklevel=2)
            chunk_bytes = deprecated.pop("chunk_size")
        if deprecated:
            raise TypeError(f"WeightCache got unexpected keyword argument(s) {', '.join(sorted(deprecated))}")
        max_bytes = parse_size(max_bytes) if isinstance(max_bytes, str) else max_bytes
        chunk_size = parse_size(chunk_bytes) if isinstance(chunk_bytes, str) else chunk_bytes
        if max_bytes is None or max_bytes <= 0:
            raise ConfigError(f"WeightCache max_bytes must be positive, got {max_bytes}")
        if chunk_size <= 0 or chunk_size % SUM_WINDOW:
            raise ConfigError(f"WeightCache chunk_size must be a positive multiple of 2 MiB (a checksum window), got {chunk_size}")
        self.max_bytes = int(max_bytes)
        self.check_source = check_source
        self.chunk_size = chunk_size
        self.depth = depth
        self.node = NodeCache(root, CacheOptions(limit=self.max_bytes, wait_timeout=wait_timeout, name="weights",
                                                 limit_setting="max_bytes"))
        self.root = self.node.root

    @staticmethod
    def entry_name(url: str | Path) -> str:
        return entry_name(str(url))

    def entries(self) -> list[CacheEntry]:
        """Committed entries, least recently used first."""
        out = []
        for e in self.node.entries():
            try:
                source = CacheRecord.read(e.path).source
            except (NotFoundError, FormatError):
                source = ""
            out.append(CacheEntry(e.name, source, e.bytes, e.last_used, e.path))
        return out

    def usage(self) -> int:
        return self.node.usage().present

    # -- public API ---------------------------------------------------------------------------
    def fetch(self, url: str | Path, options: LoadOptions | None = None, **overrides: Any) -> Path:
        """Make sure ``url`` is cached; returns the local path to load from. Of the
        :class:`LoadOptions` (or keyword overrides), ``stats`` and ``progress(done, total)`` apply:
        progress hears the download (it is not called on a hit)."""
        o = LoadOptions.resolve(options, overrides)
        stats = o.stats if o.stats is not None else LoadStats()
        with Timer(stats):
            path, _ = self._through(CacheRequest(self, str(url), None, stats, o.progress))
        return path

    def load(
        self,
        url: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        keys: list[str] | None = None,
        options: LoadOptions | None = None,
        *,
        verify: str = "size",
        **overrides: Any,
    ) -> dict[str, torch.Tensor]:
        """Load through the cache: from the local copy when present, else while filling it.

        ``verify``: "size" (sizes and source freshness) or "full" (also every window's xxh3). Of
        the :class:`LoadOptions` (or keyword overrides): ``stats``; ``mapped`` as for
        :func:`tierio.weights.load`, CPU tensors being views of the cached files (evicting or
        refreshing the entry later is safe: files are unlinked, never rewritten); ``progress(done,
        total)``: the download on a miss, the local read on a hit. Chunk size and depth are the
        cache's own (``WeightCache(chunk_bytes=..., depth=...)``).
        """
        if verify not in ("size", "full"):
            raise ConfigError(f"verify must be 'size' or 'full', got {verify!r}")
        o = LoadOptions.resolve(options, overrides)
        stats = o.stats if o.stats is not None else LoadStats()
        opts = ReadSpec(as_device(device), dtype, list(keys) if keys is not None else None, mapped=o.mapped,
                        chunk_size=self.chunk_size, depth=self.depth)
        with Timer(stats):
            _, out = self._through(CacheRequest(self, str(url), CacheLoad(opts, verify), stats, o.progress))
        assert out is not None
        return out

    def evict(self, url: str | Path) -> bool:
        """Remove one model from the cache (waits until no process is loading it)."""
        return self.node.evict(str(url))

    def _through(self, req: CacheRequest) -> tuple[Path, dict[str, torch.Tensor] | None]:
        """Pin the entry (filling it on a miss) for as long as the load reads it."""
        with self.node.get(req.url, "dir", req.plan, usable=req.usable) as pin:
            record = req.record
            assert record is not None  # set by usable() on a hit, by verify() on a fill
            local = record.local_path(pin.path)
            # the source is what was asked for; the copy it was read from (or into) is named apart
            req.stats.source = req.stats.source or req.url
            req.stats.extra["cache"] = "hit" if pin.hit else "miss"
            req.stats.extra["cache_entry"] = str(local)
            if req.load is None:
                return local, None
            if pin.hit:
                return local, req.load_hit(pin.path, record)
            return local, req.tensors if req.tensors is not None else req.map_filled(pin.path)


__all__ = ["CacheEntry", "CacheLoad", "CacheRecord", "FileRecord", "WeightCache"]
