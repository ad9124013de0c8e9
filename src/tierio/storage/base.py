"""The Store protocol: one interface for every tier (local NVMe, shared filesystem, S3).

Keys are '/'-separated relative names ("step_000000100/rank_00000.safetensors"). A write is
all-or-nothing: readers never see a partial object under its final key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tierio.errors import ConfigError

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


@runtime_checkable
class Store(Protocol):
    """What every tier can do. Implementations: LocalStore, S3Store."""

    url: str

    def put_buffers(self, key: str, buffers: Sequence[Buffer]) -> int:
        """Write the concatenation of ``buffers`` under ``key`` atomically; returns bytes written."""
        ...

    def put_file(self, key: str, path: str | Path) -> int:
        """Copy a local file to ``key`` atomically; returns bytes written."""
        ...

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` with the bytes at [offset, offset+len(buf)); returns len(buf)."""
        ...

    def get_file(self, key: str, path: str | Path) -> int:
        """Copy ``key`` to a local file atomically (temp name + rename); returns its size."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, sorted; no pagination limit."""
        ...

    def stat(self, key: str) -> ObjectInfo:
        ...

    def exists(self, key: str) -> bool:
        ...

    def delete(self, key: str) -> None:
        """Remove one key; a missing key is not an error."""
        ...

    def close(self) -> None:
        ...


def check_key(key: str) -> str:
    """Reject keys that could escape the store's root (absolute, '..', empty parts)."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ConfigError(f"invalid store key {key!r}: keys are relative '/'-separated names")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in ("", ".", ".."):
        raise ConfigError(f"invalid store key {key!r}: no empty, '.' or '..' parts allowed")
    return key


def read_bytes(store: Store, key: str, offset: int = 0, length: int | None = None) -> bytes:
    """Convenience: read a range (default: the whole object) as bytes."""
    if length is None:
        length = store.stat(key).size - offset
    buf = bytearray(length)
    if length:
        store.read_into(key, offset, memoryview(buf))
    return bytes(buf)


def delete_prefix(store: Store, prefix: str) -> int:
    """Delete every key under ``prefix``; returns how many were removed."""
    keys = store.list(prefix)
    for key in keys:
        store.delete(key)
    return len(keys)


def total_size(store: Store, keys: Iterable[str]) -> int:
    return sum(store.stat(k).size for k in keys)
