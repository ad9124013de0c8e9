"""`tierio probe`: measure what a directory or an S3 endpoint really delivers.

For a directory: sequential write and read bandwidth with O_DIRECT (tierio's engine) and with
buffered I/O + fsync, the page cache dropped before each read, plus the filesystem type. For an
S3 URL: PUT and GET throughput of one object at a few concurrencies. The JSON form feeds
`tierio plan --measured`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tierio.diag.system import find_mount
from tierio.errors import ConfigError
from tierio.io.buffers import HostBuffer
from tierio.io.files import FileWriter, read_into
from tierio.io.pagecache import evict
from tierio.io.stats import Throughput
from tierio.units import MiB

BLOCK = 64 * MiB  # the probe reuses one source buffer of this size


@dataclass
class ProbeResult(Throughput):
    target: str
    mode: str  # "direct" | "buffered" | "s3"
    op: str  # "write" | "read" | "put" | "get"
    bytes: int
    seconds: float
    concurrency: int | None = None


@dataclass
class ProbeReport:
    target: str
    fs_type: str
    results: list[ProbeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"target": self.target, "fs_type": self.fs_type, "results": [r.to_dict() for r in self.results], "notes": self.notes}


def filesystem_type(path: str | Path) -> str:
    m = find_mount(str(path))
    return m.fs_type if m else "unknown"


def _write(path: Path, src: HostBuffer, size: int, direct: bool) -> tuple[float, bool]:
    t0 = time.perf_counter()
    w = FileWriter(path, direct=direct)
    try:
        left = size
        while left:
            n = min(left, BLOCK)
            w.write(src.view[:n])
            left -= n
        st = w.close()  # fsync included: buffered writes pay their writeback here
    except BaseException:
        w.abort()
        raise
    return time.perf_counter() - t0, st.direct


def _read(path: Path, dst: HostBuffer, size: int, direct: bool) -> tuple[float, bool]:
    evict(path)
    t0 = time.perf_counter()
    used_direct = direct
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        for off in range(0, size, BLOCK):
            read_into(path, off, dst.view[: min(BLOCK, size - off)], direct=direct, fd=fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, used_direct


def probe_directory(path: str | Path, size: int = 1 << 30, progress: Callable[[str], None] | None = None) -> ProbeReport:
    """Write and read ``size`` bytes in ``path`` four ways; the scratch file is removed afterwards."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"{d} is not a directory; probe a directory on the filesystem you want to measure")
    if size < MiB:
        raise ConfigError("probe size must be at least 1 MiB")
    report = ProbeReport(str(d.resolve()), filesystem_type(d))
    buf = HostBuffer(min(size, BLOCK))
    buf.array[:] = 0x5A  # not zeros: some filesystems and devices compress or skip zero blocks
    scratch = d / f".tierio-probe-{uuid.uuid4().hex[:8]}"
    try:
        for direct in (True, False):
            mode = "direct" if direct else "buffered"
            if progress:
                progress(f"{mode} write")
            secs, used = _write(scratch, buf, size, direct)
            if direct and not used:
                report.notes.append("O_DIRECT refused by this filesystem: the 'direct' rows are buffered I/O")
            report.results.append(ProbeResult(report.target, mode, "write", size, secs))
            if progress:
                progress(f"{mode} read")
            secs, _ = _read(scratch, buf, size, used)
            report.results.append(ProbeResult(report.target, mode, "read", size, secs))
    finally:
        scratch.unlink(missing_ok=True)
    return report


def probe_gds(path: str | Path, size: int = 256 * MiB) -> ProbeReport | None:
    """The same file read into GPU memory two ways, page cache dropped before each: GPUDirect Storage
    (kvikio) and O_DIRECT into host memory plus a device copy (the bounce path). None without kvikio + CUDA."""
    from tierio.io import gds

    if not gds.available():
        return None
    import torch

    d = Path(path)
    report = ProbeReport(str(d.resolve()), filesystem_type(d))
    buf = HostBuffer(size)
    buf.array[:] = 0x5A
    dev = torch.empty(buf.capacity, dtype=torch.uint8, device="cuda")
    scratch = d / f".tierio-gds-{uuid.uuid4().hex[:8]}"
    try:
        _, direct = _write(scratch, buf, size, True)
        evict(scratch)
        t0 = time.perf_counter()
        gds.read_to_device(scratch, dev[:size])
        torch.cuda.synchronize()
        report.results.append(ProbeResult(report.target, "gds", "read", size, time.perf_counter() - t0))
        t0 = time.perf_counter()
        _read(scratch, buf, size, direct)
        dev[:size].copy_(buf.tensor()[:size])
        torch.cuda.synchronize()
        report.results.append(ProbeResult(report.target, "bounce", "read", size, time.perf_counter() - t0))
        report.notes.append(f"kvikio compatibility mode: {gds.compat_mode()}")
    finally:
        scratch.unlink(missing_ok=True)
    return report


def probe_s3(url: str, size: int = 256 * MiB, concurrencies: tuple[int, ...] = (1, 4, 16),
             progress: Callable[[str], None] | None = None) -> ProbeReport:
    """PUT then GET one object of ``size`` bytes at each concurrency; the object is deleted after."""
    from tierio.storage import S3Store, open_store

    report = ProbeReport(url, "s3")
    src = HostBuffer(size)
    src.array[:] = 0x5A
    key = f".tierio-probe-{uuid.uuid4().hex[:8]}"
    for c in concurrencies:
        store = open_store(url, concurrency=c, part_size=max(8 * MiB, -(-size // (4 * c))))
        assert isinstance(store, S3Store)
        try:
            if progress:
                progress(f"PUT x{c}")
            t0 = time.perf_counter()
            store.put_buffers(key, [src.view[:size]])
            report.results.append(ProbeResult(url, "s3", "put", size, time.perf_counter() - t0, c))
            if progress:
                progress(f"GET x{c}")
            t0 = time.perf_counter()
            store.read_into(key, 0, src.view[:size])
            report.results.append(ProbeResult(url, "s3", "get", size, time.perf_counter() - t0, c))
        finally:
            try:
                store.delete(key)
            finally:
                store.close()
    return report
