"""Helpers shared by the benchmarks: fio as the hardware limit, page-cache dropping, RSS sampling.

Benchmarks install nothing: a missing tool is a clear ToolMissing error naming the package.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tierio.errors import TierioError
from tierio.io.pagecache import evict

T = TypeVar("T")


class ToolMissing(TierioError):
    """A peer tool the benchmark compares against is not installed."""


def work_dir(directory: str | None, name: str) -> Path:
    """A new temporary directory for benchmark ``name`` under ``directory`` (created if needed;
    the system's temporary directory when None): the caller removes it."""
    base = Path(directory).expanduser() if directory else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"tierio-bench-{name}-", dir=base))


def logger(name: str) -> Callable[[str], None]:
    """Progress lines on stderr (stdout carries the JSON)."""
    return lambda m: print(f"bench {name}: {m}", file=sys.stderr, flush=True)


def require_tool(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ToolMissing(f"`{name}` is not installed; the benchmark compares against it. Install it with: {install}")
    return path


def run_fio(directory: str | Path, rw: str, size: int, *, bs: str = "8M", iodepth: int = 8, direct: bool = True,
            name: str = "tierio-fio", keep: bool = False, jobs: int = 1) -> dict[str, float]:
    """One fio job (libaio, one file of ``size`` bytes in ``directory``); returns bytes/s and seconds.
    With ``jobs`` > 1, that many jobs each write (or read) a file of ``size`` bytes at once and the
    figures are their aggregate.

    A read job lays out its file first (untimed; with ``keep``, files already laid out are reused,
    so repeated reads do not each follow a write) and drops it from the page cache before reading.
    """
    fio = require_tool("fio", "apt-get install fio")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fname = directory / f"{name}.0.0"
    if jobs > 1:
        common = [f"--name={name}", f"--directory={directory}", f"--numjobs={jobs}", f"--bs={bs}",
                  f"--iodepth={iodepth}", "--ioengine=libaio", f"--size={size}", "--output-format=json"]
        if rw in ("read", "randread"):  # lay the files out first (untimed), then drop them from the cache
            files = [directory / f"{name}.{j}.0" for j in range(jobs)]
            if not (keep and all(f.exists() and f.stat().st_size >= size for f in files)):
                subprocess.run([fio, *common, "--rw=write", "--direct=1"], check=True, capture_output=True)
            drop_caches(files)
        args = [fio, *common, "--group_reporting", f"--rw={rw}", f"--direct={1 if direct else 0}"]
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        part = json.loads(out[out.index("{"):])["jobs"][0]["write" if "write" in rw else "read"]
        seconds = part["runtime"] / 1000.0
        if not keep:
            for f in directory.glob(f"{name}.*"):
                f.unlink(missing_ok=True)
        return {"bytes_per_s": part["io_bytes"] / seconds if seconds else 0.0, "seconds": seconds, "bytes": part["io_bytes"]}
    args = [fio, f"--name={name}", f"--filename={fname}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={iodepth}",
            "--ioengine=libaio", f"--direct={1 if direct else 0}", f"--size={size}", "--output-format=json"]
    if rw in ("read", "randread"):
        if not fname.exists() or fname.stat().st_size < size:
            subprocess.run([fio, f"--name={name}-layout", f"--filename={fname}", "--rw=write", "--bs=8M",
                            "--ioengine=libaio", "--direct=1", "--iodepth=8", f"--size={size}", "--output-format=json"],
                           check=True, capture_output=True)
        drop_caches([fname])
    if not direct and rw == "write":
        args.append("--end_fsync=1")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    part = job["write" if "write" in rw else "read"]
    seconds = part["runtime"] / 1000.0
    if not keep:
        fname.unlink(missing_ok=True)
    return {"bytes_per_s": part["io_bytes"] / seconds if seconds else 0.0, "seconds": seconds, "bytes": part["io_bytes"]}


def drop_caches(paths: Iterable[str | Path] = ()) -> None:
    """Evict files (directories: every file below them) from the page cache, and the whole cache
    too when running as root."""
    os.sync()
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(f for f in p.rglob("*") if f.is_file())
        else:
            files.append(p)
    for f in files:
        try:
            evict(f)
        except OSError:
            pass  # vanished or unreadable: nothing of it to evict
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        pass  # not root, or a container: per-file eviction above still applies


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def alternate(runs: dict[str, Callable[[], float]], rounds: int,
              before: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Each of ``runs`` ``rounds`` times, interleaved, the order rotated by one every round; the
    samples per name, in round order. ``before`` runs before every sample (dropping the page cache).

    Why: the virtual disks these benchmarks run on change speed by 2x within minutes, so two sides
    measured once each, a minute apart, meet different disks. Interleaved rounds give every side
    the same mix of the disk's states, and no side always runs right after the same other one."""
    names = list(runs)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(max(1, rounds)):
        for n in names[r % len(names):] + names[: r % len(names)]:
            if before is not None:
                before()
            out[n].append(runs[n]())
    return out


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Samples this process's resident set every few ms; ``peak`` is the maximum seen."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3) if denominator else float("nan")


def check_targets(ratios: dict[str, float], targets: dict[str, tuple[str, float]]) -> dict[str, bool]:
    """{name: met?} for each target (">=" or "<=" threshold) that has a measured ratio."""
    met = {}
    for name, (op, threshold) in targets.items():
        if name in ratios and ratios[name] == ratios[name]:  # skip NaN
            met[name] = ratios[name] >= threshold if op == ">=" else ratios[name] <= threshold
    return met


def machine_facts() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "kernel": os.uname().release}


def timed_torch_save(obj: Any, directory: str | Path) -> float:
    """Seconds for the synchronous baseline everyone starts from: torch.save + fsync (the file is removed)."""
    import uuid

    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".sync-save-{uuid.uuid4().hex[:8]}.pt"
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def environ(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in the environment for the block (a local S3 server's credentials), then the
    variables as they were."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
