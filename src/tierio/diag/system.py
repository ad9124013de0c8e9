"""Record what this node says about a path: mount, free space, device, read-ahead, stripe layout, files.

Everything here reads the machine; the rules in tierio.diag.rules only judge what it recorded.
A missing tool or file yields a reason string instead of a value, never an exception.
"""

from __future__ import annotations

import heapq
import os
import time
from dataclasses import dataclass, field

from tierio.diag.parse import Mount, mount_of, parse_mountinfo
from tierio.io.space import disk_space
from tierio.io.tools import ToolRun, run_tool

# run_tool and ToolRun live in io.tools: the checkpoint tiers and dataset builds run `lfs` too
__all__ = ["DISKSTATS", "MOUNTINFO", "BlockDevice", "FileScan", "ToolRun", "block_device", "find_mount",
           "read_text", "run_tool", "scan_files", "space"]

MOUNTINFO = "/proc/self/mountinfo"
DISKSTATS = "/proc/diskstats"


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def find_mount(path: str) -> Mount | None:
    text = read_text(MOUNTINFO)
    return mount_of(os.path.realpath(path), parse_mountinfo(text)) if text else None


def space(path: str) -> tuple[int, int] | None:
    """(total bytes, bytes available to unprivileged users), as df reports them."""
    return disk_space(path)


@dataclass(frozen=True)
class BlockDevice:
    name: str | None           # whole-disk name for /proc/diskstats and /sys/block (None for nfs, lustre, ...)
    read_ahead_kb: int | None


def block_device(path: str) -> BlockDevice:
    """The disk under ``path`` and its read_ahead_kb (partitions resolve to their disk)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return BlockDevice(None, None)
    major, minor = os.major(dev), os.minor(dev)
    sys_dev = f"/sys/dev/block/{major}:{minor}"
    name = None
    if os.path.exists(sys_dev):
        real = os.path.realpath(sys_dev)
        if os.path.exists(os.path.join(real, "partition")):
            real = os.path.dirname(real)
        name = os.path.basename(real)
        ra = read_text(f"/sys/block/{name}/queue/read_ahead_kb")
    else:  # network and virtual filesystems still have a backing-device read-ahead
        ra = read_text(f"/sys/class/bdi/{major}:{minor}/read_ahead_kb")
    try:
        kb = int(ra.strip()) if ra else None
    except ValueError:
        kb = None
    return BlockDevice(name, kb)


@dataclass
class FileScan:
    files: int = 0
    small: int = 0
    total_bytes: int = 0
    truncated: bool = False
    largest: list[tuple[int, str]] = field(default_factory=list)  # (size, path), biggest first


def scan_files(root: str, small_bytes: int = 1_000_000, max_files: int = 50_000, max_seconds: float = 5.0,
               keep_largest: int = 16) -> FileScan:
    """Count files and files under ``small_bytes`` below ``root``, stopping at a file or time budget."""
    scan = FileScan()
    heap: list[tuple[int, str]] = []
    deadline = time.monotonic() + max_seconds
    if os.path.isfile(root):
        size = os.path.getsize(root)
        return FileScan(1, int(size < small_bytes), size, False, [(size, root)])
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            size = e.stat(follow_symlinks=False).st_size
                            scan.files += 1
                            scan.total_bytes += size
                            scan.small += size < small_bytes
                            if len(heap) < keep_largest:
                                heapq.heappush(heap, (size, e.path))
                            elif size > heap[0][0]:
                                heapq.heapreplace(heap, (size, e.path))
                    except OSError:
                        continue
                    if scan.files >= max_files or time.monotonic() > deadline:
                        scan.truncated = True
                        stack = []
                        break
        except OSError:
            continue
    scan.largest = sorted(heap, reverse=True)
    return scan
