"""Reading S3 response bodies piece by piece within a deadline, and the keys a listing may return."""

from __future__ import annotations

import time
from typing import Any

from tierio.errors import ConfigError
from tierio.storage.base import check_key
from tierio.storage.deadline import Deadline
from tierio.storage.s3_errors import SlowBody
from tierio.storage.s3_options import S3Options
from tierio.units import fmt_rate


def _safe_key(key: str) -> bool:
    try:
        check_key(key)
        return True
    except ConfigError:
        return False


class Pace:
    """The time one attempt of a request may still read its body: at most
    ``options.request_seconds(nbytes)`` from now, and never past the call's ``deadline``.

    Timeouts bound silence only: a server that sends a byte now and then under ``read_timeout``
    would keep a read alive for ever. ``check`` between the pieces of a body ends it instead."""

    def __init__(self, deadline: Deadline, options: S3Options, nbytes: int) -> None:
        self.deadline, self.nbytes, self.min_rate = deadline, nbytes, options.min_rate
        self.started = time.monotonic()
        self.until = self.started + options.request_seconds(nbytes)

    def check(self, got: int) -> None:
        """Raise when the call is cancelled (Cancelled), or when the body, ``got`` of ``nbytes``
        bytes read so far in this attempt, is out of time (SlowBody: its rest may be asked again)."""
        self.deadline.check()
        now = time.monotonic()
        if now < self.until and self.deadline.remaining() > 0:
            return
        took = now - self.started
        rate = fmt_rate(got / took) if took > 0 else "no bytes"
        why = (f"only {got} of {self.nbytes} bytes of the body arrived in {took:.1f} s ({rate}), slower than the "
               f"minimum of {fmt_rate(self.min_rate)} (S3Options.min_rate)") if now >= self.until else (
               f"the call's deadline ran out with {got} of {self.nbytes} bytes of the body read in {took:.1f} s ({rate})")
        raise SlowBody(why)


def read_some(stream: Any, view: memoryview) -> int:
    """Read into ``view`` what one read of the socket returns (at least a byte, 0 at the end).

    One read, not "until ``view`` is full" as ``readinto`` does: a body that drips then returns to
    its caller's deadline check byte by byte instead of holding it for the whole piece."""
    data = read_piece(stream, len(view))
    view[: len(data)] = data
    return len(data)


def read_piece(stream: Any, n: int) -> bytes:
    """At most ``n`` bytes, from one read of the socket (b"" at the end); see ``read_some``."""
    read1 = getattr(stream, "read1", None)
    return read1(n) if read1 is not None else stream.read(n)
