"""The node-local half of a cooperative load: the ranks of one node share one memory file.

Which ranks share a node: one ``all_gather_object`` of :func:`tierio.dist.node_key` (``TIERIO_NODE``
when set, else host name, boot id and pid namespace). The node's lowest rank creates an anonymous
memory file (``memfd_create``) the size of the model's tensor stream; the node's other ranks open
it through ``/proc/<pid>/fd/<n>`` and check it is that file (inode and machine); every rank reserves
the pages of the parts it will write (``posix_fallocate``, the ranks in parallel: a node short of
memory says so here, not with a SIGBUS mid-load).
It has no name in any filesystem, so nothing is left behind when every rank is killed, and no later
load can pick up an old one. Every rank writes the parts it reads into a shared mapping; once all
parts are in, each maps the file privately (copy-on-write: a rank that writes into its tensors, or
re-reads a damaged part, changes only its own pages) and the file's memory is freed with the last
mapping.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierio.dist import machine
from tierio.io.mapping import MADV_POPULATE_WRITE, FileMapping
from tierio.io.pagecache import libc


@dataclass(frozen=True)
class Offer:
    """What a node's leader tells its node: where its memory file is open, and which file it is."""

    pid: int
    fd: int
    inode: int
    machine: str


class SharedStream:
    """A node's memory file of ``size`` bytes, mapped shared for writing parts into."""

    def __init__(self, fd: int, size: int, where: str) -> None:
        self.fd, self.size, self.where = fd, size, where
        self._mm: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._address = int(np.frombuffer(self._mm, np.uint8).ctypes.data)

    def reserve(self, ranges: list[tuple[int, int]]) -> str:
        """Allocate the pages of the byte ranges this rank will write ("" or why not): a node short
        of memory says so before the load, never by a SIGBUS in the middle of it."""
        try:
            for lo, hi in ranges:
                if hi > lo:
                    os.posix_fallocate(self.fd, lo, hi - lo)
        except OSError as exc:
            why = "not enough memory" if exc.errno in (errno.ENOSPC, errno.ENOMEM) else str(exc)
            return f"could not reserve node memory for its parts ({why})"
        return ""

    def writable(self, lo: int, hi: int) -> None:
        """Map the pages of [lo, hi) for writing in one call rather than one fault per page."""
        lib = libc()
        start = lo - lo % mmap.PAGESIZE
        if lib is not None and hi > lo:
            lib.madvise(self._address + start, hi - start, MADV_POPULATE_WRITE)  # old kernels: faults instead

    def private(self) -> FileMapping:
        """A copy-on-write mapping of the whole file, this rank's own."""
        return FileMapping(self.fd, 0, self.size, where=self.where)

    def close(self) -> None:
        self.bytes = None  # the tensor holds the mapping's buffer; drop it before closing
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still referenced somewhere: the collector unmaps it later
                pass
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _create(size: int, token: str) -> tuple[SharedStream | None, Offer | str]:
    name = f"tierio-group-{token}"
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:
        return None, f"memfd_create failed on rank pid {os.getpid()}: {exc}"
    try:
        os.ftruncate(fd, size)  # no pages yet: each rank reserves those it writes, in parallel
        shared = SharedStream(fd, size, f"memfd:{name}")
    except OSError as exc:
        os.close(fd)
        return None, f"could not map a node memory file of {size} bytes: {exc}"
    return shared, Offer(os.getpid(), fd, os.fstat(fd).st_ino, machine())


def _open(offer: Offer, size: int, token: str) -> SharedStream | str:
    if not offer.machine or offer.machine != machine():
        return "the node's leader runs on another machine or pid namespace (TIERIO_NODE names the same node twice?)"
    path = f"/proc/{offer.pid}/fd/{offer.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"could not open the leader's memory file {path}: {exc}"
    try:
        st = os.fstat(fd)
        if st.st_ino != offer.inode or st.st_size != size:
            raise OSError(f"{path} is not the leader's memory file (inode {st.st_ino}, {st.st_size} bytes)")
        return SharedStream(fd, size, f"memfd:tierio-group-{token}")
    except OSError as exc:
        os.close(fd)
        return str(exc)


def share(size: int, token: str, leader: int, rank: int, group: Any,
          writes: list[tuple[int, int]]) -> tuple[SharedStream | None, str]:
    """Collective over ``group``: this rank's handle on its node's memory file with the pages of
    ``writes`` (the byte ranges it fills) reserved, or (None, why) on every rank when any rank could
    not make, open or reserve its part of one (then no rank uses them)."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    shared: SharedStream | None = None
    said: Offer | str | None = None
    try:
        if rank == leader:
            shared, said = _create(size, token)
        offers: list[Any] = [None] * n
        dist.all_gather_object(offers, said, group=group)
        offer = offers[leader]
        why = offer if isinstance(offer, str) else ""
        if rank != leader and isinstance(offer, Offer):
            opened = _open(offer, size, token)
            shared, why = (opened, "") if isinstance(opened, SharedStream) else (None, opened)
        if shared is not None:
            why = shared.reserve(writes)
        whys: list[Any] = [None] * n
        dist.all_gather_object(whys, why and f"rank {rank}: {why}", group=group)
    except BaseException:  # a rank lost on the way: no file stays open here
        if shared is not None:
            shared.close()
        raise
    bad = [w for w in whys if w]
    if bad:
        if shared is not None:
            shared.close()
        return None, bad[0]
    return shared, ""


__all__ = ["SharedStream", "share"]
