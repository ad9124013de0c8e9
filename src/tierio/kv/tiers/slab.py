"""The local NVMe tier: preallocated slab files of fixed, aligned slots, and a persisted index.

One file per block would cost a create, an fsync-able directory entry and an unlink per block, and
leave the filesystem fragmented; a slab is allocated once (fallocate) and its slots are rewritten
in place with O_DIRECT, so a block costs one aligned write and one 64-byte index record. The
tier survives its process: the next process to open the directory finds every committed block
(see ``slabindex`` for the commit protocol) and reuses it. One process owns a directory at a
time (an flock on ``.lock``, released by the kernel when the owner dies, so a killed server's
directory is reusable at once).

If the filesystem cannot hold the whole budget, the tier keeps the slabs that fit, says so, and
counts it; slots are already allocated, so a full disk cannot fail a later block write.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierio.errors import ConfigError, IntegrityError, NotFoundError, StorageError, TierioError
from tierio.io.buffers import ALIGN, address_of
from tierio.io.durable import write_json_atomic
from tierio.io.files import bounce_pool, os_error, pread_full, pwrite_all, read_into
from tierio.io.paths import open_beneath
from tierio.kv.tiers.slabindex import (
    FREE_RECORD, HEADER_LIMIT, HEADER_NAME, INDEX_NAME, LOCK_NAME, RECORD_BYTES, Geometry, SlotRecord,
    parse_header, parse_index, slab_name,
)
from tierio.kv.tiers.slots import FreeSlots
from tierio.kv.stats import KVTier

log = logging.getLogger(__name__)

_SLAB_FILE = re.compile(r"slab-(\d{5})\.kv")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass
class SlabFile:
    path: Path
    fd: int
    direct: bool


@dataclass
class OpenReport:
    """What opening a tier found: committed records, damaged ones, and what it had to give up."""

    records: list[SlotRecord] = field(default_factory=list)
    discarded: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    disk_full: bool = False
    notes: list[str] = field(default_factory=list)


def _open_rw(directory: Path, name: str, direct: bool) -> tuple[int, bool]:
    """Open ``directory/name`` read-write (created if missing), following no symlink; O_DIRECT
    where the filesystem accepts it."""
    flags = os.O_RDWR | os.O_CREAT
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return open_beneath(directory, name, flags | os.O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise os_error(exc, directory / name, "opening") from exc
    try:
        return open_beneath(directory, name, flags), False
    except OSError as exc:
        raise os_error(exc, directory / name, "opening") from exc


def _lock(directory: Path) -> int:
    fd, _ = _open_rw(directory, LOCK_NAME, direct=False)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StorageError(f"the NVMe KV tier {directory} is in use by another process (pid {owner}); "
                               "each tier belongs to one process at a time: give this one its own directory") from None
        raise os_error(exc, directory / LOCK_NAME, "locking") from exc
    try:  # who holds it, for the message above; informational only (a full disk may refuse it)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


def read_header(directory: Path):
    """The parsed header of ``directory``, or None when it has none (NotFoundError is swallowed)."""
    try:
        fd = open_beneath(directory, HEADER_NAME)
    except NotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(HEADER_LIMIT + 1)
    return parse_header(raw, str(directory / HEADER_NAME))


class SlabTier(FreeSlots):
    """Slots in slab files under one directory; free-slot bookkeeping changes only under the
    router's lock, reads and writes run outside it (each on its own slot). The free list is made
    once the index has been read (``_open_index``): the slots its records hold are not free."""

    kind = KVTier.NVME

    def __init__(self, directory: str | Path, block_bytes: int, budget: int, *, slab_bytes: int, piece_bytes: int,
                 layout: dict) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, self.directory, "creating") from exc
        self.piece_bytes = piece_bytes
        self.report = OpenReport()
        self.files: list[SlabFile] = []
        self._lock_fd = _lock(self.directory)
        self._index_fd = -1
        try:
            self._open(Geometry.for_budget(block_bytes, budget, slab_bytes), layout)
        except OSError as exc:
            self.close()
            raise os_error(exc, self.directory, "opening the NVMe KV tier in") from exc
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------------
    def _prior(self, wanted: Geometry) -> Geometry | None:
        """The geometry the directory was cut with, if its slots can be kept; None to start afresh."""
        try:
            header = read_header(self.directory)
        except TierioError as exc:  # a damaged header: the tier is a cache, start it afresh
            self._note(f"{self.directory}: {exc}; starting the tier afresh")
            return None
        if header is None:
            return None
        old = header.geometry
        if old.block_bytes != wanted.block_bytes:
            raise ConfigError(
                f"{self.directory} holds KV blocks of {old.block_bytes} bytes, this cache's blocks are "
                f"{wanted.block_bytes} bytes (another model or layout): give each model its own NVMe directory")
        if (old.slot_bytes, old.slots_per_slab) != (wanted.slot_bytes, wanted.slots_per_slab):
            self._note(f"{self.directory}: slabs were cut into {old.slots_per_slab} slots, now {wanted.slots_per_slab}; "
                       "starting the tier afresh")
            return None
        return old

    def _open(self, want: Geometry, layout: dict) -> None:
        prior = self._prior(want)
        intact: list[int] = []  # per slab: slots whose bytes the file really holds from before
        for i in range(want.slabs):
            f, kept = self._open_slab(i, want, prior)
            if f is None:
                break
            self.files.append(f)
            intact.append(kept)
        self.geometry = Geometry(want.block_bytes, want.slot_bytes, want.slots_per_slab, len(self.files))
        self._remove_slabs_from(len(self.files))
        self.direct = bool(self.files) and all(f.direct for f in self.files)
        self._open_index(prior, intact)
        write_json_atomic(self.directory / HEADER_NAME, self.geometry.header(layout))

    def _open_slab(self, i: int, want: Geometry, prior: Geometry | None) -> tuple[SlabFile | None, int]:
        path = self.directory / slab_name(i)
        existed = path.exists()
        fd, direct = _open_rw(self.directory, slab_name(i), direct=True)
        size = os.fstat(fd).st_size
        kept = min(want.slots_per_slab, size // want.slot_bytes) if prior is not None and i < prior.slabs else 0
        try:
            os.posix_fallocate(fd, 0, want.slab_bytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                raise os_error(exc, path, "allocating") from exc
            os.ftruncate(fd, size)
            os.close(fd)
            if not existed:
                path.unlink(missing_ok=True)
            self.report.disk_full = True
            self._note(f"no space for slab {i} of {want.slabs} under {self.directory} "
                       f"({want.slab_bytes} bytes each): the NVMe tier holds {i * want.slab_bytes} bytes instead")
            return None, 0
        return SlabFile(path, fd, direct), kept

    def _remove_slabs_from(self, count: int) -> None:
        """Slab files beyond the budget (a bigger budget before, or a disk that filled): removed."""
        for name in os.listdir(self.directory):
            m = _SLAB_FILE.fullmatch(name)
            if m and int(m.group(1)) >= count:
                (self.directory / name).unlink(missing_ok=True)

    def _open_index(self, prior: Geometry | None, intact: list[int]) -> None:
        n = self.geometry.nslots
        self._index_fd, _ = _open_rw(self.directory, INDEX_NAME, direct=False)
        if prior is None:
            os.ftruncate(self._index_fd, 0)
        size = os.fstat(self._index_fd).st_size
        raw = bytearray(min(size, n * RECORD_BYTES))
        got = pread_full(self._index_fd, memoryview(raw), 0, self.directory / INDEX_NAME)
        per = self.geometry.slots_per_slab

        def usable(slot: int) -> bool:
            slab, at = divmod(slot, per)
            return slab < len(intact) and at < intact[slab]

        scan = parse_index(bytes(raw[:got]), str(self.directory / INDEX_NAME), n, usable)
        self.report.records, self.report.discarded, self.report.reasons = scan.records, scan.discarded, scan.reasons
        self.valid = bytearray(n)  # 1 where the index holds a non-empty record that must be zeroed before reuse
        for slot in range(got // RECORD_BYTES):
            if raw[slot * RECORD_BYTES:(slot + 1) * RECORD_BYTES] != FREE_RECORD:
                self.valid[slot] = 1
        os.ftruncate(self._index_fd, n * RECORD_BYTES)
        FreeSlots.__init__(self, n, (r.slot for r in scan.records))
        self._seq = itertools.count(max((r.seq for r in scan.records), default=0) + 1)

    def _note(self, text: str) -> None:
        self.report.notes.append(text)

    # -- slots (bookkeeping under the router's lock, in FreeSlots) -------------------------------
    @property
    def slot_bytes(self) -> int:
        return self.geometry.slot_bytes

    def next_seq(self) -> int:
        """A number larger than every record's so far (thread-safe: itertools.count steps under the GIL)."""
        return next(self._seq)

    # -- I/O (outside the lock; each call touches only its own slot) ------------------------------
    def where(self, slot: int) -> tuple[SlabFile, int]:
        slab, offset = self.geometry.locate(slot)
        return self.files[slab], offset

    def read(self, slot: int, dest: np.ndarray) -> None:
        """Read the block of ``slot`` into ``dest`` (any host buffer of the block's size)."""
        f, offset = self.where(slot)
        n = self.geometry.block_bytes
        if n > self.piece_bytes:  # large: windows in flight, the aligned interior straight into dest
            read_into(f.path, offset, dest, fd=f.fd, direct=f.direct, chunk_size=self.piece_bytes,
                      depth=max(1, min(4, -(-n // self.piece_bytes))))
            return
        if not f.direct or (address_of(dest) % ALIGN == 0 and n % ALIGN == 0):
            got = pread_full(f.fd, memoryview(dest), offset, f.path)
        else:  # one aligned read of the slot through a reused bounce buffer
            bounce = bounce_pool().acquire(self.slot_bytes)
            try:
                got = pread_full(f.fd, bounce.view[:self.slot_bytes], offset, f.path, need=n)
                np.copyto(dest, bounce.array[:n])
            finally:
                bounce_pool().release(bounce)
        if got < n:
            raise IntegrityError(f"{f.path} ends inside slot {slot}: the slab is truncated")

    def write(self, slot: int, src: memoryview, record: SlotRecord) -> None:
        """Write a whole aligned slot, then commit its record. A slot that held another block has
        that block's record zeroed first, so a crash in between leaves the slot free, never torn."""
        f, offset = self.where(slot)
        self.clear(slot)
        pwrite_all(f.fd, src, offset, f.path)
        pwrite_all(self._index_fd, memoryview(record.pack()), slot * RECORD_BYTES, self.directory / INDEX_NAME)
        self.valid[slot] = 1

    def clear(self, slot: int) -> None:
        """Zero the record of ``slot`` (a block that failed its checks is not found again after a restart)."""
        if self.valid[slot]:
            pwrite_all(self._index_fd, memoryview(FREE_RECORD), slot * RECORD_BYTES, self.directory / INDEX_NAME)
            self.valid[slot] = 0

    def close(self) -> None:
        for f in self.files:
            os.close(f.fd)
        self.files = []
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the flock goes with the descriptor
            self._lock_fd = -1


__all__ = ["OpenReport", "SlabFile", "SlabTier", "read_header"]
