"""What a weight load reports (a ``tierio.stats.Stats``; ``to_dict()`` is what ``--json`` prints)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tierio.stats import Stats
from tierio.weights.engine import Counters


@dataclass
class LoadStats(Stats):
    """What a load moved and what it cost. ``cpu_seconds`` counts every thread of the process."""

    source: str = ""
    device: str = "cpu"
    method: str = ""  # "mapped" | "host-arena" | "pinned-ring" | "gds" | "in-place" (+ "+cache-fill")
    files: int = 0
    tensors: int = 0
    bytes: int = 0  # bytes read from storage
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    direct_bytes: int = 0
    buffered_bytes: int = 0  # read through the page cache (it already held them, or no O_DIRECT)
    remote_bytes: int = 0
    copied_tensors: int = 0  # tensors whose offset was not a multiple of their element size
    first_use_seconds: float = 0.0  # one pass over every tensor after the load (weights.first_use), not in ``seconds``
    extra: dict[str, Any] = field(default_factory=dict)

    def add_read(self, counters: Counters, files: int) -> None:
        """Account one read pass: the files it touched, the bytes it planned, and how they came."""
        self.files += files
        self.bytes += counters.total
        self.direct_bytes += counters.direct_bytes
        self.buffered_bytes += counters.buffered_bytes
        self.remote_bytes += counters.remote_bytes

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_seconds / (self.bytes / 1e9) if self.bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        # asdict, not Stats.to_dict: the output predates the mixin and stays as it was.
        d = asdict(self)
        d["gb_per_s"] = round(self.gb_per_s, 3)
        d["cpu_s_per_gb"] = round(self.cpu_s_per_gb, 3)
        return d


@dataclass
class LoadIntoResult(Stats):
    """What :func:`tierio.weights.load_into` filled, and what did not match between target and source."""

    loaded: list[str]
    missing: list[str]  # in the target, not in the source
    unexpected: list[str]  # in the source, not in the target
    stats: LoadStats
