"""Stores: one interface for every tier (LocalStore for NVMe and shared filesystems, S3Store).

``S3Store`` is imported on first use, so programs that only touch local tiers never import boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierio.storage.base import ObjectInfo, Store, read_bytes
from tierio.storage.local import LocalStore
from tierio.storage.url import open_store

if TYPE_CHECKING:
    from tierio.storage.s3 import S3Store


def __getattr__(name: str) -> Any:
    if name == "S3Store":
        from tierio.storage.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ObjectInfo", "Store", "LocalStore", "S3Store", "open_store", "read_bytes"]
