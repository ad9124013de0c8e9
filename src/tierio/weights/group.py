"""Cooperative loads: the ranks of a process group read a model from its source once between them.

The model's tensor bytes, shard after shard, form one stream cut into windows of N parts
(``chunk_bytes`` each, N = the group's size). Rank r reads part r of every window from the source
(S3 or a shared filesystem) and checksums it (xxh3). How the parts reach the other ranks:

* Ranks of one node (``tierio.dist.node_key``: ``TIERIO_NODE``, else host, boot id and pid
  namespace) share one memory file (``node_share``): each rank reads its parts straight into it,
  parts cross to each other node once, point to point (to the rank there with the sender's local
  index, wrapped around when that node has fewer ranks), and only the checksums are gathered over
  the group. Then every rank maps the file copy-on-write, checks every part against its sender's
  checksum (reading one that fails again from the source into its own pages) and keeps views of the
  mapping (one copy of the model in the node's memory, whatever the number of ranks), or with
  ``mapped=False`` or ``shard=`` (its tensor-parallel slices) copies of its own. On a 2-core VM the
  loopback sockets cost about as much CPU per byte as the S3 GETs; memory costs a page mapping.
* Where a node cannot make that file (too little memory, no memfd) or every rank is alone on its
  node: the parts and checksums are exchanged with ``all_gather`` (gloo on CPU), every rank checks
  what it received and re-reads a failed part, and copies out of the window what it keeps (cut when
  a tensor is complete, so at most a window and the tensors crossing it are held beyond it).

A rank that dies breaks its connections at once; one that stops answering is given up after the
process group's timeout (``init_process_group(timeout=...)``). Every rank stamps a key of the
group's store twice a second, so the others raise a GroupError naming the ranks whose stamps
stopped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from tierio.errors import GroupError
from tierio.format.safetensors import TensorEntry, torch_dtype
from tierio.io.buffers import ALIGN
from tierio.io.checksum import xxh3_int
from tierio.dist import node_key
from tierio.io.engine import drain, settle_all, submit
from tierio.weights.engine import DEFAULT_DEPTH, Counters, ShardReader
from tierio.weights.loader import Timer, _view
from tierio.weights.node_share import SharedStream, share
from tierio.weights.options import LoadOptions
from tierio.weights.sliced import cut, with_rules
from tierio.weights.sources import ModelSource, Shard, resolve
from tierio.weights.stats import LoadStats
from tierio.weights.tp import Take, TensorParallel

log = logging.getLogger(__name__)
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
    """The tensor bytes of every shard, one after another, read from the source by stream offset.

    Each shard's data section starts at a stream offset equal to its file offset modulo 4 KiB (the
    gap before it is never read): a tensor aligned in its file is aligned in the stream, so views of
    a mapping of the stream need no copy (after a shard of odd size, every tensor would)."""

    def __init__(self, src: ModelSource, counters: Counters) -> None:
        self.segments: list[tuple[int, Shard]] = []  # (stream offset of the shard's data section, shard)
        at = 0
        for s in src.shards:
            at += (s.data_offset - at) % ALIGN
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


@dataclass(frozen=True)
class Nodes:
    """The group's ranks by node: ``of[r]`` is rank r's node, ``ranks[m]`` node m's ranks (ascending)."""

    of: list[int]
    ranks: list[list[int]]

    @classmethod
    def from_keys(cls, keys: list[str]) -> Nodes:
        index: dict[str, int] = {}
        of = [index.setdefault(k, len(index)) for k in keys]
        return cls(of, [[r for r, m in enumerate(of) if m == n] for n in range(len(index))])

    def receiver(self, sender: int, node: int) -> int:
        """The rank of ``node`` that receives ``sender``'s parts from across nodes: the one with the
        sender's local index, wrapped around when ``node`` has fewer ranks."""
        peers = self.ranks[node]
        return peers[self.ranks[self.of[sender]].index(sender) % len(peers)]


def _agree(group: Any) -> tuple[Any, Any, str, Nodes]:
    """(the group, the store, a token naming this load agreed by every rank, the ranks by node)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    group = group if group is not None else dist.group.WORLD
    got: list[Any] = [None] * dist.get_world_size(group)
    mine = uuid.uuid4().hex if dist.get_rank(group) == 0 else ""
    dist.all_gather_object(got, (mine, node_key()), group=group)
    return group, distributed_c10d._get_default_store(), got[0][0], Nodes.from_keys([k for _, k in got])


def load_group(source: str | Any, group: Any = None, shard: TensorParallel | None = None, keys: list[str] | None = None,
               options: LoadOptions | None = None, **overrides: Any) -> dict[str, torch.Tensor]:
    """Load ``source`` on every rank of ``group`` (default: the world) reading each byte from the
    source once between them; each rank keeps every tensor (``mapped``, the default: copy-on-write
    views of its node's one copy; ``mapped=False``: its own copies), or with ``shard=`` its slices.
    Collective: every rank of the group calls it. ``options`` as for :func:`load` (``chunk_bytes``
    per rank per window); the group's timeout bounds every wait; ``stats.remote_bytes`` (or
    ``buffered_bytes``) counts what this rank read from the source; ``stats.extra["group_exchange"]``
    says how the parts went round."""
    import torch.distributed as dist

    o = LoadOptions.resolve(options, overrides)
    stats = o.stats if o.stats is not None else LoadStats()
    with Timer(stats):
        src = source if isinstance(source, ModelSource) else resolve(source)
        spec = with_rules(shard, src) if shard is not None else None
        try:
            sub, store, token, nodes = _agree(group)
        except RuntimeError as exc:
            raise _lost(src.url, dist.get_rank(), [], exc) from None
        rank, size = dist.get_rank(sub), dist.get_world_size(sub)
        live = Liveness(store, f"tierio/weights-group/{token}", rank, size)
        counters = Counters(progress=o.progress)
        stream = Stream(src, counters)
        shared: SharedStream | None = None
        try:
            wanted = _wanted(src, stream, spec, keys)
            why = "every rank is alone on its node" if max(map(len, nodes.ranks)) < 2 else ""
            if not why and stream.size:
                shared, why = share(stream.size, token, nodes.ranks[nodes.of[rank]][0], rank, sub,
                                    _writes(stream.size, int(o.chunk_bytes), rank, nodes))
                if shared is None:
                    log.warning("cooperative load of %s exchanges over the group only: no node-local memory (%s)", src.url, why)
            if shared is not None:
                out = _node_exchange(stream, shared, wanted, sub, rank, nodes, int(o.chunk_bytes), o.mapped, stats)
                stats.extra["group_exchange"] = f"node-local memory, {len(nodes.ranks)} node(s)"
            else:
                out = _exchange(stream, wanted, sub, rank, size, int(o.chunk_bytes), stats)
                stats.extra["group_exchange"] = f"group ({why})" if why else "group"
        except RuntimeError as exc:
            raise _lost(src.url, rank, live.gone(), exc) from None
        finally:
            if shared is not None:
                shared.close()
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


def _lost(url: str, rank: int, gone: list[int], exc: Exception) -> GroupError:
    who = f"rank(s) {gone} of the group" if gone else "a rank of the group"
    return GroupError(f"cooperative load of {url} failed on rank {rank}: {who} stopped answering ({str(exc)[:200]}); "
                      "restart the load without it, or load independently with weights.load")


def _windows(size: int, chunk: int, ranks: int) -> list[int]:
    return list(range(0, size, chunk * ranks))


def _part(w0: int, r: int, chunk: int, size: int) -> tuple[int, int]:
    """Stream bytes [lo, hi) of rank r's part of the window starting at ``w0``."""
    lo = min(w0 + r * chunk, size)
    return lo, min(lo + chunk, size)


def _writes(size: int, chunk: int, rank: int, nodes: Nodes) -> list[tuple[int, int]]:
    """The stream ranges this rank fills in its node's file: its own parts and those it receives
    from across nodes."""
    here = nodes.of[rank]
    senders = [rank] + [q for q in range(len(nodes.of)) if nodes.of[q] != here and nodes.receiver(q, here) == rank]
    return [_part(w0, q, chunk, size) for w0 in _windows(size, chunk, len(nodes.of)) for q in senders]


def _node_exchange(stream: Stream, shared: SharedStream, wanted: list[Wanted], group: Any, rank: int, nodes: Nodes,
                   chunk: int, mapped: bool, stats: LoadStats) -> dict[str, torch.Tensor]:
    """Read this rank's parts into the node's memory file (the next while this one crosses to the
    other nodes), gather every part's checksum, verify each part in a private mapping (re-reading
    a damaged one from the source), keep."""
    import torch.distributed as dist

    size, n = stream.size, len(nodes.of)
    starts = _windows(size, chunk, n)
    buf = shared.bytes
    assert buf is not None
    sums = torch.zeros(len(starts), 2, dtype=torch.int64)
    here = nodes.of[rank]
    others = [m for m in range(len(nodes.ranks)) if m != here]
    # the parts this rank receives from across nodes: (sender, node-local receiver is this rank)
    senders = [q for q in range(n) if nodes.of[q] != here and nodes.receiver(q, here) == rank]

    def read(k: int) -> None:
        lo, hi = _part(starts[k], rank, chunk, size)
        shared.writable(lo, hi)
        stream.read(lo, hi, buf[lo:hi])
        sums[k] = torch.tensor([hi - lo, _signed(xxh3_int(memoryview(buf[lo:hi].numpy())))])

    pending = submit(partial(read, 0)) if starts else None
    try:
        for k, w0 in enumerate(starts):
            assert pending is not None
            pending.result()
            pending = submit(partial(read, k + 1)) if k + 1 < len(starts) else None
            works = []
            lo, hi = _part(w0, rank, chunk, size)
            if hi > lo:
                for m in others:
                    works.append(dist.isend(buf[lo:hi], dist.get_global_rank(group, nodes.receiver(rank, m)), group=group))
            for q in senders:
                a, b = _part(w0, q, chunk, size)
                if b > a:
                    shared.writable(a, b)
                    works.append(dist.irecv(buf[a:b], dist.get_global_rank(group, q), group=group))
            for w in works:
                w.wait()
    finally:
        if pending is not None:
            settle_all([pending])
    every = [torch.zeros_like(sums) for _ in range(n)]
    dist.all_gather(every, sums, group=group)  # also the barrier: every part of every node is in
    mine = shared.private()
    base = mine.tensor()
    spans = [(_part(w0, r, chunk, size), int(every[r][k][1])) for k, w0 in enumerate(starts) for r in range(n)]
    bad: list[tuple[int, int]] = []

    def verify(i: int) -> None:
        (lo, hi), want = spans[i]
        mine.populate(lo, hi - lo)
        if hi > lo and _signed(xxh3_int(mine.view[lo:hi])) != want:
            bad.append((lo, hi))

    drain(range(len(spans)), verify, DEFAULT_DEPTH)
    for lo, hi in sorted(bad):  # damaged in the node's file: read here, into this rank's own pages
        stream.read(lo, hi, base[lo:hi])
        stats.extra["parts_read_again"] = stats.extra.get("parts_read_again", 0) + 1
    out: dict[str, torch.Tensor] = {}
    for w in wanted:
        if w.name in out:
            continue
        if not w.entry.nbytes:
            _finish(w, out)
            continue
        t = _view(base, w.start, w.entry, stats)
        if w.take is not None:
            t = cut(t, w.take)
            t = t.clone() if t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() else t
        elif not mapped:
            t = t.clone()
        out[w.name] = t
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
