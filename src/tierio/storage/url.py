"""open_store(url): one entry point for every tier.

    /mnt/nvme/ckpt                        LocalStore
    file:///mnt/lustre/ckpt               LocalStore
    s3://bucket/prefix                    S3Store, endpoint from AWS_ENDPOINT_URL (or AWS)
    s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1&timeout=30

``timeout`` is the S3 store's deadline in seconds (see ``S3Options``). A URL never holds
credentials (``user:password@``): URLs are logged, printed in errors and used as metric labels,
so credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from tierio.errors import ConfigError
from tierio.storage.base import Store
from tierio.storage.endpoint import CREDENTIALS_HINT, check_endpoint, redact
from tierio.storage.local import LocalStore


def open_store(url: str | Path, **options: Any) -> Store:
    """Open the store a URL or path names; ``options`` go to the store's constructor."""
    text = str(url)
    if "://" not in text:
        return LocalStore(text, **options)
    u = urlparse(text)
    if "@" in u.netloc:
        raise ConfigError(f"the store URL {redact(text)} holds credentials (user:password@); {CREDENTIALS_HINT}")
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            raise ConfigError(f"{text}: file URLs must be file:///absolute/path")
        return LocalStore(unquote(u.path), **options)
    if u.scheme == "s3":
        q = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        unknown = set(q) - {"endpoint", "region", "timeout"}
        if unknown:
            raise ConfigError(f"{text}: unknown S3 URL option(s) {sorted(unknown)}; use endpoint=, region= and timeout=")
        if not u.netloc:
            raise ConfigError(f"{text}: an S3 URL needs a bucket: s3://BUCKET/prefix")
        if "endpoint" in q:
            check_endpoint(q["endpoint"], f"the store URL {redact(text)}")
        if "timeout" in q:
            options = {"timeout": _seconds(q["timeout"], text), **options}
        from tierio.storage.s3 import S3Store  # boto3 is imported only for S3 URLs

        return S3Store(u.netloc, unquote(u.path).strip("/"), endpoint=q.get("endpoint"), region=q.get("region"), **options)
    raise ConfigError(f"unsupported store URL {text!r}: use a path, file:///path or s3://bucket/prefix")


def as_store(url_or_store: str | Path | Store, **options: Any) -> Store:
    """A ``Store`` given as itself, or opened from the URL or path that names it (``open_store``)."""
    return url_or_store if isinstance(url_or_store, Store) else open_store(url_or_store, **options)


def _seconds(value: str, url: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{url}: timeout={value!r} must be a positive number of seconds")
    return seconds
