"""Byte sizes and rates for people, in one place: parse "64MiB", print "1.5 GiB", "1.09 GB" and "37.3 GB/s".

Capacities of buffers and caches print in binary units (``human_bytes``); sizes and rates of
disks, networks and plans print in decimal units with three significant figures (``fmt_bytes``,
``fmt_rate``), as hardware is specified."""

from __future__ import annotations

import math
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


def fmt_num(x: float, digits: int = 3) -> str:
    """Three significant figures without scientific notation: 37.33 -> '37.3', 4484 -> '4,484'."""
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{decimals}f}"


def fmt_bytes(n: float) -> str:
    """1.12e12 -> '1.12 TB' (decimal, three significant figures)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{fmt_num(n / scale)} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_s: float) -> str:
    """3.73e10 -> '37.3 GB/s': bandwidth in decimal units, as disks and networks are specified."""
    return fmt_bytes(bytes_per_s) + "/s"
