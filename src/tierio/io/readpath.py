"""Which way to read a file system's files: O_DIRECT or buffered, chosen by measurement.

On NVMe, O_DIRECT at depth usually wins (no page-cache copy, no readahead limit); on some virtual
disks and network file systems buffered reads, with the kernel's readahead, run faster. No
constant knows which disk it runs on, so the first large reads of cold bytes on each file system
alternate between the two ways (the same windows of the same restore, under the same load) and
their throughputs are compared; from then on the faster way is used on that file system (per
process). Reads of bytes already in the page cache are not samples: readers check residency
first and read those buffered, at the speed of a memcpy.

A way that runs at ``CLEAR`` times the other's rate from the first sample of each is chosen at once.
Otherwise O_DIRECT must win clearly (by ``MARGIN``) to be chosen: buffered reads are what most readers use
(torch.load, dcp.load), so a restore that reads buffered is never slower than they are on the same
disk, while a close call between two noisy samples under load (a shared machine, other jobs
reading) flipped between runs and sometimes settled on the slower way.

Reads into destinations O_DIRECT cannot land in (the address and the file offset differ modulo
4 KiB: most tensors restored in place) are a separate choice (``bounced``): O_DIRECT reads those
into a bounce buffer and copies, which is a different trade against buffered reads (the same one
copy, without the kernel's readahead, without page-cache pages) and usually loses where buffered
beats in-place O_DIRECT; mixing both kinds of samples chose O_DIRECT for destinations it then
bounced every byte of.
"""

from __future__ import annotations

import os
import statistics
import threading
from dataclasses import dataclass, field

from tierio.units import MiB

SAMPLE_BYTES = 4 * MiB  # smaller reads say more about latency than about the way of reading
SAMPLES = 3  # cold reads of each way before choosing
RESIDENT = 0.5  # a read at least this much in the page cache is buffered (a memcpy), whatever the way
MARGIN = 1.2  # O_DIRECT is chosen only when its median beats buffered's by this factor
# A way that runs at CLEAR times the other's rate from the first sample of each is chosen then:
# the samples come only from cold reads, which a restore whose read-ahead runs ahead of it has few
# of, and while measuring every other one goes the slow way (0.09 against 3.5 GB/s per read, for
# three whole restores in one process, before this rule).
CLEAR = 2.0


@dataclass
class ReadPath:
    """The read way of one file system (``device``: its st_dev): measuring, then chosen.
    ``bounced``: the way for destinations O_DIRECT would have to bounce (see the module docstring)."""

    device: int
    bounced: bool = False
    rates: dict[str, list[float]] = field(default_factory=lambda: {"direct": [], "buffered": []})
    chosen: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next: int = 0

    def direct(self) -> bool:
        """Whether the next large read should use O_DIRECT (alternating while measuring)."""
        if self.chosen is not None:
            return self.chosen == "direct"
        with self._lock:
            self._next += 1
            return self._next % 2 == 1

    @property
    def measuring(self) -> bool:
        return self.chosen is None

    def record(self, direct: bool, nbytes: int, seconds: float) -> None:
        """One cold read of ``nbytes`` took ``seconds``: choose once both ways have SAMPLES."""
        if seconds <= 0 or self.chosen is not None:
            return
        with self._lock:
            self.rates["direct" if direct else "buffered"].append(nbytes / seconds)
            if not all(self.rates.values()):
                return
            d, b = (statistics.median(self.rates[k]) for k in ("direct", "buffered"))
            if all(len(v) >= SAMPLES for v in self.rates.values()):
                self.chosen = "direct" if d >= MARGIN * b else "buffered"
            elif d >= CLEAR * b or b >= CLEAR * d:
                self.chosen = "direct" if d > b else "buffered"

    def settle(self, way: str) -> None:
        """Choose ``way`` without measuring (the other one is not available here)."""
        with self._lock:
            self.chosen = self.chosen or way

    def to_dict(self) -> dict:
        with self._lock:
            med = {k: round(statistics.median(v) / 1e9, 3) if v else None for k, v in self.rates.items()}
            return {"chosen": self.chosen or "measuring", "direct_gb_per_s": med["direct"],
                    "buffered_gb_per_s": med["buffered"]}


_paths: dict[tuple[int, bool], ReadPath] = {}
_paths_lock = threading.Lock()


def read_path(device: int, *, bounced: bool = False) -> ReadPath:
    """The (process-wide) read way of the file system with st_dev ``device`` (for destinations
    O_DIRECT would bounce, with ``bounced``)."""
    with _paths_lock:
        rp = _paths.get((device, bounced))
        if rp is None:
            rp = _paths[(device, bounced)] = ReadPath(device, bounced)
        return rp


def read_path_of(path: str | os.PathLike, *, bounced: bool = False) -> ReadPath:
    return read_path(os.stat(path).st_dev, bounced=bounced)


def forget() -> None:
    """Measure again from the next read (tests; a process that moved to other disks)."""
    with _paths_lock:
        _paths.clear()
