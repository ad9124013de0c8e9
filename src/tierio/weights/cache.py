"""WeightCache: a local NVMe copy of models that live on slow or remote storage (S3, NFS, Lustre).

Layout under ``root``::

    entries/<name>-<hash>/          the model's files, same relative names as at the source
    entries/<name>-<hash>/.tierio-cache.json   commit record: source, sizes, mtimes, checksums
    entries/.<name>-<hash>.tmp-*/   a fill in progress (renamed into place when complete)
    locks/<name>-<hash>.lock        per-entry lock: exclusive to fill, shared while loading
    .lock                           held while accounting and evicting

Pipelined fill: the shards are downloaded in ordered windows with several ranged GETs in
flight into the reused staging ring; every window is checksummed and written to the cache file
by O_DIRECT while it is in memory, and then:

* CPU loads (mapped, the default): the kernel is asked to read the written window back into
  the page cache in the background, so when the download ends the cache files are resident
  and the tensors are mapped views of them. No memory is zeroed and the CPU copies nothing but
  the socket reads, which counts where the download shares its cores with the network stack.
* GPU loads: the window is also copied to the device from the staging buffer.
* ``mapped=False`` CPU loads: the download lands in private memory (an arena per shard) and is
  written from there.

Verification: a fill is committed only if every file has the source's size and its header
parses to the same tensors as the source's; each window's xxh3 is recorded, so ``verify="full"``
can re-check a cached copy later. Eviction is least-recently-used by size; entries in use by a
process (shared lock held) are never evicted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierio.errors import ConfigError, DiskFullError, IntegrityError, StorageError, StoreUnavailableError
from tierio.io import pagecache
from tierio.io.buffers import ALIGN, align_up
from tierio.io.checksum import xxh3
from tierio.io.durable import fsync_dir
from tierio.io.files import open_file, os_error, pwrite_all
from tierio.io.space import disk_space
from tierio.weights import engine
from tierio.weights.engine import Progress
from tierio.weights.loader import LoadStats, _device, _Timer, load_resolved
from tierio.weights.sources import ModelSource, Shard, _read_header_local, resolve

log = logging.getLogger(__name__)
RECORD = ".tierio-cache.json"
VERSION = 1


@dataclass
class CacheEntry:
    name: str
    source: str
    bytes: int
    last_used: float
    path: Path


class _ShardWriter:
    """Receives windows of one shard (in any order) and writes them to the cache file.

    With ``prefetch`` each written window is then read back into the page cache in the background
    (see io.pagecache.prefetch), so the file is resident, ready to be mapped, when the download ends."""

    def __init__(self, shard: Shard, path: Path, prefetch: bool = False) -> None:
        self.shard, self.path, self.prefetch = shard, path, prefetch
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, self.direct = open_file(path, write=True, direct=True)
        self.sums: dict[int, str] = {}
        self.written = 0
        self._lock = threading.Lock()

    def write(self, offset: int, view: memoryview, n: int) -> None:
        digest = xxh3(view[:n])
        data = view[: align_up(n)] if self.direct and offset % ALIGN == 0 else view[:n]
        if self.direct and len(data) % ALIGN:  # cannot happen with aligned windows; stay safe
            raise IntegrityError(f"unaligned window at {offset} for {self.path}")
        pwrite_all(self.fd, data, offset, self.path)
        if self.prefetch and self.direct:  # buffered writes left the bytes in the page cache already
            try:
                pagecache.prefetch(self.fd, offset, n)
            except OSError as exc:
                raise os_error(exc, self.path, "reading back cache file") from exc
        with self._lock:
            self.sums[offset] = digest
            self.written += n

    def close(self) -> None:
        try:
            os.ftruncate(self.fd, self.shard.size)  # drop the O_DIRECT padding of the last window
            os.fsync(self.fd)
        except OSError as exc:
            raise os_error(exc, self.path, "finishing cache file") from exc
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class WeightCache:
    """A size-bounded, multi-process-safe local cache of models from slow or remote storage."""

    def __init__(self, root: str | Path, max_bytes: int, *, check_source: bool = True, chunk_size: int = engine.DEFAULT_CHUNK, depth: int = 16) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"WeightCache max_bytes must be positive, got {max_bytes}")
        self.root = Path(root).expanduser().absolute()
        self.max_bytes = int(max_bytes)
        self.check_source = check_source
        if chunk_size <= 0 or chunk_size % (2 << 20):
            raise ConfigError(f"WeightCache chunk_size must be a positive multiple of 2 MiB (a checksum window), got {chunk_size}")
        self.chunk_size = chunk_size
        self.depth = depth
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            (self.root / "locks").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, self.root, "creating the weight cache in") from exc

    # -- naming and locks ---------------------------------------------------------------------
    @staticmethod
    def entry_name(url: str) -> str:
        base = url.split("?", 1)[0].rstrip("/")
        tail = re.sub(r"[^A-Za-z0-9._-]+", "_", base.rsplit("/", 1)[-1])[:48] or "model"
        return f"{tail}-{hashlib.sha256(url.encode()).hexdigest()[:16]}"

    def _entry_dir(self, name: str) -> Path:
        return self.root / "entries" / name

    @contextmanager
    def _lock(self, path: Path, mode: int, blocking: bool = True):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield None
                return
            yield fd
        finally:
            os.close(fd)  # closing releases the lock

    def _entry_lock(self, name: str, mode: int, blocking: bool = True):
        return self._lock(self.root / "locks" / f"{name}.lock", mode, blocking)

    # -- records ------------------------------------------------------------------------------
    def _record(self, name: str) -> dict[str, Any] | None:
        try:
            doc = json.loads((self._entry_dir(name) / RECORD).read_text())
            return doc if isinstance(doc, dict) and doc.get("version") == VERSION else None
        except (OSError, ValueError):
            return None

    def entries(self) -> list[CacheEntry]:
        """Committed entries, least recently used first."""
        out = []
        for d in (self.root / "entries").iterdir():
            if d.name.startswith("."):
                continue
            rec = self._record(d.name)
            if rec is None:
                continue
            try:
                used = (d / RECORD).stat().st_mtime
            except OSError:
                continue
            out.append(CacheEntry(d.name, rec["source"], int(rec["bytes"]), used, d))
        return sorted(out, key=lambda e: e.last_used)

    def usage(self) -> int:
        return sum(e.bytes for e in self.entries())

    def _fresh(self, rec: dict[str, Any], name: str, src: ModelSource | None) -> str | None:
        """Why a committed entry cannot be used ('' reasons -> None when it is good)."""
        d = self._entry_dir(name)
        for key, info in rec["files"].items():
            try:
                if (d / key).stat().st_size != info["size"]:
                    return f"{key} has the wrong size in the cache"
            except OSError:
                return f"{key} is missing from the cache"
        if src is not None:
            for s in src.shards:
                info = rec["files"].get(s.key)
                if info is None or info["size"] != s.size or abs(info["mtime"] - s.mtime) > 1e-3:
                    return f"{s.key} changed at the source"
        return None

    # -- public API ---------------------------------------------------------------------------
    def fetch(self, url: str | Path, *, stats: LoadStats | None = None, progress: Progress | None = None) -> Path:
        """Make sure ``url`` is cached; returns the local path to load from. ``progress(done, total)``
        hears the download (not called on a hit)."""
        stats = stats if stats is not None else LoadStats()
        with _Timer(stats):
            path, _ = self._ensure(str(url), stats, load=None, progress=progress)
        return path

    def load(
        self,
        url: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        keys: list[str] | None = None,
        *,
        stats: LoadStats | None = None,
        verify: str = "size",
        mapped: bool = True,
        progress: Progress | None = None,
    ) -> dict[str, torch.Tensor]:
        """Load through the cache: from the local copy when present, else while filling it.

        ``verify``: "size" (sizes and source freshness) or "full" (also every window's xxh3).
        ``mapped``: as for :func:`tierio.weights.load`; CPU tensors are views of the cached files
        (evicting or refreshing the entry later is safe: files are unlinked, never rewritten).
        ``progress(done, total)``: the download on a miss, the local read on a hit.
        """
        if verify not in ("size", "full"):
            raise ConfigError(f"verify must be 'size' or 'full', got {verify!r}")
        stats = stats if stats is not None else LoadStats()
        dev = _device(device)
        with _Timer(stats):
            _, out = self._ensure(str(url), stats, load=(dev, dtype, keys, verify, mapped), progress=progress)
        return out  # type: ignore[return-value]

    def evict(self, url: str) -> bool:
        """Remove one model from the cache (waits until no process is loading it)."""
        name = self.entry_name(str(url))
        with self._entry_lock(name, fcntl.LOCK_EX):
            if self._entry_dir(name).exists():
                shutil.rmtree(self._entry_dir(name))
                return True
        return False

    # -- internals ----------------------------------------------------------------------------
    def _ensure(self, url: str, stats: LoadStats, load, progress: Progress | None = None):
        name = self.entry_name(url)
        d = self._entry_dir(name)
        with self._entry_lock(name, fcntl.LOCK_EX) as fd:
            rec = self._record(name)
            src: ModelSource | None = None
            if rec is not None:
                if self.check_source:
                    try:
                        src = resolve(url, read_headers=False)  # sizes and mtimes only
                    except (StoreUnavailableError, OSError) as exc:
                        log.warning("source %s unreachable (%s); using the cached copy as is", url, exc)
                why = self._fresh(rec, name, src)
                if why is None:
                    stats.extra["cache"] = "hit"
                    _mark_used(d / RECORD)
                    fcntl.flock(fd, fcntl.LOCK_SH)  # others may load it too; eviction must wait
                    return self._from_cache(name, rec, stats, load, progress)
                log.info("cached copy of %s is stale (%s); fetching again", url, why)
            stats.extra["cache"] = "miss"
            return self._fill(url, name, resolve(url), stats, load, progress)

    def _local_path(self, name: str, rec: dict[str, Any]) -> Path:
        return self._local_path_in(self._entry_dir(name), rec["kind"], rec["files_order"][0])

    @staticmethod
    def _local_path_in(entry: Path, kind: str, first_file: str) -> Path:
        """What to load from in an entry directory: the file of a single-file model, else the directory."""
        return entry / first_file if kind == "file" else entry

    def _from_cache(self, name: str, rec: dict[str, Any], stats: LoadStats, load, progress: Progress | None):
        path = self._local_path(name, rec)
        if load is None:
            return path, None
        dev, dtype, keys, verify, mapped = load
        src = resolve(path)
        chunk = int(rec.get("chunk", self.chunk_size))
        hook = None
        if verify == "full":
            sums = {k: v.get("xxh3", {}) for k, v in rec["files"].items()}

            def hook(shard: Shard, offset: int, view: memoryview, n: int) -> None:
                # Windows are whole multiples of the fill's checksum window (see engine).
                for rel in range(0, n, chunk):
                    at, m = offset + rel, min(chunk, n - rel)
                    want = sums.get(shard.key, {}).get(str(at))
                    if want is None or xxh3(view[rel : rel + m]) != want:
                        why = "have no recorded checksum" if want is None else "fail their checksum"
                        raise IntegrityError(f"cached {shard.where} bytes {at}..{at + m} {why}; run `tierio weights fetch` again or evict the entry")

        out = load_resolved(
            src, dev, dtype, keys, stats=stats, chunk_size=chunk, depth=self.depth,
            whole_files=verify == "full", hook=hook, mapped=mapped, progress=progress,
        )
        return path, out

    def _make_room(self, name: str, need: int) -> None:
        if need > self.max_bytes:
            raise ConfigError(
                f"the model needs {need} bytes but the weight cache at {self.root} holds at most {self.max_bytes}; "
                "raise max_bytes or load without the cache"
            )
        with self._lock(self.root / ".lock", fcntl.LOCK_EX):
            entries = [e for e in self.entries() if e.name != name]
            used = sum(e.bytes for e in entries)
            for e in entries:  # least recently used first
                if used + need <= self.max_bytes:
                    break
                with self._entry_lock(e.name, fcntl.LOCK_EX, blocking=False) as held:
                    if held is None:
                        continue  # in use by a loader right now
                    shutil.rmtree(e.path, ignore_errors=True)
                    used -= e.bytes
                    log.info("evicted %s (%d bytes) from the weight cache", e.source, e.bytes)
            if used + need > self.max_bytes:
                raise StorageError(f"weight cache {self.root} is full of models in use ({used} bytes); wait, or raise max_bytes")
            space = disk_space(self.root)
            free = space[1] if space is not None else need
            if free < need:
                raise DiskFullError(f"{self.root} has {free} bytes free but the model needs {need}; free space or move the cache")

    def _fill(self, url: str, name: str, src: ModelSource, stats: LoadStats, load, progress: Progress | None):
        need = src.total_bytes
        self._make_room(name, need)
        entries = self.root / "entries"
        for stale in entries.glob(f".{name}.tmp-*"):  # left by a fill that died (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = entries / f".{name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        writers: dict[int, _ShardWriter] = {}
        try:
            shard_keys = {s.key for s in src.shards}
            sizes: dict[str, dict[str, Any]] = {}
            for key in src.keys:  # small companion files (config.json, index, manifest)
                if key in shard_keys:
                    continue
                dst = tmp / key
                dst.parent.mkdir(parents=True, exist_ok=True)
                if src.store is not None:
                    src.store.get_file(key, dst)
                else:
                    shutil.copyfile(src.root / key, dst)  # type: ignore[operator]
                sizes[key] = {"size": dst.stat().st_size, "mtime": 0.0}
            # CPU loads that map the cache files only need the download written (and read back).
            map_after = load is not None and load[0].type == "cpu" and load[4]
            for s in src.shards:
                writers[id(s)] = _ShardWriter(s, tmp / s.key, prefetch=map_after)

            def hook(shard: Shard, offset: int, view: memoryview, n: int) -> None:
                writers[id(shard)].write(offset, view, n)

            out = None
            if load is None or map_after:
                extents = [engine.Extent(s, 0, s.size) for s in src.shards if s.size]
                counters = engine.Counters(total=sum(x.end for x in extents), progress=progress)
                engine.read_through_ring(extents, None, chunk_size=self.chunk_size, depth=self.depth, hook=hook, counters=counters)
                stats.bytes += sum(s.size for s in src.shards)
                stats.remote_bytes += counters.remote_bytes
                stats.files += len(src.shards)
                stats.method = "cache-fill"
            else:
                dev, dtype, keys, _, mapped = load
                out = load_resolved(src, dev, dtype, keys, stats=stats, chunk_size=self.chunk_size, depth=self.depth,
                                    whole_files=True, hook=hook, mapped=mapped, progress=progress)
                stats.method += "+cache-fill"
            for s in src.shards:
                w = writers.pop(id(s))
                w.close()
                if w.written != s.size:
                    raise IntegrityError(f"cache copy of {s.where} got {w.written} of {s.size} bytes")
                got = _read_header_local(w.path, str(w.path))
                if got.tensors != s.header.tensors:  # type: ignore[union-attr]
                    raise IntegrityError(f"cache copy of {s.where} has a different header than the source; the source changed during the copy")
                sizes[s.key] = {"size": s.size, "mtime": s.mtime, "xxh3": {str(k): v for k, v in sorted(w.sums.items())}}
            if map_after:  # the fill is complete and verified: map the local copy (resident by now)
                dev, dtype, keys, _, _ = load
                local = LoadStats()
                out = load_resolved(resolve(self._local_path_in(tmp, src.kind, src.shards[0].key)), dev, dtype, keys,
                                    stats=local, chunk_size=self.chunk_size, depth=self.depth, mapped=True)
                stats.method = f"{local.method}+cache-fill"
                stats.tensors += local.tensors
                stats.copied_tensors += local.copied_tensors
            record = {
                "version": VERSION, "source": url, "kind": src.kind, "bytes": need + sum(v["size"] for k, v in sizes.items() if k not in shard_keys),
                "files": sizes, "files_order": [s.key for s in src.shards], "chunk": self.chunk_size, "created": time.time(),
            }
            (tmp / RECORD).write_text(json.dumps(record, indent=1))
            _mark_used(tmp / RECORD)
            fsync_dir(tmp)
            final = self._entry_dir(name)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(entries)
        except BaseException:
            for w in writers.values():
                w.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        stats.extra["cached_at"] = str(self._local_path(name, record))
        return self._local_path(name, record), out


def _mark_used(record: Path) -> None:
    """Advance the entry's LRU clock (the record's mtime) with a nanosecond timestamp.

    The kernel stamps files with a coarse clock (a few ms), so two uses in quick succession
    would tie; an explicit time_ns() keeps their order."""
    now = time.time_ns()
    os.utime(record, ns=(now, now))


__all__ = ["WeightCache", "CacheEntry"]
