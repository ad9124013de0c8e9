"""Read the quantities a sizing question is asked in: counts, sizes, rates, durations, fractions.

Sizing talks in decimal units, as disks, networks and the source arithmetic do: "4M" tokens is
4,000,000, "70B" parameters is 70e9, "2GB/s" is 2e9 bytes per second. Binary units ("GiB") are
accepted for sizes and rates when written explicitly.
"""

from __future__ import annotations

import math
import re

from tierio.errors import ConfigError
from tierio.units import fmt_bytes, fmt_num, fmt_rate, parse_size

# Byte and rate formatting lives in tierio.units; plan code and its users import it from here too.
__all__ = [
    "parse_count", "parse_bytes", "parse_rate", "parse_duration", "parse_fraction", "parse_money",
    "fmt_bytes", "fmt_rate", "fmt_num", "fmt_seconds", "fmt_money", "fmt_pct",
]

_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TIME_SUFFIX = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0, "m": 60.0,
                "h": 3600.0, "d": 86400.0}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _positive(value: float, what: str, text: object, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        need = "zero or more" if allow_zero else "more than zero"
        raise ConfigError(f"{what} {text!r} must be {need}")
    return value


def _reject_negative(text: object, what: str) -> None:
    if isinstance(text, str) and text.strip().startswith("-"):
        raise ConfigError(f"{what} {text!r} is negative: give a value above zero")
    if isinstance(text, (int, float)) and text < 0:
        raise ConfigError(f"{what} {text!r} is negative: give a value above zero")


def parse_count(text: str | int | float, what: str = "count", allow_zero: bool = False) -> float:
    """Parse "70B", "4M", "1.5k", "1e9" or a number into a plain number (decimal suffixes)."""
    _reject_negative(text, what)
    if isinstance(text, (int, float)):
        return _positive(float(text), what, text, allow_zero)
    m = re.fullmatch(_NUMBER + r"([a-zA-Z]?)\s*", str(text))
    if not m or m.group(2).lower() not in _COUNT_SUFFIX:
        raise ConfigError(f"cannot read {what} {text!r}: use a number with an optional K, M, B or T suffix (e.g. 70B)")
    return _positive(float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()], what, text, allow_zero)


def parse_bytes(text: str | int | float, what: str = "size", allow_zero: bool = False) -> float:
    """Parse "75GB", "1.25GiB", "10TB" or a number of bytes."""
    _reject_negative(text, what)
    if isinstance(text, (int, float)):
        return _positive(float(text), what, text, allow_zero)
    try:
        value = float(parse_size(str(text)))
    except ConfigError:
        raise ConfigError(f"cannot read {what} {text!r}: use a size like 75GB, 1.5TB or 8GiB") from None
    return _positive(value, what, text, allow_zero)


def parse_rate(text: str | int | float, what: str = "bandwidth") -> float:
    """Parse "2GB/s", "112 GB/s", "500MB/s" or a number of bytes per second."""
    _reject_negative(text, what)
    if isinstance(text, (int, float)):
        return _positive(float(text), what, text)
    body = str(text).strip()
    for tail in ("/s", "ps", "/sec"):
        if body.lower().endswith(tail):
            body = body[: -len(tail)]
            break
    try:
        value = float(parse_size(body))
    except ConfigError:
        raise ConfigError(f"cannot read {what} {text!r}: use a rate like 2GB/s, 112GB/s or 800MB/s") from None
    return _positive(value, what, text)


def parse_duration(text: str | int | float, what: str = "duration", allow_zero: bool = False) -> float:
    """Parse "25s", "15ms", "200us", "2h" or a number of seconds."""
    _reject_negative(text, what)
    if isinstance(text, (int, float)):
        return _positive(float(text), what, text, allow_zero)
    m = re.fullmatch(_NUMBER + r"([a-zA-Zµ]*)\s*", str(text))
    if not m or m.group(2).lower() not in _TIME_SUFFIX:
        raise ConfigError(f"cannot read {what} {text!r}: use a duration like 25s, 15ms, 200us or 2h")
    return _positive(float(m.group(1)) * _TIME_SUFFIX[m.group(2).lower()], what, text, allow_zero)


def parse_fraction(text: str | int | float, what: str = "fraction") -> float:
    """Parse "5%", "0.05" into 0.05; the result must lie in [0, 1]."""
    _reject_negative(text, what)
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        body = str(text).strip()
        scale = 1.0
        if body.endswith("%"):
            body, scale = body[:-1], 0.01
        try:
            value = float(body) * scale
        except ValueError:
            raise ConfigError(f"cannot read {what} {text!r}: use a fraction like 0.05 or a percentage like 5%") from None
    if not 0 <= value <= 1:
        raise ConfigError(f"{what} {text!r} must lie between 0 and 1 (0% and 100%)")
    return value


def parse_money(text: str | int | float, what: str = "price") -> float:
    """Parse "$3", "3.0", "25K" (dollars)."""
    _reject_negative(text, what)
    if isinstance(text, str):
        text = text.strip().lstrip("$")
    return parse_count(text, what, allow_zero=True)


# ---- formatting, decimal units like the arithmetic they report --------------------------------

def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{fmt_num(s * 1e6)} µs"
    if s < 1:
        return f"{fmt_num(s * 1e3)} ms"
    if s < 120:
        return f"{fmt_num(s)} s"
    if s < 7200:
        return f"{fmt_num(s)} s ({s / 60:.1f} min)"
    return f"{fmt_num(s)} s ({s / 3600:.1f} h)"


def fmt_money(x: float) -> str:
    if abs(x) >= 1e6:
        return f"${x / 1e6:.2f}M"
    if abs(x) >= 1e4:
        return f"${x / 1e3:.1f}K"
    return f"${x:,.2f}"


def fmt_pct(fraction: float) -> str:
    """0.00448 -> '0.448%'; tiny fractions keep two significant figures instead of rounding to 0."""
    pct = fraction * 100
    if pct == 0:
        return "0%"
    return f"{fmt_num(pct, 2)}%" if abs(pct) < 0.01 else f"{fmt_num(pct)}%"
