"""The shared tier: blocks as objects in any tierio store (a shared filesystem or S3).

Other nodes reach a block through its key alone, so each block is one object named after its key
(``ab/abcdef….kvb``) holding a 64-byte header (magic, key, size, xxh3-64 of the bytes) and the
block. The header is checked against the key asked for and the bytes against the checksum on
every read: an object that is short, damaged, or names another block is a miss, never data.
Objects are written whole (the store's atomic put), so a reader never sees half of one.

The checksum guards against damage, not against a writer: anyone who can write the bucket can
write a well-formed object for any key. With a per-deployment secret the header's last 16 bytes
carry a keyed BLAKE2b MAC of the header and the block's bytes; a reader holding the secret takes
only blocks whose MAC verifies (``UnauthenticatedBlockError`` otherwise: a miss).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np

from tierio.errors import IntegrityError
from tierio.io.checksum import xxh3, xxh3_int
from tierio.kv.stats import KVTier
from tierio.storage import Store, open_store

MAGIC = b"TKVB"
VERSION = 1
_HEAD = struct.Struct("<4sI16sQQ")
HEADER_BYTES = 64
MAC_BYTES = 16
_MAC_AT = HEADER_BYTES - MAC_BYTES  # after the header body and its 8-byte xxh3


class UnauthenticatedBlockError(IntegrityError):
    """A shared-tier block without a valid MAC under this deployment's secret."""


def object_key(key: bytes) -> str:
    h = key.hex()
    return f"{h[:2]}/{h}.kvb"


def pack_header(key: bytes, nbytes: int, checksum: int) -> bytes:
    body = _HEAD.pack(MAGIC, VERSION, key, nbytes, checksum)
    return (body + struct.pack("<Q", xxh3_int(body))).ljust(HEADER_BYTES, b"\0")


def block_mac(secret: bytes, header: bytes, data: np.ndarray | memoryview) -> bytes:
    """The keyed MAC of a block object: BLAKE2b keyed with ``secret`` over its header (MAC field
    excluded) and its bytes."""
    h = hashlib.blake2b(header[:_MAC_AT], key=secret, digest_size=MAC_BYTES)
    h.update(memoryview(data).cast("B"))
    return h.digest()


def check_header(raw: bytes, key: bytes, nbytes: int, where: str) -> int:
    """The checksum recorded in a block object's header, after checking the header names ``key``
    and ``nbytes``; IntegrityError otherwise."""
    body = raw[:_HEAD.size]
    (total,) = struct.unpack_from("<Q", raw, _HEAD.size)
    if xxh3_int(body) != total:
        raise IntegrityError(f"{where}: damaged block header")
    magic, version, got_key, got_bytes, checksum = _HEAD.unpack(body)
    if magic != MAGIC or version != VERSION or got_key != key or got_bytes != nbytes:
        raise IntegrityError(f"{where}: the object does not hold block {key.hex()} of {nbytes} bytes")
    return checksum


def block_checksum(data: np.ndarray | memoryview) -> int:
    return int(xxh3(data), 16)


class SharedTier:
    kind = KVTier.SHARED

    def __init__(self, url: str, block_bytes: int, secret: bytes | None = None) -> None:
        self.url = url
        self.block_bytes = block_bytes
        self.secret = secret
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
        if self.secret is not None and not hmac.compare_digest(head[_MAC_AT:], block_mac(self.secret, bytes(head), dest)):
            raise UnauthenticatedBlockError(f"{where}: the block has no valid MAC under this deployment's secret (written "
                                            "by a node without the secret, or forged); not served")

    def write(self, key: bytes, data: np.ndarray, checksum: int) -> None:
        head = pack_header(key, self.block_bytes, checksum)
        if self.secret is not None:
            head = head[:_MAC_AT] + block_mac(self.secret, head, data)
        self.store.put_buffers(object_key(key), [head, memoryview(data)])

    def close(self) -> None:
        self.store.close()


__all__ = ["HEADER_BYTES", "SharedTier", "UnauthenticatedBlockError", "block_checksum", "block_mac", "check_header",
           "object_key", "pack_header"]
