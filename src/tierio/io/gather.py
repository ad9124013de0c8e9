"""Reading many small pieces of one local file into memory: exactly their bytes, many in flight.

Why: a tensor-parallel rank's dim-1 slice is one piece per row (2 KiB pieces 8 KiB apart for a
Llama ``o_proj`` at TP 4). Read one request per piece through the windowed engine (a staging
buffer, a Python sink and a search per window), the per-piece overhead cost five times the time
of reading the whole tensor; widened to the 4 KiB grid, a 2 KiB piece read twice its bytes.

Here each piece's range is widened only to the device's *logical* block (512 B on most disks,
read from /sys; 4 KiB where it cannot be known), pieces whose widened ranges touch are merged
into one request. O_DIRECT requests go through native AIO (io.aio: ``io_submit`` batches,
AIO_DEPTH in flight, from the calling thread); otherwise batches of consecutive requests run
``depth`` at a time on the shared I/O pool, one ``preadv`` per request. Either way a group of
requests lands in a page-aligned scratch buffer and its pieces are copied out with one strided
numpy copy when they are regular (the rows of a slice: the same length, the same misalignment,
evenly spaced), else piece by piece.

Without O_DIRECT (tmpfs, some FUSE mounts, or a range already in the page cache) the reads are
buffered, exactly the pieces, on a descriptor marked POSIX_FADV_RANDOM, so readahead does not pull
the holes in (the page cache still reads the pages a piece touches). ``Gathered.requested_bytes``
counts the requests as asked of the file: widened to the block by O_DIRECT, not only the bytes kept.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierio.errors import IntegrityError, os_error
from tierio.io import aio
from tierio.io.buffers import ALIGN, HostBuffer, address_of, shared_pool
from tierio.io.direct import open_file
from tierio.io.engine import run_windows
from tierio.io.pagecache import queue_value, range_resident

BATCH_BYTES = 1 << 20  # scratch per batch in flight: many rows per task, little memory
BATCH_REQUESTS = 256  # at most this many requests per batch (fewer: more numpy work per request)
MIN_BATCH = 8  # at least this many, unless the tensor has fewer
GATHER_DEPTH = 32  # batches in flight: the device's queue wants tens of small reads (docs/weights.md)
AIO_DEPTH = 128  # requests in flight through native AIO (128 tags in this disk's queue; deeper read no faster)
AIO_SCRATCH_BYTES = 8 << 20  # scratch per group of AIO requests
SCRATCH_BUDGET = 64 << 20  # all scratch buffers of the process's gathers together
RESIDENT = 0.5  # a span at least this much in the page cache is read buffered (a memcpy)


@dataclass(frozen=True)
class Gathered:
    """What one ``gather`` asked of the file: bytes (the widened requests), requests, and whether by O_DIRECT."""

    requested_bytes: int
    requests: int
    direct: bool


def logical_block(fd: int) -> int:
    """The O_DIRECT alignment of an open file's device: its logical block size (ALIGN if unknown)."""
    size = queue_value(os.fstat(fd).st_dev, "logical_block_size")
    return size if size and size <= ALIGN and ALIGN % size == 0 else ALIGN


def split_long(pieces: np.ndarray, most: int) -> np.ndarray:
    """``pieces`` with every piece cut at the multiples of ``most`` (a multiple of the block) in the
    file, so no request needs more scratch than that."""
    ends = pieces[:, 0] + pieces[:, 1]
    if not (ends - 1 >= (pieces[:, 0] // most + 1) * most).any():
        return pieces
    rows = []
    for off, n, at in pieces.tolist():
        end = off + n
        while off < end:
            step = min(end, (off // most + 1) * most) - off
            rows.append((off, step, at))
            off, at = off + step, at + step
    return np.array(rows, dtype=np.int64)


def requests(pieces: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Requests for ``pieces`` (rows of file offset, length, ..., sorted by offset) widened to
    ``block``: (starts, ends, the last byte any piece needs + 1, the request of each piece).
    Widened ranges that share a block merge into one request."""
    lo = pieces[:, 0] // block * block
    end = pieces[:, 0] + pieces[:, 1]
    hi = -(-end // block) * block
    new = np.ones(len(pieces), dtype=bool)
    new[1:] = lo[1:] >= np.maximum.accumulate(hi)[:-1]
    first = np.flatnonzero(new)
    return lo[new], np.maximum.reduceat(hi, first), np.maximum.reduceat(end, first), np.cumsum(new) - 1


def batches(starts: np.ndarray, ends: np.ndarray, depth: int) -> list[tuple[int, int]]:
    """Consecutive requests [first, last) per batch: the requests spread over ``depth`` batches, each
    within BATCH_REQUESTS and BATCH_BYTES of scratch (a request larger than that is a batch of its own)."""
    most = min(BATCH_REQUESTS, max(MIN_BATCH, -(-len(starts) // depth)))
    out, first, size = [], 0, 0
    for i, n in enumerate((ends - starts).tolist()):
        if i > first and (i - first >= most or size + n > BATCH_BYTES):
            out.append((first, i))
            first, size = i, 0
        size += n
    if len(starts):
        out.append((first, len(starts)))
    return out


class _Unaligned(Exception):
    """O_DIRECT refused the logical block alignment (EINVAL): the file system wants more."""


def _copy_out(scratch: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray, dest: np.ndarray) -> None:
    """dest[dst[i] : dst[i] + length[i]] = scratch[src[i] : ...] for every piece i; one strided copy
    when the pieces are evenly spaced on both sides and equally long."""
    k = len(src)
    if k > 1 and (length == length[0]).all():
        ds, dd = np.diff(src), np.diff(dst)
        if (ds == ds[0]).all() and (dd == dd[0]).all() and ds[0] >= length[0] and dd[0] >= length[0]:
            n, s0, d0 = int(length[0]), int(src[0]), int(dst[0])
            view = np.lib.stride_tricks.as_strided
            out = view(dest[d0:], shape=(k, n), strides=(int(dd[0]), 1))
            out[...] = view(scratch[s0:], shape=(k, n), strides=(int(ds[0]), 1))
            return
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist()):
        dest[d : d + n] = scratch[s : s + n]


def _copy_group(scratch: np.ndarray, at: np.ndarray, a: int, b: int, which: np.ndarray, pieces: np.ndarray,
                starts: np.ndarray, dest: np.ndarray) -> None:
    """Copy out the pieces of requests ``a`` to ``b - 1``, read into ``scratch`` at offsets ``at``."""
    i0, i1 = np.searchsorted(which, [a, b])
    mine, req = pieces[i0:i1], which[i0:i1]
    _copy_out(scratch, at[req - a] + mine[:, 0] - starts[req], mine[:, 2], mine[:, 1], dest)


@contextmanager
def _scratch(sizes: np.ndarray, most: int) -> Iterator[tuple[HostBuffer, np.ndarray]]:
    """A buffer holding a group of requests of ``sizes`` back to back, and where each lands in it:
    from the shared pool when the group fits ``most`` bytes, else one of its own (pieces packed
    closer than a block merge into requests of any length)."""
    at = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=at[1:])
    total = int(at[-1])
    pool = shared_pool("gather", SCRATCH_BUDGET)
    buf = pool.acquire(total) if total <= most else HostBuffer(total, pin=False)
    try:
        yield buf, at
    finally:
        if total <= most:
            pool.release(buf)


def _gather(fd: int, where: str, pieces: np.ndarray, dest: np.ndarray, block: int, direct: bool,
            depth: int, use_aio: bool) -> Gathered:
    pieces = split_long(pieces, BATCH_BYTES // 2)
    starts, ends, needs, which = requests(pieces, block)
    sizes = ends - starts

    def body(span: tuple[int, int]) -> None:
        a, b = span
        with _scratch(sizes[a:b], BATCH_BYTES) as (buf, at):
            view, unaligned = buf.view, direct and block < ALIGN
            for lo, n, end, put in zip(starts[a:b].tolist(), sizes[a:b].tolist(), needs[a:b].tolist(), at.tolist()):
                _read(fd, view[put : put + n], lo, end - lo, where, unaligned)
            _copy_group(buf.array, at, a, b, which, pieces, starts, dest)

    if direct and use_aio and aio.available():
        try:
            _gather_aio(fd, where, pieces, dest, starts, sizes, needs, which, block)
            return Gathered(int(sizes.sum()), len(starts), direct)
        except _NoContext:
            pass  # no AIO context to be had (fs.aio-max-nr reached): threads instead
    run_windows(batches(starts, ends, depth), body, depth)
    return Gathered(int(sizes.sum()), len(starts), direct)


class _NoContext(Exception):
    """io_setup failed: the caller reads with threads."""


def _gather_aio(fd: int, where: str, pieces: np.ndarray, dest: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                needs: np.ndarray, which: np.ndarray, block: int) -> None:
    """The O_DIRECT requests through native AIO from this thread, AIO_SCRATCH_BYTES of scratch at a time."""
    try:
        ctx = aio.thread_context(AIO_DEPTH)
    except OSError as exc:
        raise _NoContext() from exc
    ends = np.cumsum(sizes)
    a = 0
    while a < len(starts):
        # a group of requests fitting the scratch (at least one, however large)
        b = max(a + 1, int(np.searchsorted(ends, ends[a] - sizes[a] + AIO_SCRATCH_BYTES, side="right")))
        with _scratch(sizes[a:b], AIO_SCRATCH_BYTES) as (buf, at):
            try:
                got = ctx.read(fd, starts[a:b], sizes[a:b], address_of(buf.array) + at[:-1].astype(np.uint64))
            except OSError as exc:
                raise os_error(exc, where, "reading") from exc
            short = np.flatnonzero(got < needs[a:b] - starts[a:b])
            for j in short.tolist():  # an error, or a read cut short (the end of the file): once more, by preadv
                if got[j] < 0 and -got[j] == errno.EINVAL and block < ALIGN:
                    raise _Unaligned()
                if got[j] < 0:
                    raise os_error(OSError(-int(got[j]), os.strerror(-int(got[j]))), where, "reading")
                lo, n = int(starts[a + j]), int(sizes[a + j])
                _read(fd, buf.view[int(at[j]) : int(at[j]) + n], lo, int(needs[a + j]) - lo, where, False)
            _copy_group(buf.array, at, a, b, which, pieces, starts, dest)
        a = b


def _read(fd: int, view: memoryview, offset: int, need: int, where: str, may_be_unaligned: bool) -> None:
    """Read into ``view`` from ``offset`` until at least ``need`` bytes have arrived."""
    got = 0
    while got < need:
        try:
            more = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            if may_be_unaligned and exc.errno == errno.EINVAL:
                raise _Unaligned() from exc
            raise os_error(exc, where, "reading") from exc
        if more == 0:
            raise IntegrityError(f"{where} ended at byte {offset + got}, expected at least {offset + need}: "
                                 "the file is truncated")
        got += more


def gather(path: str | Path, pieces: np.ndarray, dest: np.ndarray, *, where: str | None = None, direct: bool = True,
           depth: int = GATHER_DEPTH, use_aio: bool = True) -> Gathered:
    """Copy every piece (rows of file offset, length, offset in ``dest``; sorted by file offset) of
    the file ``path`` into the uint8 array ``dest``. ``use_aio``: O_DIRECT requests through native
    AIO where available (else ``depth`` threads)."""
    where = where or str(path)
    if not len(pieces):
        return Gathered(0, 0, False)
    span = int(pieces[0, 0]), int(pieces[-1, 0] + pieces[-1, 1])
    fd, is_direct = open_file(path, write=False, direct=direct)
    if is_direct and range_resident(fd, span[0], span[1] - span[0]) >= RESIDENT:
        os.close(fd)  # already in memory: a buffered read is a memcpy
        fd, is_direct = open_file(path, write=False, direct=False)
    try:
        if is_direct:
            try:
                return _gather(fd, where, pieces, dest, logical_block(fd), True, depth, use_aio)
            except _Unaligned:  # the file system wants more than the device's logical block
                return _gather(fd, where, pieces, dest, ALIGN, True, depth, use_aio)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # this descriptor only: no readahead into the holes
        return _gather(fd, where, pieces, dest, 1, False, depth, False)
    finally:
        os.close(fd)


__all__ = ["BATCH_BYTES", "GATHER_DEPTH", "Gathered", "gather", "logical_block", "requests"]
