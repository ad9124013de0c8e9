"""Byte sizes and rates for people: parse "64MiB", print "1.5 GiB" and "2.31 GB/s"."""

from __future__ import annotations

import re

from tierio.errors import ConfigError

MiB = 1 << 20

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse "8MiB", "4G", "1.5 GB" or a plain integer into bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read size {text!r}: use a number with an optional unit like 64MiB, 4GiB, 1GB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0:
        raise ConfigError(f"size {text!r} is negative")
    return int(value)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as storage people read capacities)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float) -> str:
    """Bandwidth in decimal GB/s or MB/s, as disks and networks are specified."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"
