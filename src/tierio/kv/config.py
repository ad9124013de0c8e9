"""Options of a KV cache, grouped: budgets per tier, watermarks, admission, I/O shape, timeouts.
``KVConfig`` is the capability's ``tierio.options.Options``: sizes are ``*_bytes`` fields that take
an int or text such as ``"64MiB"``, and ``KVCache(..., **overrides)`` resolves keywords on top."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tierio.errors import ConfigError
from tierio.options import Options
from tierio.units import MiB

SECRET_ENV = "TIERIO_KV_SECRET"  # the deployment's shared-tier secret when the config names none


@dataclass(frozen=True)
class Watermarks:
    """When a tier's used share rises above ``high``, blocks are written down (or dropped) from its
    least recently used end until it is back to ``low``; the gap lets puts find free slots without
    waiting for a write."""

    high: float = 0.9
    low: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high <= 1:
            raise ConfigError(f"watermarks must satisfy 0 < low <= high <= 1, got low={self.low!r} high={self.high!r}")


@dataclass(frozen=True)
class KVConfig(Options):
    """Budgets are bytes (an int, or text such as ``"4GiB"``). A tier whose budget holds no whole block is left out.

    ``device_bytes``/``device``: an optional pool in accelerator memory above DRAM (0, the
    default: none; the engine's own KV memory stays the engine's). ``device`` names a torch device:
    None takes the current CUDA device, and where CUDA is absent the tier is left out with one
    warning; a named device that is not there (``"cuda:1"`` on a one-GPU machine, any CUDA device
    without CUDA) is a ``ConfigError``; ``"cpu"`` makes the pool a host tensor standing in for
    device memory (for tests: the same routing, eviction and bookkeeping).
    ``nvme_dir``/``nvme_bytes``: the local NVMe tier (preallocated slab files under that directory).
    ``shared_url``: optional tierio store URL (a shared-filesystem directory or ``s3://``) holding
    blocks for other nodes. ``admit_uses``: a block leaving DRAM is written to NVMe only once it has
    been used (stored or read) this many times, counting earlier lives in the cache; 1 writes every
    block down. ``depth``: reads and writes in flight. ``io_timeout_s``: the longest any call waits
    for another thread's transfer before counting a miss.
    ``shared_secret``: a per-deployment secret (None: ``$TIERIO_KV_SECRET`` when set); every block
    written to the shared store then carries a keyed MAC of its header and bytes, and a block read
    back without a valid one is a miss (counted in ``unauthenticated``), so whoever can write the
    bucket but lacks the secret cannot serve other nodes wrong KV."""

    dram_bytes: int | str = 1 << 30
    nvme_dir: str | Path | None = None
    nvme_bytes: int | str = 0
    shared_url: str | None = None
    slab_bytes: int | str = 1 << 30
    watermarks: Watermarks = field(default_factory=Watermarks)
    admit_uses: int = 2
    depth: int = 8
    piece_bytes: int | str = 8 * MiB
    io_timeout_s: float = 30.0
    persist_on_close: bool = True
    fetch_latency_s: float = 200e-6
    device_bytes: int | str = 0
    device: str | None = None
    shared_secret: str | bytes | None = field(default=None, repr=False)

    def secret(self) -> bytes | None:
        """The shared-tier MAC key: ``shared_secret``, else ``$TIERIO_KV_SECRET``, else None."""
        raw = self.shared_secret if self.shared_secret is not None else os.environ.get(SECRET_ENV) or None
        return raw.encode() if isinstance(raw, str) else raw

    def __post_init__(self) -> None:
        super().__post_init__()  # "64MiB" → int before the checks below
        for name in ("dram_bytes", "nvme_bytes", "device_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"KV cache: {name} must be a byte count >= 0, got {v!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise ConfigError(f"KV cache: device must name a torch device (\"cuda:0\", \"cpu\") or be None, "
                              f"got {self.device!r}")
        if self.nvme_bytes and self.nvme_dir is None:
            raise ConfigError("KV cache: nvme_bytes is set but nvme_dir is not; name the directory of the NVMe tier")
        if self.admit_uses < 1 or self.depth < 1 or self.piece_bytes < 4096 or self.slab_bytes < 4096:
            raise ConfigError("KV cache: admit_uses and depth must be >= 1, piece_bytes and slab_bytes >= 4096")
        if not self.io_timeout_s > 0 or not self.fetch_latency_s > 0:
            raise ConfigError("KV cache: io_timeout_s and fetch_latency_s must be more than zero")
        secret = self.secret()
        if secret is not None and not 16 <= len(secret) <= 64:
            raise ConfigError(f"KV cache: the shared-tier secret (shared_secret or ${SECRET_ENV}) must be 16 to 64 "
                              f"bytes, got {len(secret)}; generate one with `python -c 'import secrets; "
                              "print(secrets.token_hex(32))'`")


__all__ = ["SECRET_ENV", "KVConfig", "Watermarks"]
