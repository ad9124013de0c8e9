"""Reading bytes that tierio did not just write: the one set of checks every parser goes through.

A manifest, an index or a header read from disk or S3 may be truncated, bit-flipped, or written by
someone hostile. Three rules make that a typed error instead of a crash, a hang or a write outside
a directory:

* **bounded JSON** — :func:`loads` refuses documents above a size limit, documents that would
  expand in memory to more than ``MAX_EXPANSION`` times their size, nesting deeper than
  ``MAX_DEPTH``, NaN/Infinity, numbers that overflow to infinity, and integers over
  ``MAX_INT_DIGITS`` digits, before anything looks at a field;
* **typed fields** — :class:`Fields` hands out a document's values only after checking type and
  range (integers are never bools or floats, digests are hex of the right length, file names are
  plain names), so a count is checked before anything is allocated from it;
* **one net** — :func:`parsing` turns whatever else a parser raises on odd input (``KeyError``,
  ``TypeError``, ``struct.error`` …) into a :class:`~tierio.errors.FormatError` naming the file, so
  a caller that falls back to another copy on ``TierioError`` always can.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import numpy as np

from tierio.errors import FormatError, NotFoundError, TierioError
from tierio.io.paths import open_regular

MAX_DEPTH = 64  # no document tierio writes nests deeper than a state tree, and those stay shallow
MAX_INT_DIGITS = 24  # 2**64 has 20 digits: anything longer is never a size, an offset or a count
MAX_COUNT = 1 << 62  # the largest integer any field may hold (offsets, sizes, counts)
# Python objects cost far more than their JSON text: a real manifest or header takes 3-10x its
# size once parsed, while a flood of empty containers ("[{},{},...]") takes ~25x. Documents whose
# estimated cost is above this factor are refused before parsing (see `estimated_memory`).
MAX_EXPANSION = 16
EXPANSION_FLOOR = 1 << 20  # below this size a document is never refused for its expansion

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_HEX = re.compile(r"[0-9a-f]+")
_MISSING = object()

# What parsers raise on odd input when nothing checked first; `parsing` maps them to FormatError.
# (Public for hot paths that map them with a plain try/except instead of the context manager.)
PARSE_ERRORS = _PARSE_ERRORS = (
    ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError,
    UnicodeError, SyntaxError, struct.error, EOFError, AssertionError,
)

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def parsing(where: str, what: str = "is malformed") -> Iterator[None]:
    """Run a parser of ``where``: every untyped exception becomes ``FormatError`` naming it.

    TierioErrors pass through unchanged (they already say what and where)."""
    try:
        yield
    except TierioError:
        raise
    except _PARSE_ERRORS as exc:
        raise FormatError(f"{where} {what} ({type(exc).__name__}: {_short(exc)}); this copy is corrupt or hostile") from None


def parser(fn: F) -> F:
    """Decorator form of :func:`parsing` for a function with a ``where`` parameter (the file's name)."""
    sig = inspect.signature(fn)

    @wraps(fn)
    def run(*args: Any, **kw: Any) -> Any:
        where = sig.bind_partial(*args, **kw).arguments.get("where", fn.__name__)
        with parsing(str(where)):
            return fn(*args, **kw)

    return run  # type: ignore[return-value]


def _short(exc: BaseException, limit: int = 160) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "…"


# -- bounded JSON ------------------------------------------------------------------------------
def _int(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} does not fit a float")
    return v


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number tierio accepts")


_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')  # what nesting_depth deletes
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def nesting_depth(raw: bytes) -> int:
    """How deep the containers of a *valid* JSON text nest (``{"a": []}`` is 2), from its bytes.

    Byte operations and one numpy pass over the quotes and brackets: no walk over the parsed
    objects (which costs more than parsing a large manifest)."""
    # Drop escape pairs so that every remaining quote delimits a string; keep quotes and brackets.
    marks = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _STRUCTURE)
    a = np.frombuffer(marks, dtype=np.uint8)
    step = _BRACKET_STEP[a]
    step[np.logical_xor.accumulate(a == ord('"'))] = 0  # brackets inside strings do not nest
    depth = np.cumsum(step, dtype=np.int32)
    return int(depth.max()) if len(depth) else 0


def estimated_memory(raw: bytes) -> int:
    """An upper estimate of the bytes ``json.loads`` builds from ``raw``, from byte counts alone
    (C speed, nothing allocated): ~64 bytes per container, ~32 per list item or object member
    (a slot and a number, or a key), ~24 per quote (a string object's overhead), plus the text."""
    containers = raw.count(b"{") + raw.count(b"[")
    members = raw.count(b",") + raw.count(b":")
    return len(raw) + 64 * containers + 32 * members + 24 * raw.count(b'"')


def expansion_ok(data: bytes, max_expansion: float = MAX_EXPANSION) -> bool:
    """Whether :func:`loads` accepts ``data``'s estimated cost in memory (writers check with it too,
    so that nothing tierio writes is refused when read back)."""
    return len(data) <= EXPANSION_FLOOR or estimated_memory(data) <= max_expansion * len(data)


def loads(raw: bytes | bytearray | memoryview | str, where: str, *, limit: int, max_depth: int = MAX_DEPTH,
          max_expansion: float | None = MAX_EXPANSION) -> Any:
    """Decode a JSON document from untrusted bytes; FormatError (naming ``where``) on anything odd.

    ``max_expansion``: refuse a document above ``EXPANSION_FLOOR`` bytes whose estimated parsed
    size (:func:`estimated_memory`) is above this multiple of its size; None skips the check."""
    if len(raw) > limit:
        raise FormatError(f"{where} is {len(raw)} bytes, above the {limit}-byte limit for it; it is corrupt or hostile")
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if max_expansion is not None and not expansion_ok(data, max_expansion):
        cost = estimated_memory(data)
        raise FormatError(
            f"{where} would take about {cost >> 20} MiB of memory to parse, {cost / len(data):.0f}x its "
            f"{len(data)} bytes (at most {max_expansion:g}x is accepted): it is a flood of tiny values; it is corrupt or hostile"
        )
    try:
        doc = json.loads(data.decode("utf-8"), parse_int=_int, parse_float=_float, parse_constant=_constant)
    except UnicodeError as exc:
        raise FormatError(f"{where} is not JSON (not UTF-8 text: {_short(exc)}); it is corrupt, or not the file expected") from None
    except RecursionError:
        raise FormatError(f"{where} is not JSON tierio reads (nested too deeply to parse); it is corrupt or hostile") from None
    except ValueError as exc:
        raise FormatError(f"{where} is not JSON (not valid JSON: {_short(exc)}); it is corrupt, or not the file expected") from None
    if nesting_depth(data) > max_depth:
        raise FormatError(f"{where} nests deeper than {max_depth} levels; it is corrupt or hostile")
    return doc


SMALL_FILE_LIMIT = 64 << 20  # a recording, a probe result or a timer file: never near this


def read_json_file(path: str | os.PathLike[str], *, missing: str, what: str = "", limit: int = SMALL_FILE_LIMIT) -> Any:
    """Load a JSON file a person points tierio at (a recording, a probe result, a timer file).

    ``missing`` is the advice a NotFoundError gives ("write it with ..."); ``what`` is added to a
    FormatError's message. FIFOs and devices are refused rather than read."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise NotFoundError(f"{path} does not exist: {missing}") from None
    except OSError as exc:
        raise FormatError(f"cannot read {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit + 1)
    try:
        return loads(raw, str(path), limit=limit)
    except FormatError as exc:
        raise FormatError(f"{exc}{': ' + what if what else ''}") from None


# -- typed fields ------------------------------------------------------------------------------
def check_int(v: Any, where: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """An integer in [lo, hi]: never a bool, a float (``1e10``) or a numeric string."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FormatError(f"{where}: expected an integer in {lo}..{hi}, got {_repr(v)}")
    return v


def check_float(v: Any, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    """A finite number in [lo, hi] (integers accepted)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
        raise FormatError(f"{where}: expected a finite number in {lo}..{hi}, got {_repr(v)}")
    return float(v)


def check_str(v: Any, where: str, max_len: int = 4096) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise FormatError(f"{where}: expected a string of at most {max_len} characters, got {_repr(v)}")
    return v


def check_hex(v: Any, where: str, digits: int) -> str:
    """A lowercase hex digest of exactly ``digits`` digits (so it is also a safe file-name part)."""
    if not isinstance(v, str) or len(v) != digits or not _HEX.fullmatch(v):
        raise FormatError(f"{where}: expected {digits} lowercase hex digits, got {_repr(v)}")
    return v


def check_plain_name(v: Any, where: str) -> str:
    """A file name confined to its directory: letters, digits, '_', '-', '.'; no separators, no '..'."""
    if not isinstance(v, str) or not _PLAIN_NAME.fullmatch(v) or ".." in v:
        raise FormatError(f"{where}: {_repr(v)} is not a plain file name; the file naming it is corrupt or hostile")
    return v


def check_ints(v: Any, where: str, max_len: int, lo: int = 0, hi: int = MAX_COUNT) -> tuple[int, ...]:
    """A list of at most ``max_len`` integers in [lo, hi] (a shape, a byte range, offsets)."""
    if not isinstance(v, list) or len(v) > max_len:
        raise FormatError(f"{where}: expected a list of at most {max_len} integers, got {_repr(v)}")
    if not all(type(x) is int and lo <= x <= hi for x in v):  # type() is int: never a bool
        i = next(i for i, x in enumerate(v) if not (type(x) is int and lo <= x <= hi))
        raise FormatError(f"{where}[{i}]: expected an integer in {lo}..{hi}, got {_repr(v[i])}")
    return tuple(v)


def check_list(v: Any, where: str, max_len: int) -> list:
    if not isinstance(v, list) or len(v) > max_len:
        raise FormatError(f"{where}: expected a list of at most {max_len} items, got {_repr(v)}")
    return v


def check_dict(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise FormatError(f"{where}: expected a JSON object, got {_repr(v)}")
    return v


def brief(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters: a value from a hostile file, quoted in a message."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "…"


_repr = brief


class Fields:
    """Checked access to one JSON object: ``Fields(doc, "index.json").int("samples")``.

    Every getter raises FormatError naming the document and the field; ``default`` makes a field
    optional (returned as given when the field is absent)."""

    def __init__(self, doc: Any, where: str) -> None:
        self.doc = check_dict(doc, where)
        self.where = where

    def _get(self, key: str, default: Any) -> Any:
        if key in self.doc:
            return self.doc[key]
        if default is _MISSING:
            raise FormatError(f"{self.where}: field {key!r} is missing")
        return default

    def _w(self, key: str) -> str:
        return f"{self.where}: field {key!r}"

    def _checked(self, key: str, default: Any, check: Callable[..., Any], *args: Any) -> Any:
        v = self._get(key, default)
        if v is default and default is not _MISSING:
            return v
        return check(v, self._w(key), *args)

    def int(self, key: str, lo: int = 0, hi: int = MAX_COUNT, default: Any = _MISSING) -> int:
        return self._checked(key, default, check_int, lo, hi)

    def float(self, key: str, lo: float = -math.inf, hi: float = math.inf, default: Any = _MISSING) -> float:
        return self._checked(key, default, check_float, lo, hi)

    def str(self, key: str, max_len: int = 4096, default: Any = _MISSING) -> str:
        return self._checked(key, default, check_str, max_len)

    def hex(self, key: str, digits: int, default: Any = _MISSING) -> str:
        return self._checked(key, default, check_hex, digits)

    def name(self, key: str, default: Any = _MISSING) -> str:
        return self._checked(key, default, check_plain_name)

    def list(self, key: str, max_len: int, default: Any = _MISSING) -> list:
        return self._checked(key, default, check_list, max_len)

    def ints(self, key: str, max_len: int, lo: int = 0, hi: int = MAX_COUNT, default: Any = _MISSING) -> tuple[int, ...]:
        v = self._get(key, default)
        return v if v is default and default is not _MISSING else check_ints(v, self._w(key), max_len, lo, hi)

    def obj(self, key: str, default: Any = _MISSING) -> Fields:
        return self._checked(key, default, Fields)

    def const(self, key: str, *allowed: Any) -> Any:
        v = self._get(key, _MISSING)
        if not any(v == a and type(v) is type(a) for a in allowed):
            raise FormatError(f"{self._w(key)}: expected one of {list(allowed)}, got {_repr(v)}")
        return v


__all__ = [
    "MAX_COUNT", "MAX_DEPTH", "MAX_EXPANSION", "PARSE_ERRORS", "Fields", "brief", "check_dict", "check_float",
    "check_hex", "check_int", "check_ints", "check_list", "check_plain_name", "check_str", "estimated_memory",
    "expansion_ok", "loads", "nesting_depth", "parser", "parsing", "read_json_file",
]
