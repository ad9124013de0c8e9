"""Parsers for what a node reports about its storage: mountinfo, /proc/diskstats, `iostat -dx`.

Pure functions over text, so every rule can be checked against captured output from real clusters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tierio.errors import FormatError
from tierio.io.lustre import StripeLayout, parse_getstripe

# the Lustre parsers live in io.lustre: tiers and dataset builds read layouts too
__all__ = ["DeviceLoad", "DiskCounters", "Mount", "StripeLayout", "diskstats_delta", "is_whole_disk", "mount_of",
           "parse_diskstats", "parse_getstripe", "parse_iostat", "parse_mountinfo"]


# ---- /proc/self/mountinfo -------------------------------------------------------------------

@dataclass(frozen=True)
class Mount:
    mount_point: str
    fs_type: str
    source: str
    dev: str  # "major:minor"
    options: str = ""  # the mount's own options and the filesystem's (superblock) options, comma-joined


def _unescape(field_text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts from /proc/self/mountinfo: ``id parent maj:min root mountpoint opts [optional...] - fstype source superopts``."""
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if "-" not in parts or len(parts) < 7:
            continue
        sep = parts.index("-")
        fs_type = parts[sep + 1] if sep + 1 < len(parts) else ""
        source = parts[sep + 2] if sep + 2 < len(parts) else ""
        superopts = parts[sep + 3] if sep + 3 < len(parts) else ""
        mounts.append(Mount(_unescape(parts[4]), fs_type, _unescape(source), parts[2], f"{parts[5]},{superopts}"))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding ``path`` (an absolute, resolved path): the longest mount point that prefixes it."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if path == mp or path.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best


# ---- /proc/diskstats --------------------------------------------------------------------------

@dataclass(frozen=True)
class DiskCounters:
    """Cumulative counters of one block device (see Documentation/admin-guide/iostats.rst)."""

    name: str
    reads: int
    sectors_read: int
    read_ms: int
    writes: int
    sectors_written: int
    write_ms: int
    io_ms: int  # time the device had at least one request in flight


def parse_diskstats(text: str) -> dict[str, DiskCounters]:
    out = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) < 14:
            continue
        try:
            out[p[2]] = DiskCounters(p[2], int(p[3]), int(p[5]), int(p[6]), int(p[7]), int(p[9]), int(p[10]), int(p[12]))
        except ValueError:
            raise FormatError(f"/proc/diskstats line is not numeric: {line.strip()!r}") from None
    return out


@dataclass(frozen=True)
class DeviceLoad:
    """Load of one device over a sampling interval, as `iostat -dx` reports it."""

    name: str
    util_pct: float
    reads_per_s: float
    writes_per_s: float
    read_bps: float
    write_bps: float
    r_await_ms: float
    w_await_ms: float


def diskstats_delta(before: dict[str, DiskCounters], after: dict[str, DiskCounters], seconds: float) -> list[DeviceLoad]:
    """Per-device load between two /proc/diskstats samples taken ``seconds`` apart.

    %util = Δ io_ms / interval ms × 100; r_await = Δ read_ms / Δ reads (ms per completed read);
    bandwidth = Δ sectors × 512 B / seconds.
    """
    if seconds <= 0:
        raise FormatError("diskstats samples must be taken a positive time apart")
    loads = []
    for name, b in after.items():
        a = before.get(name)
        if a is None:
            continue
        dr, dw = b.reads - a.reads, b.writes - a.writes
        loads.append(DeviceLoad(
            name=name,
            util_pct=min(100.0, max(0, b.io_ms - a.io_ms) / (seconds * 1000) * 100),
            reads_per_s=dr / seconds, writes_per_s=dw / seconds,
            read_bps=(b.sectors_read - a.sectors_read) * 512 / seconds,
            write_bps=(b.sectors_written - a.sectors_written) * 512 / seconds,
            r_await_ms=(b.read_ms - a.read_ms) / dr if dr > 0 else 0.0,
            w_await_ms=(b.write_ms - a.write_ms) / dw if dw > 0 else 0.0,
        ))
    return loads


_PARTITION = re.compile(r"^(nvme\d+n\d+p\d+|mmcblk\d+p\d+|(sd|vd|xvd|hd)[a-z]+\d+)$")
_VIRTUAL = re.compile(r"^(loop|ram|zram|sr|fd)\d*")


def is_whole_disk(name: str) -> bool:
    """True for devices iostat users look at: not partitions, loop, ram or zram devices."""
    return not _PARTITION.match(name) and not _VIRTUAL.match(name)


# ---- iostat -dx -----------------------------------------------------------------------------

def parse_iostat(text: str) -> list[DeviceLoad]:
    """Device loads from `iostat -dx [interval count]` output (sysstat 10 to 12 column layouts).

    With several reports the first (averages since boot) is dropped and the rest averaged.
    """
    reports: list[dict[str, DeviceLoad]] = []
    header: list[str] | None = None
    current: dict[str, DeviceLoad] = {}
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            continue
        if cols[0].rstrip(":") == "Device":
            if header is not None:
                reports.append(current)
            header, current = [c.rstrip(":") for c in cols], {}
            continue
        if header is None or len(cols) != len(header):
            continue
        row = dict(zip(header, cols))
        try:
            num = {k: float(v.replace(",", ".")) for k, v in row.items() if k != "Device"}
        except ValueError:
            continue
        await_ = num.get("await", 0.0)
        current[row["Device"]] = DeviceLoad(
            name=row["Device"], util_pct=num.get("%util", 0.0),
            reads_per_s=num.get("r/s", 0.0), writes_per_s=num.get("w/s", 0.0),
            read_bps=num.get("rkB/s", num.get("rMB/s", 0.0) * 1024) * 1024,
            write_bps=num.get("wkB/s", num.get("wMB/s", 0.0) * 1024) * 1024,
            r_await_ms=num.get("r_await", await_), w_await_ms=num.get("w_await", await_),
        )
    if header is not None:
        reports.append(current)
    if not reports or not any(reports):
        raise FormatError("no device table found in iostat output: capture it with `iostat -dx 1 10`")
    if len(reports) > 1:
        reports = reports[1:]
    names = [n for n in reports[-1]]
    out = []
    for n in names:
        rows = [r[n] for r in reports if n in r]
        k = len(rows)
        out.append(DeviceLoad(n, *(sum(getattr(r, f) for r in rows) / k for f in
                                   ("util_pct", "reads_per_s", "writes_per_s", "read_bps", "write_bps",
                                    "r_await_ms", "w_await_ms"))))
    return out
