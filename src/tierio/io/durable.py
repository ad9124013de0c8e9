"""Durability: write under a temporary name, fsync, rename, fsync the directory.

A crash at any point leaves either the old file or the complete new one under the final name,
never a torn file. Temporary names start with '.' and contain '.tmp-' so listings skip them.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tierio.errors import os_error
from tierio.io.direct import FileWriter
from tierio.io.ranges import copy_file
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


def _open_parent(path: Path) -> int:
    """A descriptor of ``path``'s directory (made if missing), for callers that name a path they chose."""
    _ensure_parent(path)
    try:
        return os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise os_error(exc, path.parent, "opening directory") from exc


def remove_at(dir_fd: int, name: str) -> None:
    """Unlink ``name`` in the directory ``dir_fd`` if it is there (a link is removed, never followed)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _publish(dir_fd: int, tmp: Path, final: Path) -> None:
    """Rename the temp file over the final name and fsync the directory, all through ``dir_fd``."""
    try:
        os.replace(tmp.name, final.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except OSError as exc:
        remove_at(dir_fd, tmp.name)
        raise os_error(exc, final, "renaming into place") from exc


def _in_dir(path: str | Path, dir_fd: int | None, write: Callable[[int, Path, Path], IOStats]) -> IOStats:
    """Run ``write(dir_fd, tmp, final)`` in ``dir_fd`` (else in ``path``'s directory, opened once).

    Every step (the exclusive create of the temp file, its fsync, the rename, the directory's
    fsync, the removal of a failed temp) goes through that one descriptor: a directory swapped
    for a symlink after the caller checked it cannot redirect any of them."""
    final = Path(path)
    own = dir_fd is None
    dfd = _open_parent(final) if own else dir_fd
    assert dfd is not None
    try:
        stats = write(dfd, temp_name(final), final)
    finally:
        if own:
            os.close(dfd)
    stats.target = str(final)
    return stats


def atomic_write(path: str | Path, buffers: Iterable, *, dir_fd: int | None = None, **writer_kw) -> IOStats:
    """Write the concatenation of ``buffers`` to ``path`` atomically and durably.

    ``dir_fd``: a descriptor of ``path``'s directory, already reached safely (LocalStore); the
    file is then created, renamed and synced through it and ``path`` only names it in messages."""

    def write(dfd: int, tmp: Path, final: Path) -> IOStats:
        w = FileWriter(tmp, dir_fd=dfd, **writer_kw)
        try:
            for b in buffers:
                w.write(b)
            stats = w.close()
        except BaseException:
            w.abort()
            raise
        _publish(dfd, tmp, final)
        return stats

    return _in_dir(path, dir_fd, write)


def atomic_copy(src: str | Path, dst: str | Path, *, dir_fd: int | None = None, **copy_kw) -> IOStats:
    """Copy a file atomically and durably (same temp + fsync + rename protocol; ``dir_fd`` as for
    ``atomic_write``, naming ``dst``'s directory)."""

    def write(dfd: int, tmp: Path, final: Path) -> IOStats:
        try:
            stats = copy_file(src, tmp, dst_dir_fd=dfd, **copy_kw)
        except BaseException:
            remove_at(dfd, tmp.name)
            raise
        _publish(dfd, tmp, final)
        return stats

    return _in_dir(dst, dir_fd, write)


def write_new_synced(path: str | Path, data: bytes) -> None:
    """Create ``path`` (exclusively, its last component not a link), write ``data`` and fsync it:
    for files inside a scratch directory that is published whole later (a cache entry), so the
    rename that publishes them never makes a name visible before its bytes are on the disk."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise os_error(exc, path, "writing") from exc


def fsync_tree(path: str | Path) -> None:
    """fsync every directory of a tree (deepest first, no link followed), so the names made in it
    survive a crash once the tree itself is renamed into place."""
    for _, _, _, dfd in os.fwalk(path, topdown=False):  # each descriptor is valid only while yielded
        os.fsync(dfd)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Small JSON documents (manifests, indexes): buffered write, fsync, rename, fsync dir."""
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    atomic_write(path, [data], direct=False)
