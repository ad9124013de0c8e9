"""Optional GPUDirect Storage through kvikio: file <-> GPU memory without a host bounce.

Used only when kvikio imports and a CUDA device is present; every caller falls back to the
host path (O_DIRECT into a pinned HostBuffer, then a device copy) otherwise.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def available() -> bool:
    """True when kvikio is importable and a CUDA device exists."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import kvikio  # noqa: F401 - importable is what we test
    except Exception as exc:  # ImportError, or a CUDA runtime problem
        log.debug("GPUDirect Storage unavailable: %s", exc)
        return False
    return True


def compat_mode() -> bool | None:
    """True when kvikio reads by POSIX calls instead of GPUDirect (compatibility mode, set or
    chosen because cuFile cannot run here); None without kvikio."""
    if not available():
        return None
    import kvikio.defaults as defaults

    if hasattr(defaults, "is_compat_mode_preferred"):  # newer kvikio (compat mode AUTO): what will run
        return bool(defaults.is_compat_mode_preferred())
    mode = defaults.compat_mode  # older kvikio: a function, in the oldest a value
    return bool(mode() if callable(mode) else mode)


def read_to_device(path: str | Path, tensor, file_offset: int = 0) -> int:
    """Read ``tensor.nbytes`` bytes at ``file_offset`` straight into a CUDA tensor; returns bytes read."""
    import kvikio

    with kvikio.CuFile(str(path), "r") as f:
        return int(f.pread(tensor, tensor.nbytes, file_offset).get())


def write_from_device(path: str | Path, tensor, file_offset: int = 0) -> int:
    import kvikio

    with kvikio.CuFile(str(path), "r+") as f:
        return int(f.pwrite(tensor, tensor.nbytes, file_offset).get())
