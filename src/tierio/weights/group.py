"""Cooperative loads: the ranks of a process group read a model from its source once between them.

The model's tensor bytes, shard after shard, form one stream cut into windows of N parts
(``chunk_bytes`` each, N = the group's size). Rank r reads part r of every window from the source
(S3 or a shared filesystem) and checksums it (xxh3); the parts and their checksums are exchanged
with ``all_gather`` (gloo on CPU); every rank checks every part it received against its sender's
checksum, reads a part that fails again from the source itself, and copies out of the window what
it keeps: whole tensors, or with ``shard=`` its tensor-parallel slices (cut when a tensor is
complete, so at most a window and the tensors crossing it are held beyond what is kept).

A rank that dies breaks its connections at once; one that stops answering is given up after the
process group's timeout (``init_process_group(timeout=...)``). Every rank stamps a key of the
group's store twice a second, so the others raise a GroupError naming the ranks whose stamps
stopped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from tierio.errors import GroupError
from tierio.format.safetensors import TensorEntry, torch_dtype
from tierio.io.checksum import xxh3_int
from tierio.io.engine import settle_all, submit
from tierio.weights.engine import Counters, ShardReader
from tierio.weights.loader import Timer
from tierio.weights.options import LoadOptions
from tierio.weights.sliced import cut, with_rules
from tierio.weights.sources import ModelSource, Shard, resolve
from tierio.weights.stats import LoadStats
from tierio.weights.tp import Take, TensorParallel

STAMP_S = 0.5  # how often a rank stamps its key; a rank whose stamp stands still for 4 of these is gone


@dataclass
class Wanted:
    """One tensor as the stream holds it: [start, end) in stream bytes, and what the rank keeps."""

    name: str
    entry: TensorEntry
    start: int
    take: Take | None
    staged: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.entry.nbytes


class Stream:
    """The tensor bytes of every shard, one after another, read from the source by stream offset."""

    def __init__(self, src: ModelSource, counters: Counters) -> None:
        self.segments: list[tuple[int, Shard]] = []  # (stream offset of the shard's data section, shard)
        at = 0
        for s in src.shards:
            self.segments.append((at, s))
            at += s.header.data_bytes  # type: ignore[union-attr]
        self.size = at
        self.readers = {id(s): ShardReader(s, False, counters) for _, s in self.segments}

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Stream bytes [lo, hi) into ``out[: hi - lo]``."""
        view = memoryview(out.numpy())
        for at, s in self.segments:
            n = s.header.data_bytes  # type: ignore[union-attr]
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                self.readers[id(s)].read(s.data_offset + a - at, view[a - lo : b - lo], b - a)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def _wanted(src: ModelSource, stream: Stream, spec: TensorParallel | None, keys: list[str] | None) -> list[Wanted]:
    table = src.tensors()
    starts = {id(s): at for at, s in stream.segments}
    out = []
    for name in keys if keys is not None else table:
        shard, e = table[name]
        out.append(Wanted(name, e, starts[id(shard)] + e.begin, spec.take(name, e.shape) if spec else None))
    return sorted(out, key=lambda w: w.start)


class Liveness:
    """Each rank stamps ``prefix/rank`` on the group's store; ``gone()`` names the still ones."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int) -> None:
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name="tierio-group-stamp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(STAMP_S):
            self._beats += 1
            try:
                self.store.set(f"{self.prefix}/{self.rank}", str(self._beats))
            except Exception:  # the store's host is gone: the collectives report it
                return

    def _stamps(self) -> list[bytes | None]:
        out: list[bytes | None] = []
        for r in range(self.size):
            try:
                out.append(self.store.get(f"{self.prefix}/{r}") if self.store.check([f"{self.prefix}/{r}"]) else None)
            except Exception:
                out.append(None)
        return out

    def gone(self) -> list[int]:
        before = self._stamps()
        time.sleep(4 * STAMP_S)
        after = self._stamps()
        return [r for r in range(self.size) if r != self.rank and (after[r] is None or after[r] == before[r])]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * STAMP_S)


def _group(group: Any) -> tuple[Any, Any, str]:
    """(the group, the store, a key prefix for this load agreed by every rank)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    group = group if group is not None else dist.group.WORLD
    tag = torch.tensor([time.time_ns() & ((1 << 62) - 1)])
    dist.broadcast(tag, dist.get_global_rank(group, 0), group=group)
    return group, distributed_c10d._get_default_store(), f"tierio/weights-group/{int(tag)}"


def load_group(source: str | Any, group: Any = None, shard: TensorParallel | None = None, keys: list[str] | None = None,
               options: LoadOptions | None = None, **overrides: Any) -> dict[str, torch.Tensor]:
    """Load ``source`` on every rank of ``group`` (default: the world) reading each byte from the
    source once between them; each rank keeps every tensor, or with ``shard=`` its slices.
    Collective: every rank of the group calls it. ``options`` as for :func:`load` (``chunk_bytes``
    per rank per window); the group's timeout bounds every wait; ``stats.remote_bytes`` (or
    ``buffered_bytes``) counts what this rank read from the source."""
    import torch.distributed as dist

    o = LoadOptions.resolve(options, overrides)
    stats = o.stats if o.stats is not None else LoadStats()
    with Timer(stats):
        src = source if isinstance(source, ModelSource) else resolve(source)
        spec = with_rules(shard, src) if shard is not None else None
        sub, store, prefix = _group(group)
        rank, size = dist.get_rank(sub), dist.get_world_size(sub)
        live = Liveness(store, prefix, rank, size)
        counters = Counters(progress=o.progress)
        stream = Stream(src, counters)
        try:
            out = _exchange(stream, _wanted(src, stream, spec, keys), sub, rank, size, int(o.chunk_bytes), stats)
        except RuntimeError as exc:
            gone = live.gone()
            who = f"rank(s) {gone} of the group" if gone else "a rank of the group"
            raise GroupError(f"cooperative load of {src.url} failed on rank {rank}: {who} stopped answering ({str(exc)[:200]}); "
                             "restart the load without it, or load independently with weights.load") from None
        finally:
            stream.close()
            live.close()
        stats.source, stats.method, stats.device = src.url, "group", "cpu"
        stats.add_read(counters, files=len(src.shards))
        stats.bytes = counters.direct_bytes + counters.buffered_bytes + counters.remote_bytes
        stats.tensors += len(out)
        stats.extra["group"] = f"rank {rank} of {size}"
        if spec is not None:
            stats.extra["tp"] = f"rank {spec.rank} of {spec.size}"
    return out


def _exchange(stream: Stream, wanted: list[Wanted], group: Any, rank: int, size: int, chunk: int,
              stats: LoadStats) -> dict[str, torch.Tensor]:
    """Read this rank's part of every window (the next one while this one is exchanged), exchange,
    verify, keep."""
    import torch.distributed as dist

    mine = [torch.empty(chunk, dtype=torch.uint8) for _ in range(2)]
    parts = [torch.empty(chunk, dtype=torch.uint8) for _ in range(size)]
    sums = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    out: dict[str, torch.Tensor] = {}
    starts = list(range(0, stream.size, chunk * size))

    def read(k: int) -> torch.Tensor:
        lo = min(starts[k] + rank * chunk, stream.size)
        hi = min(lo + chunk, stream.size)
        stream.read(lo, hi, mine[k % 2])
        return torch.tensor([hi - lo, _signed(xxh3_int(memoryview(mine[k % 2].numpy())[: hi - lo]))])

    nxt = 0
    pending = submit(partial(read, 0)) if starts else None
    try:
        for k, w0 in enumerate(starts):
            assert pending is not None
            mine_sum = pending.result()
            pending = submit(partial(read, k + 1)) if k + 1 < len(starts) else None
            dist.all_gather(sums, mine_sum, group=group)
            dist.all_gather(parts, mine[k % 2], group=group)
            for r in range(size):
                n, want = int(sums[r][0]), int(sums[r][1])
                if _signed(xxh3_int(memoryview(parts[r].numpy())[:n])) != want:  # damaged on its way: read it here
                    a = w0 + r * chunk
                    stream.read(a, a + n, parts[r])
                    stats.extra["parts_read_again"] = stats.extra.get("parts_read_again", 0) + 1
            nxt = _deliver(wanted, nxt, parts, w0, min(w0 + chunk * size, stream.size), chunk, out)
    finally:
        if pending is not None:
            settle_all([pending])
    for w in wanted[nxt:]:  # empty tensors at the very end own no bytes of any window
        if w.name not in out:
            _finish(w, out)
    return out


def _deliver(wanted: list[Wanted], nxt: int, parts: list[torch.Tensor], w0: int, end: int, chunk: int,
             out: dict[str, torch.Tensor]) -> int:
    """Copy the window [w0, end) into the tensors crossing it; finish the complete ones."""
    i = nxt
    while i < len(wanted) and wanted[i].start < end:
        w = wanted[i]
        i += 1
        if w.name in out:
            continue
        if w.staged is None:
            w.staged = torch.empty(w.entry.nbytes, dtype=torch.uint8)
        a, b = max(w.start, w0), min(w.end, end)
        while a < b:  # piece by piece across the senders' parts
            r, off = divmod(a - w0, chunk)
            n = min(b - a, chunk - off)
            w.staged[a - w.start : a - w.start + n] = parts[r][off : off + n]
            a += n
        if w.end <= end:
            _finish(w, out)
    while nxt < len(wanted) and wanted[nxt].name in out:
        nxt += 1
    return nxt


def _finish(w: Wanted, out: dict[str, torch.Tensor]) -> None:
    dt = torch_dtype(w.entry.dtype)
    t = w.staged.view(dt).view(w.entry.shape) if w.staged is not None and w.entry.nbytes else torch.empty(w.entry.shape, dtype=dt)
    out[w.name] = t if w.take is None else cut(t, w.take)
    w.staged = None


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


__all__ = ["load_group"]
