"""Per-operation I/O statistics: what moved, how fast, and whether O_DIRECT was used."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass


class Throughput:
    """For dataclass records of ``bytes`` moved in ``seconds``: the rate, and a dict that has it."""

    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)  # type: ignore[call-overload]
        d["bytes_per_s"] = self.bytes_per_s
        return d


@dataclass
class IOStats(Throughput):
    op: str  # "write" | "read" | "put" | "get"
    target: str
    bytes: int = 0
    seconds: float = 0.0
    direct: bool = False
    requests: int = 0


_recent: deque[IOStats] = deque(maxlen=1024)
_lock = threading.Lock()


def record(stats: IOStats) -> IOStats:
    with _lock:
        _recent.append(stats)
    return stats


def recent(op: str | None = None) -> list[IOStats]:
    """The last operations recorded in this process (newest last)."""
    with _lock:
        return [s for s in _recent if op is None or s.op == op]
