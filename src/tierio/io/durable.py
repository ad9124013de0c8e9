"""Durability: write under a temporary name, fsync, rename, fsync the directory.

A crash at any point leaves either the old file or the complete new one under the final name,
never a torn file. Temporary names start with '.' and contain '.tmp-' so listings skip them.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierio.io.files import FileWriter, copy_file, os_error
from tierio.io.stats import IOStats

TMP_MARK = ".tmp-"


def temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}{TMP_MARK}{uuid.uuid4().hex[:12]}")


def is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so a rename or create inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ensure_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, path.parent, "creating directory") from exc


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise os_error(exc, final, "renaming into place") from exc


def atomic_write(path: str | Path, buffers: Iterable, **writer_kw) -> IOStats:
    """Write the concatenation of ``buffers`` to ``path`` atomically and durably."""
    final = Path(path)
    _ensure_parent(final)
    tmp = temp_name(final)
    w = FileWriter(tmp, **writer_kw)
    try:
        for b in buffers:
            w.write(b)
        stats = w.close()
    except BaseException:
        w.abort()
        raise
    _publish(tmp, final)
    stats.target = str(final)
    return stats


def atomic_copy(src: str | Path, dst: str | Path, **copy_kw) -> IOStats:
    """Copy a file atomically and durably (same temp + fsync + rename protocol)."""
    final = Path(dst)
    _ensure_parent(final)
    tmp = temp_name(final)
    try:
        stats = copy_file(src, tmp, **copy_kw)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _publish(tmp, final)
    stats.target = str(final)
    return stats


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Small JSON documents (manifests, indexes): buffered write, fsync, rename, fsync dir."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    atomic_write(path, [data], direct=False)
