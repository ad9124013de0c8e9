"""Deterministic test bytes, shared by the I/O and storage tests."""

from __future__ import annotations

import numpy as np

MiB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` pseudo-random bytes, the same for the same seed (so a mismatch is never luck)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
