"""The shared tier: blocks as objects in any tierio store (a shared filesystem or S3).

Other nodes reach a block through its key alone, so each block is one object named after its key
(``ab/abcdef….kvb``) holding a 64-byte header (magic, key, size, xxh3-64 of the bytes) and the
block. The header is checked against the key asked for and the bytes against the checksum on
every read: an object that is short, damaged, or names another block is a miss, never data.
Objects are written whole (the store's atomic put), so a reader never sees half of one.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from tierio.errors import IntegrityError
from tierio.io.checksum import xxh3
from tierio.kv.stats import Tier
from tierio.storage import Store, open_store

MAGIC = b"TKVB"
VERSION = 1
_HEAD = struct.Struct("<4sI16sQQ")
HEADER_BYTES = 64


def object_key(key: bytes) -> str:
    h = key.hex()
    return f"{h[:2]}/{h}.kvb"


def pack_header(key: bytes, nbytes: int, checksum: int) -> bytes:
    body = _HEAD.pack(MAGIC, VERSION, key, nbytes, checksum)
    return (body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))).ljust(HEADER_BYTES, b"\0")


def check_header(raw: bytes, key: bytes, nbytes: int, where: str) -> int:
    """The checksum recorded in a block object's header, after checking the header names ``key``
    and ``nbytes``; IntegrityError otherwise."""
    body = raw[:_HEAD.size]
    (total,) = struct.unpack_from("<Q", raw, _HEAD.size)
    if xxhash.xxh3_64_intdigest(body) != total:
        raise IntegrityError(f"{where}: damaged block header")
    magic, version, got_key, got_bytes, checksum = _HEAD.unpack(body)
    if magic != MAGIC or version != VERSION or got_key != key or got_bytes != nbytes:
        raise IntegrityError(f"{where}: the object does not hold block {key.hex()} of {nbytes} bytes")
    return checksum


def block_checksum(data: np.ndarray | memoryview) -> int:
    return int(xxh3(data), 16)


class SharedTier:
    kind = Tier.SHARED

    def __init__(self, url: str, block_bytes: int) -> None:
        self.url = url
        self.block_bytes = block_bytes
        self.store: Store = open_store(url)

    def exists(self, key: bytes) -> bool:
        return self.store.exists(object_key(key))

    def read(self, key: bytes, dest: np.ndarray) -> None:
        """Fill ``dest`` with the block named ``key``; IntegrityError when the object is not it."""
        name = object_key(key)
        where = f"{self.url}/{name}"
        head = bytearray(HEADER_BYTES)
        self.store.read_into(name, 0, memoryview(head))
        checksum = check_header(bytes(head), key, self.block_bytes, where)
        self.store.read_into(name, HEADER_BYTES, memoryview(dest))
        if block_checksum(dest) != checksum:
            raise IntegrityError(f"{where}: block bytes do not match their checksum")

    def write(self, key: bytes, data: np.ndarray, checksum: int) -> None:
        self.store.put_buffers(object_key(key), [pack_header(key, self.block_bytes, checksum), memoryview(data)])

    def close(self) -> None:
        self.store.close()


__all__ = ["HEADER_BYTES", "SharedTier", "block_checksum", "check_header", "object_key", "pack_header"]
