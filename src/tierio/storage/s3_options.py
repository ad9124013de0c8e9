"""How an S3Store moves bytes and how long it waits: S3Options, the endpoint, and boto3 sessions."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import boto3

from tierio.errors import ConfigError
from tierio.io.buffers import align_up
from tierio.storage.endpoint import check_endpoint
from tierio.units import MiB

EXPECT_WAIT = 1.0  # botocore waits this long for "100 Continue" before it sends an upload's body anyway


@dataclass(frozen=True)
class S3Options:
    """How an S3Store moves bytes and how long it waits for its endpoint.

    ``timeout`` is the deadline of every store call: the longest it waits without the endpoint
    completing a request. One attempt of a request takes at most ``connect_timeout`` to connect and
    ``read_timeout`` of silence; both are shortened to fit in ``timeout``, and a request is tried
    again (up to ``max_attempts``) only when a whole attempt still fits before the deadline.

    A body that keeps arriving, but slowly (a server dripping bytes under ``read_timeout``), is
    cut off too: one request for ``n`` bytes may take ``attempt_seconds + n / min_rate`` seconds
    (bytes per second), and never past the call's deadline. Its rest is then asked for again
    when another attempt still fits.
    """

    part_size: int = 8 * MiB
    concurrency: int = 16
    max_attempts: int = 5
    timeout: float = 60.0
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    min_rate: float = 1.0 * MiB

    def checked(self) -> S3Options:
        for name in ("part_size", "concurrency", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"S3 option {name}={value!r} must be a positive integer")
        for name in ("timeout", "connect_timeout", "read_timeout", "min_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                unit = "bytes per second" if name == "min_rate" else "seconds"
                raise ConfigError(f"S3 option {name}={value!r} must be a positive number of {unit}")
        connect = min(self.connect_timeout, self.timeout / 4)
        return replace(
            self,
            part_size=align_up(max(5 * MiB, self.part_size), MiB),  # S3 minimum; aligned for O_DIRECT
            connect_timeout=connect,
            read_timeout=min(self.read_timeout, self.timeout - connect - min(EXPECT_WAIT, self.timeout / 4)),
        )

    @property
    def attempt_seconds(self) -> float:
        """The longest one attempt of a request can wait on a silent endpoint."""
        return self.connect_timeout + EXPECT_WAIT + self.read_timeout

    def request_seconds(self, nbytes: int) -> float:
        """The longest one attempt of a request for a body of ``nbytes`` may take, start to end."""
        return self.attempt_seconds + nbytes / self.min_rate


def s3_options(options: S3Options | None, overrides: dict[str, Any]) -> S3Options:
    """``options`` (or the defaults) with keyword ``overrides`` applied, checked."""
    known = {f.name for f in fields(S3Options)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown S3 option(s) {unknown}; known: {sorted(known)}")
    return replace(options or S3Options(), **overrides).checked()


@dataclass(frozen=True)
class Upload:
    """One multipart upload in progress, as a listing reports it."""

    key: str  # the full object key, prefix included
    upload_id: str
    age: float  # seconds since it was started (server clock against ours)


_loader: Any = None  # botocore's data loader: the parsed service models, shared by every session


def _session() -> boto3.session.Session:
    """A new boto3 session (credentials resolved afresh) that shares this process's parsed service
    models: a client is then ~3x cheaper to create (~50 ms instead of ~150 ms), which every forked
    data worker and every new store pays once. The models are read-only data; a forked child
    inherits them."""
    global _loader
    import botocore.session

    core = botocore.session.get_session()
    if _loader is None:
        _loader = core.get_component("data_loader")
    else:
        core.register_component("data_loader", _loader)
    return boto3.session.Session(botocore_session=core)


def _endpoint(given: str | None) -> str | None:
    """The endpoint URL to use, checked: a malformed one is a ConfigError here, not a traceback later."""
    if given:
        return check_endpoint(given, "endpoint=")
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return check_endpoint(os.environ[var], f"${var}")
    return None
