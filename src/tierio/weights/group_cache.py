"""A cooperative load through the node-local weight cache (``load_group(..., cache=)``).

* **Warm nodes.** Before the load each rank looks for a usable copy in its node's cache (pinned,
  never filled here). When every rank has one, each loads from it alone, with no exchange. When
  only some do, those ranks are the readers: they read the parts from their local copies and the
  other ranks receive everything from them, so the source is not read at all (a new replica loads
  from the warm ones). When none does, every rank reads its part from the source, as without a cache.
* **Cold nodes fill.** On a node where no rank had a copy, the node's lowest rank writes one into
  the cache while the load runs. Its bytes come from the group's stream, each piece already
  checked against its sender's xxh3, fed in stream order (``StreamFill``). Header and tail bytes
  come from the source, and the companion files (config, tokenizer) are read from it. The fill
  then goes through the cache's own verify and commit, as ``WeightCache.load`` does.
* **A cache problem never fails a load.** A full disk, a fill that would not fit, or an entry held
  elsewhere is logged. The load goes on or has already finished, and the node stays cold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierio.errors import IntegrityError, TierioError
from tierio.io.buffers import ALIGN, HostBuffer, address_of
from tierio.io.checksum import xxh3
from tierio.storage.cache_records import Pin
from tierio.storage.download import WindowWriter
from tierio.weights.cache import CacheRequest, WeightCache
from tierio.weights.engine import ShardReader
from tierio.weights.record import CacheRecord
from tierio.weights.sources import ModelSource, Shard, resolve
from tierio.weights.stats import LoadStats

log = logging.getLogger(__name__)


@dataclass
class NodeCopy:
    """A usable cached copy of the model on this rank's node, pinned until ``release()``."""

    pin: Pin
    record: CacheRecord
    source: ModelSource  # the copy's files, resolved (headers read)

    def release(self) -> None:
        self.pin.release()


def peek(cache: WeightCache, url: str) -> NodeCopy | None:
    """This node's copy of ``url`` if the cache holds a usable one (stale or damaged ones are not)."""
    req = CacheRequest(cache, url, None, LoadStats(), None)
    try:
        pin = cache.node.lookup(url, "dir", req.usable)
    except TierioError as exc:  # held by a fill elsewhere past the wait: this node counts as cold
        log.warning("cooperative load of %s: not using the node cache at %s: %s", url, cache.root, exc)
        return None
    if pin is None:
        return None
    try:
        assert req.record is not None  # set by usable()
        return NodeCopy(pin, req.record, resolve(req.record.local_path(pin.path)))
    except BaseException:
        pin.release()
        raise


def layout(src: ModelSource) -> str:
    """What every rank's stream must agree on: the shards' names, sizes and headers."""
    assert all(s.header is not None for s in src.shards)
    return xxh3(repr([(s.key, s.size, s.data_offset, sorted(s.header.tensors.items())) for s in src.shards]).encode())  # type: ignore[union-attr]


class StreamFill:
    """Writes a model's shard files from its tensor stream, fed in stream order.

    ``segments`` and ``readers`` are ``group.Stream``'s: (stream offset of a shard's data section,
    shard), and its reader of each shard's source, which also reads the header and tail bytes. Each
    file is written in windows of ``chunk`` bytes at its own offsets through its ``WindowWriter``
    (which records every window's xxh3). A window wholly inside the data section whose bytes arrive
    in one aligned piece is written from that memory; the others are put together in one aligned
    buffer from the stream bytes and the header and tail bytes, read from the source.
    A write error stops the fill, not the feed: the load goes on and ``finish()`` raises it."""

    def __init__(self, segments: list[tuple[int, Shard]], readers: dict[int, ShardReader], writers: dict[int, WindowWriter],
                 source: ModelSource, chunk: int) -> None:
        self.segments, self.readers, self.writers, self.source, self.chunk = segments, readers, writers, source, chunk
        self.error: BaseException | None = None
        self._buf = HostBuffer(chunk, pin=False, prefault=False)
        self._i = -1  # the shard being written
        self._win = 0  # its window being put together (file offset)
        self._got = 0  # stream offset up to which that window holds its data bytes
        self._outside = b""  # the shard's bytes outside its data section: header, then tail
        self._next_shard()

    def _next_shard(self) -> None:
        self._i += 1
        while self._i < len(self.segments) and not self.segments[self._i][1].size:
            self._i += 1
        if self._i >= len(self.segments):
            return
        at, s = self.segments[self._i]
        d, end = s.data_offset, s.data_offset + s.header.data_bytes  # type: ignore[union-attr]
        reader = self.readers[id(s)]
        out = bytearray(d + s.size - end)
        view = memoryview(out)
        if d:
            reader.read(0, view[:d], d)
        if s.size > end:
            reader.read(end, view[d:], s.size - end)
        self._outside, self._win = bytes(out), 0
        self._got = self._need()[0]

    def _need(self) -> tuple[int, int]:
        """Stream range [lo, hi) of the data bytes of the window being put together."""
        at, s = self.segments[self._i]
        d, end = s.data_offset, s.data_offset + s.header.data_bytes  # type: ignore[union-attr]
        a, b = self._win, min(self._win + self.chunk, s.size)
        lo, hi = max(a, d), min(b, end)
        return (at + lo - d, at + hi - d) if hi > lo else (at, at)

    def feed(self, lo: int, data: memoryview) -> None:
        """Stream bytes [lo, lo + len(data)), after every byte before ``lo``."""
        try:
            if self.error is None:
                self._feed(lo, data)
        except Exception as exc:  # the disk filled, or the like: the load itself goes on
            self.error = exc

    def _feed(self, lo: int, data: memoryview) -> None:
        hi = lo + len(data)
        while self._i < len(self.segments):
            at, s = self.segments[self._i]
            need_lo, need_hi = self._need()
            start = max(need_lo, self._got)
            if need_hi > start:
                if hi <= start:
                    return  # this window's bytes come later
                if lo > start:
                    raise IntegrityError(f"cache fill of {s.where}: stream bytes {start}..{lo} never came")
                take = min(need_hi, hi) - start
                n = self._win + self.chunk
                if (take == self.chunk and n <= s.size and start == need_lo
                        and address_of(data[start - lo:]) % ALIGN == 0):  # the whole window in place
                    self.writers[id(s)].write(self._win, data[start - lo : start - lo + take], take)
                    self._advance(s)
                    continue
                pos = start - at + s.data_offset - self._win  # where in the window
                self._buf.view[pos : pos + take] = data[start - lo : start - lo + take]
                self._got = start + take
                if self._got < need_hi:
                    return
            self._write_window(s)
            self._advance(s)

    def _write_window(self, s: Shard) -> None:
        d, end = s.data_offset, s.data_offset + s.header.data_bytes  # type: ignore[union-attr]
        a, b = self._win, min(self._win + self.chunk, s.size)
        view = self._buf.view
        if a < d:  # header bytes
            view[: min(b, d) - a] = self._outside[a : min(b, d)]
        if b > end:  # tail bytes
            t0 = max(a, end)
            view[t0 - a : b - a] = self._outside[d + t0 - end : d + b - end]
        self.writers[id(s)].write(a, view, b - a)

    def _advance(self, s: Shard) -> None:
        self._win += self.chunk
        if self._win >= s.size:
            self._next_shard()
        else:
            self._got = self._need()[0]

    def finish(self) -> None:
        """Raise what stopped the fill, or that the stream ended before every file was written."""
        if self.error is not None:
            raise self.error
        if self._i < len(self.segments):
            raise IntegrityError(f"cache fill of {self.source.url} ended at {self.segments[self._i][1].where} "
                                 f"byte {self._win}: the stream was not fed to the end")


Exchange = Callable[[Callable[[int, memoryview], None] | None], dict[str, torch.Tensor]]


class _GroupFill(CacheRequest):
    """A cache fill whose shard bytes come from the group's exchange instead of a download."""

    def __init__(self, cache: WeightCache, url: str, src: ModelSource, segments: list[tuple[int, Shard]],
                 readers: dict[int, ShardReader], exchange: Exchange, stats: LoadStats) -> None:
        super().__init__(cache, url, None, stats, None)
        self.src, self.segments, self.readers, self.exchange = src, segments, readers, exchange
        self.ran = False

    def _download(self, writers: dict[int, WindowWriter]) -> None:
        assert self.src is not None
        sink = StreamFill(self.segments, self.readers, writers, self.src, self.cache.chunk_size)
        self.ran = True
        self.tensors = self.exchange(sink.feed)
        sink.finish()


def fill_while(cache: WeightCache, url: str, src: ModelSource, segments: list[tuple[int, Shard]],
               readers: dict[int, ShardReader], exchange: Exchange, stats: LoadStats) -> dict[str, torch.Tensor]:
    """Run ``exchange`` while filling the cache entry of ``url`` from it; the tensors it returns.
    The exchange runs exactly once whatever the cache does (this rank's group is waiting on it)."""
    req = _GroupFill(cache, url, src, segments, readers, exchange, stats)
    try:
        with cache.node.get(url, "dir", req.plan, usable=req.usable) as pin:
            stats.extra["cache"] = "hit" if pin.hit else "filled"
            stats.extra["cache_entry"] = str(pin.path)
    except (TierioError, OSError) as exc:
        if req.ran and req.tensors is None:
            raise  # the exchange itself failed (its group is broken): never run it a second time
        stats.extra["cache"] = f"not filled ({str(exc)[:200]})"
        log.warning("cooperative load of %s: the node cache at %s was not filled: %s", url, cache.root, exc)
    if req.tensors is not None:
        return req.tensors
    return exchange(None)


__all__ = ["NodeCopy", "StreamFill", "fill_while", "layout", "peek"]
