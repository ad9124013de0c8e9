"""Reading one tensor-parallel rank's slices: only the byte ranges the slices need.

A rank's part of a tensor (``tp.Take``) is one of two shapes in the file:

* **contiguous** (a dim-0 slice): one byte range, loaded like a whole tensor of the slice's shape
  (a narrower ``TensorEntry``), so it keeps every path of the loader: mapped views, private
  arenas, the GPU ring, streaming into ``load_into``'s targets;
* **strided** (a dim-1 slice, or a fused tensor's several ranges): one piece per row. A slice
  whose holes are at most ``gap`` bytes is read whole and cut (one larger read plus a copy: by
  ``load`` with the other entries, by ``load_into`` through the staging ring); one with larger
  holes is read by pieces: from a local file exactly (``io.gather``, widened to the device's
  logical block), from a remote store merged across holes up to the gap through the staging ring.
  ``gap`` = 0 reads exactly the slice. The default per source kind is a request's cost in bytes
  of transfer, measured (docs/weights.md, "tensor parallel").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from tierio.errors import ConfigError, NotFoundError
from tierio.format.safetensors import TensorEntry, itemsize, torch_dtype
from tierio.io.engine import ByteRange, Windowing, plan, run_windows
from tierio.io.gather import Gathered, gather
from tierio.io.untrusted import loads
from tierio.weights import engine
from tierio.weights.engine import Counters, Extent
from tierio.weights.sources import ModelSource, Shard, read_small_file
from tierio.weights.tp import Take, TensorParallel, preset

# Holes between a strided slice's row pieces read through rather than skipped: a hole costs its
# bytes of transfer, a piece read exactly costs a request. Measured (docs/weights.md, "tensor
# parallel"), with the contiguous slices in private memory: a rank alone reads a Llama shape at
# TP 4 in about the same time either way (exactly 0.30 s, its 6 KiB holes read through 0.26 s,
# 6 and 21 KiB holes read through 0.28 s) and four ranks at once from one disk read exactly a
# little faster, so only holes under a page are read through and a rank reads its slices' bytes.
# On a remote store a ranged GET costs milliseconds, so rows are read whole unless very long.
LOCAL_GAP = 4 << 10
REMOTE_GAP = 4 << 20
EXACT_TENSORS = 2  # local strided slices read at once (4 was no faster)
CONFIG_LIMIT = 4 << 20


def with_rules(spec: TensorParallel, src: ModelSource) -> TensorParallel:
    """``spec`` with its rules; a spec without them gets the preset of the model's config.json."""
    if spec.rules is not None:
        return spec
    raw = read_small_file(src, "config.json", CONFIG_LIMIT)
    if raw is None:
        raise ConfigError(f"{src.url} has no config.json to choose tensor-parallel rules from; "
                          "pass TensorParallel(rank, size, rules=...)")
    config = loads(raw, f"{src.url}/config.json", limit=CONFIG_LIMIT)
    if not isinstance(config, dict):
        raise ConfigError(f"{src.url}/config.json is not a JSON object; pass rules= explicitly")
    return spec.with_rules(preset(config))


def narrowed(e: TensorEntry, take: Take) -> TensorEntry:
    """The entry of a contiguous slice: the same name, its byte range and shape."""
    inner = math.prod(e.shape[take.dim + 1 :]) * itemsize(e.dtype)
    a, b = take.ranges[0]
    return replace(e, shape=take.shape(e.shape), begin=e.begin + a * inner, end=e.begin + b * inner)


@dataclass
class Strided:
    """One strided slice: its pieces (file offset, length, offset in ``dest``), sorted by file offset."""

    name: str
    shard: Shard
    entry: TensorEntry
    take: Take
    dest: torch.Tensor | None = None  # where the slice lands (contiguous, the file's dtype)

    def pieces(self) -> np.ndarray:
        e, t = self.entry, self.take
        inner = math.prod(e.shape[t.dim + 1 :]) * itemsize(e.dtype)
        outer = math.prod(e.shape[: t.dim])
        row, out_row = e.shape[t.dim] * inner, sum(b - a for a, b in t.ranges) * inner
        base = self.shard.data_offset + e.begin
        cols = np.cumsum([0] + [(b - a) * inner for a, b in t.ranges])
        rows = np.arange(outer, dtype=np.int64)[:, None]
        starts = np.array([a * inner for a, _ in t.ranges], dtype=np.int64)[None, :]
        file_off = (base + rows * row + starts).reshape(-1)
        length = np.broadcast_to(np.diff(cols)[None, :], (outer, len(t.ranges))).reshape(-1)
        dest_off = (rows * out_row + cols[:-1][None, :]).reshape(-1)
        return np.stack([file_off, length, dest_off], axis=1)


def smallest_hole(e: TensorEntry, take: Take) -> int:
    """The fewest bytes between two pieces of a strided slice in the file."""
    inner = math.prod(e.shape[take.dim + 1 :]) * itemsize(e.dtype)
    starts, ends = [a * inner for a, _ in take.ranges], [b * inner for _, b in take.ranges]
    holes = [s - t for s, t in zip(starts[1:], ends[:-1])]
    if math.prod(e.shape[: take.dim]) > 1:
        holes.append(e.shape[take.dim] * inner - ends[-1] + starts[0])
    return min(holes, default=0)


def default_gap(shard: Shard) -> int:
    return LOCAL_GAP if shard.path is not None else REMOTE_GAP


@dataclass
class SlicePlan:
    """How a rank's tensors are read: entries by shard (whole, contiguous slices, and whole tensors
    to cut after the read), the cuts, and the strided slices read by pieces."""

    selected: dict[Shard, list[tuple[str, TensorEntry]]]
    cuts: dict[str, Take]
    strided: list[Strided]


def split(src: ModelSource, spec: TensorParallel, names: Iterable[str], gap: int | None = None) -> SlicePlan:
    """The tensors ``names`` for ``spec``'s rank. A strided slice whose pieces lie at most ``gap``
    apart is read whole with the other entries and cut after (one larger read plus a copy);
    one with larger holes is read by pieces."""
    table = src.tensors()
    selected: dict[int, list[tuple[str, TensorEntry]]] = {}
    shards: dict[int, Shard] = {}
    out = SlicePlan({}, {}, [])
    for name in names:
        if name not in table:
            raise NotFoundError(f"{src.url} has no tensor {name!r}; `tierio weights inspect` lists them")
        shard, e = table[name]
        take = spec.take(name, e.shape)
        if take is not None and not take.contiguous(e.shape):
            if smallest_hole(e, take) > (default_gap(shard) if gap is None else gap):
                out.strided.append(Strided(name, shard, e, take))
                continue
            out.cuts[name], take = take, None
        selected.setdefault(id(shard), []).append((name, e if take is None else narrowed(e, take)))
        shards[id(shard)] = shard
    out.selected = {shards[i]: sorted(v, key=lambda t: t[1].begin) for i, v in selected.items()}
    return out


def cut(t: torch.Tensor, take: Take) -> torch.Tensor:
    """A rank's part of a whole tensor, contiguous (a copy)."""
    parts = [t.narrow(take.dim, a, b - a) for a, b in take.ranges]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, take.dim)).contiguous()


def read_strided(items: list[Strided], *, chunk_size: int, depth: int, direct: bool, gap: int | None = None) -> Counters:
    """Fill every item's ``dest`` (allocated here when None) with its slice; the bytes asked of the
    source (widened to its blocks, holes read through included). A slice of a local file whose
    holes exceed the gap is read exactly by ``io.gather``; the others go through the staging ring,
    their pieces merged across holes up to the gap."""
    counters = Counters()
    ring: list[Strided] = []
    exact: list[Strided] = []
    for it in items:
        if it.dest is None:
            it.dest = torch.empty(it.take.shape(it.entry.shape), dtype=torch_dtype(it.entry.dtype))
        g = default_gap(it.shard) if gap is None else gap
        (ring if it.shard.path is None or smallest_hole(it.entry, it.take) <= g else exact).append(it)

    def one(it: Strided) -> Gathered:
        assert it.shard.path is not None and it.dest is not None
        return gather(it.shard.path, it.pieces(), it.dest.reshape(-1).view(torch.uint8).numpy(), where=it.shard.where,
                      direct=direct)

    # a few tensors at once: one's setup and copy-out overlap another's reads
    for got in run_windows(exact, one, EXACT_TENSORS):
        counters.total += got.requested_bytes
        counters.add("direct_bytes" if got.direct else "buffered_bytes", got.requested_bytes)
    if ring:
        _read_ring(ring, chunk_size=chunk_size, depth=depth, direct=direct, gap=gap, counters=counters)
    return counters


def _read_ring(items: list[Strided], *, chunk_size: int, depth: int, direct: bool, gap: int | None,
               counters: Counters) -> None:
    """The slices through the staging ring: pieces merged across holes up to the gap, each window's
    pieces copied out."""
    extents: list[Extent] = []
    members: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(extent) -> (its pieces, the dest bytes)
    for it in items:
        assert it.dest is not None
        p = it.pieces()
        g = default_gap(it.shard) if gap is None else gap
        dest = it.dest.reshape(-1).view(torch.uint8).numpy()
        for r in plan([ByteRange(int(a), int(a + n)) for a, n, _ in p], Windowing(chunk_size, depth, merge_gap=g)):
            ext = Extent(it.shard, r.start, r.end)
            members[id(ext)] = (p[r.members], dest)
            extents.append(ext)

    def sink(ext: Extent, rel: int, view: memoryview, n: int, buf: object) -> None:
        pieces, dest = members[id(ext)]
        lo_w = ext.start + rel
        hi_w = lo_w + n
        win = np.frombuffer(view, np.uint8, count=n)
        first = max(0, int(np.searchsorted(pieces[:, 0], lo_w, side="right")) - 1)
        for off, length, at in pieces[first:]:
            if off >= hi_w:
                break
            lo, hi = max(off, lo_w), min(off + length, hi_w)
            if lo < hi:
                dest[at + lo - off : at + hi - off] = win[lo - lo_w : hi - lo_w]

    counters.total += sum(x.end - x.start for x in extents)
    engine.read_through_ring(extents, sink, chunk_size=chunk_size, depth=depth, direct=direct, counters=counters)


def targets(src: ModelSource, spec: TensorParallel, dests: dict[str, torch.Tensor]
            ) -> tuple[dict[str, tuple[torch.Tensor, Shard, TensorEntry]], list[Strided]]:
    """``load_into``'s targets for a rank: (destination, shard, entry) streamed in place, and the
    strided slices (read into the destination itself when it is a contiguous CPU tensor of the
    file's dtype, else into a temporary that ``fill_targets`` copies over)."""
    table = src.tensors()
    plain: dict[str, tuple[torch.Tensor, Shard, TensorEntry]] = {}
    strided: list[Strided] = []
    for name, dst in dests.items():
        shard, e = table[name]
        take = spec.take(name, e.shape)
        want = e.shape if take is None else take.shape(e.shape)
        if tuple(dst.shape) != want:
            raise ConfigError(f"tensor {name!r}: target shape {tuple(dst.shape)} but rank {spec.rank} of {spec.size} "
                              f"holds {list(want)} of {shard.where}'s {list(e.shape)}")
        if take is None or take.contiguous(e.shape):
            plain[name] = (dst, shard, e if take is None else narrowed(e, take))
            continue
        direct = dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == torch_dtype(e.dtype)
        strided.append(Strided(name, shard, e, take, dst if direct else None))
    return plain, strided


def fill_targets(strided: list[Strided], dests: dict[str, torch.Tensor]) -> None:
    """Copy the strided slices read into temporaries over their destinations."""
    with torch.no_grad():
        for it in strided:
            if it.dest is not dests[it.name]:
                dests[it.name].copy_(it.dest)


def assemble(out: dict[str, torch.Tensor], strided: list[Strided], device: torch.device) -> None:
    """Add the strided slices to ``out`` (moved to the load's device)."""
    for it in strided:
        assert it.dest is not None
        out[it.name] = it.dest if device.type == "cpu" else it.dest.to(device)


__all__ = ["LOCAL_GAP", "REMOTE_GAP", "SlicePlan", "Strided", "assemble", "cut", "default_gap", "fill_targets", "narrowed",
           "read_strided", "smallest_hole", "split", "targets", "with_rules"]
