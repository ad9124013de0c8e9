"""A Megatron ``.bin``/``.idx`` pair on a store (S3, or any store URL), opened through the node cache.

* **The index once per node.** The ``.idx`` is copied into the node cache (``NodeCache``, shared by
  every rank and DataLoader worker of the node) and mapped from there; :class:`IndexedDataset`
  then checks it exactly as it checks a local index, against the ``.bin``'s size on the store.
* **The tokens through the cache, or by ranges.** Where the ``.bin`` fits the cache limit it is
  copied whole (parallel ranged GETs) and mapped: from the first sample on, reads are local
  mapped reads, the second epoch as fast as a local file. A ``.bin`` larger than the limit (or
  ``bin_reads="ranges"``) is read by ranged GETs of ``chunk_bytes``, the last few chunks kept in
  memory, as megatron-core's object-storage reader does; nothing of it touches the local disk.
* **A changed object is a new entry.** Cache keys hold the store, the key, the size and the
  modification time, so a rewritten ``.bin``/``.idx`` is never read through an old copy.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.options import Options
from tierio.io.engine import run_windows
from tierio.storage.base import ObjectInfo, Store
from tierio.storage.cache import CacheOptions, FillPlan, NodeCache, Pin
from tierio.storage.url import open_store
from tierio.units import parse_size

BinReads = Literal["auto", "cache", "ranges"]
DEFAULT_CACHE = "~/.cache/tierio/data"
CHUNKS_KEPT = 4  # chunks of a ranged .bin held in memory: a sequence spans at most two
ROWS_IN_FLIGHT = 16  # ranged GETs of one batch's rows at once: each is mostly waiting for its answer


def is_remote(prefix: str | Path) -> bool:
    """True for a store URL other than a local path or a file:// URL."""
    text = str(prefix)
    return "://" in text and not text.startswith("file://")


def split_prefix(url: str) -> tuple[str, str]:
    """``s3://bucket/dir/name?endpoint=...`` -> (``s3://bucket/dir?endpoint=...``, ``name``)."""
    u = urlsplit(url)
    parent, _, stem = u.path.rstrip("/").rpartition("/")
    for suffix in (".idx", ".bin"):
        stem = stem.removesuffix(suffix)
    if not stem:
        raise ConfigError(f"{url} names no dataset: give the prefix, e.g. s3://bucket/dir/corpus_text_document")
    return urlunsplit((u.scheme, u.netloc, parent, u.query, "")), stem


@dataclass(frozen=True)
class RemoteOptions(Options):
    """Where a remote pair is cached and how its ``.bin`` is read (see the module docstring)."""

    cache_dir: str | Path | None = None  # default: $TIERIO_DATA_CACHE or ~/.cache/tierio/data
    cache_limit_bytes: int | str = "64GiB"  # sizes: int or text such as "64GiB" (Options parses them)
    bin_reads: BinReads = "auto"
    chunk_bytes: int | str = "16MiB"

    def root(self) -> Path:
        return Path(self.cache_dir or os.environ.get("TIERIO_DATA_CACHE") or DEFAULT_CACHE).expanduser()


@dataclass
class RemotePair:
    """The opened pair: the local index copy, and the tokens (a mapped local copy or by ranges)."""

    url: str  # the prefix as given, for messages
    idx: Path
    bin_size: int
    bin_path: Path | None  # the whole .bin in the cache; None when read by ranges
    ranges: RangeTokens | None
    pins: list[Pin] = field(default_factory=list)

    def release(self) -> None:
        for pin in self.pins:
            pin.release()
        self.pins.clear()


def _stat(store: Store, key: str, url: str) -> ObjectInfo:
    try:
        return store.stat(key)
    except NotFoundError:
        raise NotFoundError(f"{url} does not exist: an indexed dataset needs both the .idx and the .bin "
                            "under its prefix") from None


def _cached(cache: NodeCache, store: Store, info: ObjectInfo, url: str) -> Pin:
    """A pinned, complete local copy of one object (fetched on a miss)."""

    def verify(target: Path) -> None:
        if target.stat().st_size != info.size:
            raise FormatError(f"{url} changed while it was copied into the cache at {cache.root} "
                              f"({target.stat().st_size} bytes, {info.size} listed); open the dataset again")

    key = f"{info.key}?size={info.size}&mtime={info.mtime}&store={store.url}"
    return cache.get(key, "file", lambda: FillPlan(info.size, lambda t: store.get_file(info.key, t), url, verify),
                     usable=lambda p: p.stat().st_size == info.size)


def open_pair(prefix: str, options: RemoteOptions | None = None) -> RemotePair:
    """Open the remote pair ``prefix`` names (``s3://bucket/dir/name?endpoint=...``)."""
    o = options or RemoteOptions()
    if o.bin_reads not in ("auto", "cache", "ranges"):
        raise ConfigError(f"bin_reads must be 'auto', 'cache' or 'ranges', got {o.bin_reads!r}")
    store_url, stem = split_prefix(prefix)
    store = open_store(store_url)
    shown = urlunsplit(urlsplit(prefix)._replace(query=""))
    idx_info = _stat(store, f"{stem}.idx", f"{shown}.idx")
    bin_info = _stat(store, f"{stem}.bin", f"{shown}.bin")
    limit = parse_size(o.cache_limit_bytes)
    cache = NodeCache(o.root(), CacheOptions(limit=limit, name="indexed", limit_setting="cache_limit_bytes"))
    if o.bin_reads == "cache" and bin_info.size + idx_info.size > limit:
        raise ConfigError(f"{shown}.bin is {bin_info.size} bytes, more than cache_limit_bytes={limit} can hold: "
                          "raise the limit or read it by ranges (bin_reads='ranges')")
    whole = o.bin_reads == "cache" or (o.bin_reads == "auto" and bin_info.size + idx_info.size <= limit)
    pins = [_cached(cache, store, idx_info, f"{shown}.idx")]
    try:
        if whole:
            pins.append(_cached(cache, store, bin_info, f"{shown}.bin"))
            return RemotePair(shown, pins[0].path, bin_info.size, pins[1].path, None, pins)
        ranges = RangeTokens(store, bin_info, f"{shown}.bin", parse_size(o.chunk_bytes))
        return RemotePair(shown, pins[0].path, bin_info.size, None, ranges, pins)
    except BaseException:
        for pin in pins:
            pin.release()
        raise


class RangeTokens:
    """The tokens of a ``.bin`` read by ranged GETs; only slicing is offered (``tokens[a:b]``),
    each slice a fresh array or a view of a chunk held in memory. Set ``dtype`` before use.

    A read that continues where the last one ended (a scan: packing, documents in order) fetches
    whole ``chunk``s, the last few kept; any other read (shuffled samples) fetches exactly its
    bytes: a chunk fetched for one random sample would be thrown away before its neighbours come."""

    def __init__(self, store: Store, info: ObjectInfo, where: str, chunk: int) -> None:
        if chunk <= 0:
            raise ConfigError(f"chunk_bytes must be positive, got {chunk}")
        self.store, self.info, self.where = store, info, where
        self.dtype = np.dtype(np.uint8)
        self.chunk = chunk
        self._chunks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._last_end = 0
        self.requests = 0

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __len__(self) -> int:
        return self.info.size // self.dtype.itemsize

    def _read(self, start: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.store.read_into(self.info.key, start, memoryview(buf))
        with self._lock:
            self.requests += 1
        return buf

    def _chunk(self, k: int) -> bytes:
        with self._lock:
            data = self._chunks.get(k)
            if data is not None:
                self._chunks.move_to_end(k)
                return data
        start = k * self.chunk
        data = bytes(self._read(start, min(self.chunk, self.info.size - start)))
        with self._lock:
            self._chunks[k] = data
            while len(self._chunks) > CHUNKS_KEPT:
                self._chunks.popitem(last=False)
        return data

    def __getitem__(self, item: slice) -> np.ndarray:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError(f"{self.where} is read by ranges: only contiguous slices tokens[a:b] are supported")
        a, b, _ = item.indices(len(self))
        if b <= a:
            return np.empty(0, self.dtype)
        lo, hi = a * self.itemsize, b * self.itemsize
        first, last = lo // self.chunk, (hi - 1) // self.chunk
        scanning = lo == self._last_end or all(k in self._chunks for k in range(first, last + 1))
        self._last_end = hi
        if not scanning:
            return np.frombuffer(self._read(lo, hi - lo), self.dtype)
        if first == last:
            return np.frombuffer(self._chunk(first), self.dtype, b - a, lo - first * self.chunk)
        out = bytearray(hi - lo)
        for k in range(first, last + 1):
            base = k * self.chunk
            data = self._chunk(k)
            s, e = max(lo, base), min(hi, base + len(data))
            out[s - lo : e - lo] = data[s - base : e - base]
        return np.frombuffer(out, self.dtype)

    def rows(self, starts: list[int], length: int, out: np.ndarray) -> None:
        """``out[r] = tokens[starts[r] : starts[r] + length]`` for every row, ROWS_IN_FLIGHT ranged
        GETs at once (a shuffled batch: one request per row, overlapped)."""
        def one(r: int) -> None:
            out[r] = self[starts[r] : starts[r] + length]

        run_windows(range(len(starts)), one, ROWS_IN_FLIGHT)
