"""The Store protocol: one interface for every tier (local NVMe, shared filesystem, S3).

Keys are '/'-separated relative names ("step_000000100/rank_00000.safetensors"). A write is
all-or-nothing: readers never see a partial object under its final key. A store never hands a
caller a key that ``check_key`` refuses, whatever names its medium holds. Calls on a remote store
end within the store's deadline, with a result or a typed error (StoreUnavailableError when the
endpoint stops answering).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tierio.errors import FormatError, NotFoundError
from tierio.io.paths import key_parts

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
        """Fill ``buf`` with the bytes at [offset, offset+len(buf)); returns len(buf). An object
        shorter than that range is an IntegrityError; a connection lost on the way is retried."""
        ...

    def get_file(self, key: str, path: str | Path) -> int:
        """Copy ``key`` to a local file atomically (temp name + rename); returns its size."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix``, sorted; no pagination limit. Names that are not safe keys
        (empty, '.' or '..' parts, a leading '/') are skipped with a warning, never returned."""
        ...

    def stat(self, key: str) -> ObjectInfo:
        ...

    def exists(self, key: str) -> bool:
        ...

    def delete(self, key: str) -> None:
        """Remove one key; a missing key is not an error."""
        ...

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Write a small object under ``key`` only if no object is there yet (O_EXCL on a
        filesystem, a conditional PUT on S3); True when this call created it. For leases/markers:
        make ``data`` unique to the caller, so a retried create can recognise its own object."""
        ...

    def capacity(self) -> tuple[int, int] | None:
        """(total, free) bytes where the store has a size (a filesystem); None for object stores."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` and the leftovers of interrupted writes there (temp
        files, empty directories); returns how many keys were removed."""
        ...

    def cleanup(self, prefix: str = "", older_than: float = 0.0) -> int:
        """Remove what interrupted writes left under ``prefix`` and no live writer owns (temp files;
        multipart uploads on S3), untouched for at least ``older_than`` seconds; returns the count.
        S3 cannot tell which uploads a live writer owns: there ``older_than`` is the only guard."""
        ...

    def close(self) -> None:
        ...


def check_key(key: str, where: str | None = None) -> str:
    """Reject keys that could escape the store's root (absolute, '..', empty parts).

    With ``where`` (the file the key was read from) a bad key is a FormatError, not a ConfigError."""
    key_parts(key, where)
    return key


def where(store: Store, key: str) -> str:
    """``store``'s URL and ``key`` as one name for messages (query options such as endpoint= left off)."""
    base = str(getattr(store, "url", "")).split("?", 1)[0].rstrip("/")
    return f"{base}/{key}"


def list_sizes(store: Store, prefix: str = "") -> dict[str, int]:
    """Every key under ``prefix`` with its size: one listing where the store can say sizes in it
    (LocalStore, S3Store), else a listing and one stat per key. A size the store could not say is -1."""
    fn = getattr(store, "list_sizes", None)
    if fn is not None:
        return fn(prefix)
    out: dict[str, int] = {}
    for key in store.list(prefix):
        try:
            out[key] = store.stat(key).size
        except NotFoundError:  # deleted since the listing
            continue
    return out


def read_small(store: Store, key: str, limit: int) -> bytes:
    """A whole small object (a lease, a marker) in one request where the store can (LocalStore,
    S3Store), so a replacement between a size look-up and the read cannot tear it; an object larger
    than ``limit`` is a FormatError."""
    fn = getattr(store, "read_small", None)
    if fn is not None:
        return fn(key, limit)
    size = store.stat(key).size
    if size > limit:
        raise FormatError(f"{store.url.split('?')[0].rstrip('/')}/{key} is larger than {limit} bytes; it is corrupt or hostile")
    return read_bytes(store, key, 0, size)


def read_bytes(store: Store, key: str, offset: int = 0, length: int | None = None) -> bytes:
    """Convenience: read a range (default: the whole object) as bytes."""
    if length is None:
        length = store.stat(key).size - offset
    buf = bytearray(length)
    if length:
        store.read_into(key, offset, memoryview(buf))
    return bytes(buf)
