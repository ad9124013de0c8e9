"""Stores: one interface for every tier (LocalStore for NVMe and shared filesystems, S3Store).

``S3Store`` is imported on first use, so programs that only touch local tiers never import boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierio.storage.base import ObjectInfo, Store, read_bytes
from tierio.storage.local import LocalStore
from tierio.storage.url import open_store

if TYPE_CHECKING:
    from tierio.storage.s3 import S3Options, S3Store


def __getattr__(name: str) -> Any:
    if name in ("S3Store", "S3Options"):
        from tierio.storage import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LocalStore", "ObjectInfo", "S3Options", "S3Store", "Store", "open_store", "read_bytes"]
