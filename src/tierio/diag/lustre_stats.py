"""Lustre client statistics: `lctl get_param llite.*.stats osc.*.stats` as counters per device.

Each block starts with ``<param>=`` and holds rows ``name  N samples [unit] min max sum [sumsq]``;
a ``llite.*`` block is one mount's client, an ``osc.*`` block the client's view of one OST.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LCTL_ARGV = ["lctl", "get_param", "llite.*.stats", "osc.*.stats"]

_ROW = re.compile(r"^(\w+)\s+(\d+)\s+samples\s+\[(\w+)\]\s+(\d+)\s+(\d+)\s+(\d+)")
_OST = re.compile(r"-(OST[0-9a-fA-F]+)-osc")


@dataclass(frozen=True)
class Counter:
    samples: int
    total: int       # the sum column: bytes for read_bytes/write_bytes, usec for waits

    @property
    def mean(self) -> float:
        return self.total / self.samples if self.samples else 0.0


@dataclass
class ClientStats:
    """One ``llite`` or ``osc`` block: ``name`` is the mount (llite) or the OST (osc)."""

    kind: str                 # "llite" or "osc"
    name: str
    counters: dict[str, Counter] = field(default_factory=dict)

    def bytes_moved(self) -> int:
        return sum(self.counters[k].total for k in ("read_bytes", "write_bytes") if k in self.counters)


def parse_lctl_stats(text: str) -> list[ClientStats]:
    """Blocks of `lctl get_param llite.*.stats osc.*.stats` output (other parameters are skipped)."""
    out: list[ClientStats] = []
    current: ClientStats | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.endswith("=") and "." in line:
            param = line[:-1]
            kind = param.split(".", 1)[0]
            current = None
            if kind in ("llite", "osc"):
                inner = param.split(".", 1)[1].rsplit(".", 1)[0]
                ost = _OST.search(inner)
                current = ClientStats(kind, ost.group(1) if ost else inner)
                out.append(current)
            continue
        m = _ROW.match(line)
        if current is not None and m:
            current.counters[m.group(1)] = Counter(int(m.group(2)), int(m.group(6)))
    return out
