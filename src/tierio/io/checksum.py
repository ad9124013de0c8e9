"""xxh3 checksums and content keys, computed per chunk while the bytes are in memory anyway.

The only module that imports ``xxhash``: every other one asks here, so the hash and its text
form are chosen once.

xxh3 runs at tens of GB/s on one core, far above any disk, so checksumming each chunk
just before it is written or just after it is read costs a few percent at most.
"""

from __future__ import annotations

import xxhash

from tierio.errors import IntegrityError


def xxh3(data) -> str:
    """16-hex-digit xxh3-64 of a buffer."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def xxh3_ranges(view, ranges) -> list[str]:
    """xxh3 of each ``(begin, end)`` range of ``view``; in the persist process when ``view`` is
    staging memory it maps (``io.offload``: one request instead of a GIL handover per range)."""
    from tierio.io import offload

    got = offload.xxh3_ranges(view, ranges) if isinstance(view, memoryview) else None
    return got if got is not None else [xxh3(view[b:e]) for b, e in ranges]


def xxh3_int(data) -> int:
    """xxh3-64 of a buffer as an unsigned 64-bit int (for binary headers that store it packed)."""
    return xxhash.xxh3_64_intdigest(data)


def xxh3_128(data) -> bytes:
    """16-byte xxh3-128 digest of a buffer: a content key (KV block keys, cache names)."""
    return xxhash.xxh3_128_digest(data)


def xxh3_128_hex(data) -> str:
    """32-hex-digit xxh3-128 of a buffer."""
    return xxhash.xxh3_128_hexdigest(data)


class StreamingChecksum:
    """xxh3-64 over bytes fed in pieces (same result as xxh3 of the concatenation)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return self._h.intdigest()

    def hexdigest(self) -> str:
        return f"{self._h.intdigest():016x}"


def verify_checksum(data, expected: str, where: str) -> None:
    """Raise IntegrityError naming ``where`` when ``data`` does not hash to ``expected``."""
    got = xxh3(data)
    if got != expected:
        raise IntegrityError(f"checksum mismatch in {where}: expected xxh3 {expected}, got {got}; this copy is corrupt")


# The earlier name; ``verify`` now means only a checkpoint's verification (tierio.ckpt.verify).
verify = verify_checksum
