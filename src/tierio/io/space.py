"""Free space of a filesystem, counted the way `df` counts it."""

from __future__ import annotations

import os
from pathlib import Path


def disk_space(path: str | Path) -> tuple[int, int] | None:
    """(total, available) bytes of the filesystem holding ``path``; None if it cannot be read.

    Blocks reserved for root are left out of both, as `df` does: otherwise a filesystem with a
    large reserve looks fuller than it is (Use% = used / (used + available))."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    avail = st.f_bavail * st.f_frsize
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    return used + avail, avail
