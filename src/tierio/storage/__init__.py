"""Stores: one interface for every tier (LocalStore for NVMe and shared filesystems, S3Store)."""

from tierio.storage.base import ObjectInfo, Store, delete_prefix, read_bytes
from tierio.storage.local import LocalStore
from tierio.storage.s3 import S3Store
from tierio.storage.url import open_store

__all__ = ["ObjectInfo", "Store", "LocalStore", "S3Store", "open_store", "read_bytes", "delete_prefix"]
