"""Resharding: which stored chunks fill which part of which target, and the reads that do it.

A checkpoint stores every tensor as chunks placed by their global offsets (a rank's own tensor is
one "global" tensor of its own). A restore states what it wants as *targets*: a CPU tensor of the
stored dtype and the box of the global tensor it holds (a whole tensor, a DTensor's local shard, a
TensorSlice). For each target the chunks that overlap its box are found; they must not overlap
each other and must cover the box, else the error names the tensor and the files.

Each rank reads only the chunks that overlap its targets, and every chunk whole (its xxh3 covers
all of it). A chunk that lies entirely inside one target, at a contiguous stretch of its memory (a
restore onto the saved layout, or Shard(0) onto fewer ranks), is read straight into the target and
verified there; any other chunk is read into a reused buffer, verified, and its overlap copied out.
Both go through ``storage.scatter``: this module decides, it moves no bytes itself.

A chunk whose destination O_DIRECT cannot land in (its address and file offset differ modulo
4 KiB: a DTensor shard behind a safetensors header, nearly always) costs one copy whichever way it
is read, so on a store that can prefetch (a local directory) those chunks are asked for ahead, all
at once (up to ``AHEAD`` bytes beyond the reads): the device gets a deep queue instead of one
readahead window per read (a 4 -> 2 rank FSDP2 restore of 2 GiB, page cache dropped: 12-26% off
the median in three of four alternated sets on a loaded machine; docs/history/cluster.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from tierio.errors import FormatError
from tierio.format.manifest import ChunkInfo, RankEntry, file_key
from tierio.format.safetensors import torch_dtype
from tierio.format.slices import Box
from tierio.io.buffers import ALIGN, address_of
from tierio.io.checksum import verify_checksum
from tierio.io.engine import ByteRange
from tierio.storage.base import Store
from tierio.storage.scatter import Whole, read_scatter, read_whole


@dataclass(frozen=True)
class Piece:
    """One stored chunk: in ``file`` (rank ``rank``'s shard, or the earlier step's shard an incremental
    checkpoint refers to), holding ``chunk.shape`` at ``chunk.offsets``."""

    rank: int
    file: str
    chunk: ChunkInfo

    @property
    def box(self) -> Box:
        return Box(self.chunk.offsets, self.chunk.shape)


@dataclass
class Stored:
    """A tensor as the checkpoint holds it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return sorted({p.file for p in self.pieces})


def global_tensors(entries: Iterable[RankEntry]) -> dict[str, Stored]:
    """Every global tensor of the given (loaded) rank entries, its chunks from all of them."""
    out: dict[str, Stored] = {}
    for e in entries:
        for t in e.tensors.values():
            if t.is_global:
                s = out.setdefault(t.name, Stored(t.name, t.dtype, t.shape))
                s.pieces.extend(Piece(e.rank, c.file, c) for c in t.chunks)
    return out


def own_tensors(entry: RankEntry) -> dict[str, Stored]:
    """The tensors a rank saved as its own (whole, in its shard)."""
    return {t.name: Stored(t.name, t.dtype, t.shape, [Piece(entry.rank, c.file, c) for c in t.chunks])
            for t in entry.tensors.values() if not t.is_global}


@dataclass(frozen=True)
class Target:
    """Where restored bytes go: ``dest``, a contiguous CPU tensor of the stored dtype, holds ``box``
    (until a restore into new memory gives it memory: a stand-in of its shape and dtype)."""

    name: str
    dest: torch.Tensor
    box: Box


def _sweep_dim(pieces: list[Piece]) -> int:
    """The dimension along which the pieces start at the most places (sorting on it keeps the
    overlap sweep short for any sharding: Shard(0), Shard(1) or a grid)."""
    dims = len(pieces[0].chunk.offsets)
    return max(range(dims), key=lambda d: len({p.chunk.offsets[d] for p in pieces})) if dims else 0


def _overlaps(a: Box, b: Box) -> bool:
    return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def cover(stored: Stored, target: Target, where: str) -> list[tuple[Piece, Box]]:
    """The pieces that overlap ``target`` and what of them it needs. Overlapping pieces, or pieces
    that leave part of the target uncovered, are a FormatError naming the tensor and the files."""
    want = target.box
    hits = [(p, i) for p in stored.pieces if p.chunk.nbytes and (i := p.box.intersect(want)) is not None and i.numel]
    if hits:
        d = _sweep_dim([p for p, _ in hits])
        hits.sort(key=lambda h: h[0].chunk.offsets[d] if h[0].chunk.offsets else 0)
        for k, (p, _) in enumerate(hits):
            end = p.chunk.offsets[d] + p.chunk.shape[d] if p.chunk.offsets else 0
            for q, _ in hits[k + 1 :]:
                if q.chunk.offsets and q.chunk.offsets[d] >= end:
                    break
                if _overlaps(p.box, q.box):
                    raise FormatError(
                        f"{where}: tensor {stored.name!r} has overlapping chunks at offsets {list(p.chunk.offsets)} "
                        f"(in {p.file}) and {list(q.chunk.offsets)} (in {q.file}); the manifest is corrupt or hostile")
    covered = sum(i.numel for _, i in hits)
    if covered != want.numel:
        found = sorted({p.file for p, _ in hits})
        raise FormatError(
            f"{where}: tensor {stored.name!r}: the stored chunks cover {covered} of the {want.numel} elements at "
            f"offsets {list(want.offsets)} size {list(want.sizes)} that this restore needs (chunks found in "
            f"{', '.join(found) or 'no file'}); a chunk is missing: the checkpoint is incomplete or its manifest damaged")
    return hits


def region(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The view of ``t`` at ``offsets`` of ``sizes`` (per dimension)."""
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        if o or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


def contiguous_at(dest: torch.Tensor, rel: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
    """The byte offset in ``dest`` of the box ``rel``/``sizes`` when that box is one contiguous
    stretch of ``dest`` (a contiguous tensor, or a stand-in of its shape and dtype), else None."""
    full = tuple(dest.shape)
    last = max((i for i in range(len(sizes)) if sizes[i] != full[i]), default=0)
    if any(sizes[i] != 1 for i in range(last)):
        return None
    stride, at = 1, 0
    for o, n in zip(reversed(rel), reversed(full)):  # row-major strides, from the shape alone
        at += o * stride
        stride *= n
    return at * dest.element_size()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass
class FileReads:
    """What a restore reads from one file: chunks straight into target memory, and chunks read
    whole into a buffer and copied out (each with the targets and boxes it fills)."""

    file: str
    rank: int
    direct: list[tuple[Piece, memoryview]] = field(default_factory=list)
    staged: list[tuple[Piece, str, list[tuple[Target, Box]]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.chunk.nbytes for p, _ in self.direct) + sum(p.chunk.nbytes for p, _, _ in self.staged)


def plan_reads(wanted: list[tuple[Stored, Target]], where: str) -> dict[str, FileReads]:
    """Group what ``wanted`` needs by file: direct reads where a chunk maps onto contiguous target
    memory of exactly one target, staged reads otherwise."""
    uses: dict[tuple[str, int], tuple[Piece, str, list[tuple[Target, Box]]]] = {}
    for stored, target in wanted:
        if target.box.numel == 0:
            continue
        for piece, inter in cover(stored, target, where):
            key = (piece.file, piece.chunk.begin)
            uses.setdefault(key, (piece, stored.dtype, []))[2].append((target, inter))
    out: dict[str, FileReads] = {}
    for (file, _), (piece, dtype, fills) in sorted(uses.items()):
        fr = out.setdefault(file, FileReads(file, piece.rank))
        if len(fills) == 1 and fills[0][1] == piece.box:
            target = fills[0][0]
            rel = tuple(o - b for o, b in zip(piece.chunk.offsets, target.box.offsets))
            at = contiguous_at(target.dest, rel, piece.chunk.shape)
            if at is not None:
                fr.direct.append((piece, _bytes(target.dest)[at : at + piece.chunk.nbytes]))
                continue
        fr.staged.append((piece, dtype, fills))
    return out


def bounced(reads: FileReads) -> list[ByteRange]:
    """The chunks of ``reads`` that O_DIRECT could not land in their destination (a direct chunk
    whose address and file offset differ modulo 4 KiB, a staged chunk at an unaligned offset: its
    buffer is aligned): they are copied once whichever way they are read. In reading order: the direct chunks by
    offset, then the staged ones."""
    direct = [ByteRange(p.chunk.begin, p.chunk.end) for p, view in reads.direct
              if (address_of(view) - p.chunk.begin) % ALIGN]
    staged = [ByteRange(p.chunk.begin, p.chunk.end) for p, _, _ in reads.staged if p.chunk.begin % ALIGN]
    return sorted(direct, key=lambda r: r.start) + sorted(staged, key=lambda r: r.start)


AHEAD = 1 << 30  # bytes of one file asked for ahead of the chunks read (page cache, not a buffer)


@dataclass
class ReadAhead:
    """Asks for ``ranges`` (in reading order) ahead of the reads, at most ``limit`` bytes beyond the
    ranges read: a restore larger than memory must not evict the bytes it asked for before it
    reads them."""

    ask: Callable[[list[ByteRange]], None]
    ranges: list[ByteRange]
    limit: int = AHEAD
    _sizes: dict[int, int] = field(default_factory=dict)
    _next: int = 0
    _ahead: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._sizes = {r.start: r.end - r.start for r in self.ranges}

    def done(self, start: int | None) -> None:
        """The range at ``start`` has been read (None: nothing yet); ask for more while under the limit."""
        batch: list[ByteRange] = []
        with self._lock:
            self._ahead -= self._sizes.pop(start, 0) if start is not None else 0
            while self._next < len(self.ranges) and self._ahead < self.limit:
                r = self.ranges[self._next]
                batch.append(r)
                self._ahead += r.end - r.start
                self._next += 1
        if batch:
            self.ask(batch)


def read_file(store: Store, step: int, reads: FileReads, where: str) -> int:
    """Read one file's chunks from ``store`` into their targets, verifying every chunk; returns bytes.
    An IntegrityError leaves the targets partly written: the caller reads the file again elsewhere."""
    key = file_key(step, reads.file)  # a chunk of an incremental checkpoint may lie in an earlier step's shard
    ask = getattr(store, "prefetch", None)  # only stores with a page cache of their own have it
    ahead = ReadAhead(lambda ranges: ask(key, ranges), bounced(reads), AHEAD) if ask is not None else None
    if ahead is not None:
        ahead.done(None)

    def verify(i: int) -> None:  # as soon as the chunk is in, while other chunks are read
        p, view = reads.direct[i]
        if ahead is not None:
            ahead.done(p.chunk.begin)
        verify_checksum(view, p.chunk.xxh3, f"{where}, chunk at offsets {list(p.chunk.offsets)} (bytes {p.chunk.begin}..{p.chunk.end})")

    n = read_scatter(store, key, [(p.chunk.begin, view) for p, view in reads.direct], then=verify)

    def staged(piece: Piece, dtype: str, fills: list[tuple[Target, Box]]):
        def use(view: memoryview) -> None:
            if ahead is not None:
                ahead.done(piece.chunk.begin)
            verify_checksum(view, piece.chunk.xxh3,
                            f"{where}, chunk at offsets {list(piece.chunk.offsets)} (bytes {piece.chunk.begin}..{piece.chunk.end})")
            src = torch.frombuffer(view, dtype=torch.uint8)
            src = (src.view(torch_dtype(dtype)) if torch_dtype(dtype) != torch.uint8 else src).view(piece.chunk.shape)
            for target, inter in fills:
                here = tuple(o - b for o, b in zip(inter.offsets, piece.chunk.offsets))
                there = tuple(o - b for o, b in zip(inter.offsets, target.box.offsets))
                region(target.dest, there, inter.sizes).copy_(region(src, here, inter.sizes))
        return Whole(piece.chunk.begin, piece.chunk.nbytes, use)

    n += read_whole(store, key, [staged(p, dt, fills) for p, dt, fills in reads.staged])
    return n

