"""open_store(url): one entry point for every tier.

    /mnt/nvme/ckpt                        LocalStore
    file:///mnt/lustre/ckpt               LocalStore
    s3://bucket/prefix                    S3Store, endpoint from AWS_ENDPOINT_URL (or AWS)
    s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from tierio.errors import ConfigError
from tierio.storage.base import Store
from tierio.storage.local import LocalStore


def open_store(url: str | Path, **options: Any) -> Store:
    """Open the store a URL or path names; ``options`` go to the store's constructor."""
    text = str(url)
    if "://" not in text:
        return LocalStore(text, **options)
    u = urlparse(text)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost"):
            raise ConfigError(f"{text}: file URLs must be file:///absolute/path")
        return LocalStore(unquote(u.path), **options)
    if u.scheme == "s3":
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        unknown = set(q) - {"endpoint", "region"}
        if unknown:
            raise ConfigError(f"{text}: unknown S3 URL option(s) {sorted(unknown)}; use endpoint= and region=")
        from tierio.storage.s3 import S3Store  # boto3 is imported only for S3 URLs

        return S3Store(u.netloc, unquote(u.path).strip("/"), endpoint=q.get("endpoint"), region=q.get("region"), **options)
    raise ConfigError(f"unsupported store URL {text!r}: use a path, file:///path or s3://bucket/prefix")
