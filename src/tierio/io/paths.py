"""Names that come from data, turned into files without leaving their directory.

A key read from a manifest or an index ("step_000000100/rank_00000.safetensors") names a file
under a root that the user chose. Checking the text is not enough: a symlink planted at any
component would still lead outside. :func:`open_beneath` therefore walks the key one component
at a time from a descriptor of the root, with ``O_NOFOLLOW`` on each (the ``openat`` discipline),
so no symlink below the root is ever followed, and :func:`open_regular` refuses FIFOs, devices
and directories before a read could block on them. The root itself may be a symlink: the user
chose it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from tierio.errors import ConfigError, FormatError, NotFoundError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def key_parts(key: str, where: str | None = None) -> list[str]:
    """Split a relative '/'-separated key, refusing anything that could escape its root.

    ``where`` names the file the key came from: a bad key is then a FormatError (the data is
    corrupt or hostile) rather than a ConfigError (the caller passed a bad argument)."""
    parts = key.split("/") if isinstance(key, str) else []
    bad = (
        not parts
        or key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or any(p in ("", ".", "..") for p in parts)
    )
    if bad:
        if where is not None:
            raise FormatError(f"{where}: {key!r} is not a relative name inside its directory; the file naming it is corrupt or hostile")
        raise ConfigError(f"invalid store key {key!r}: keys are relative '/'-separated names with no empty, '.' or '..' parts")
    return parts


def _refused(exc: OSError, root: Path, key: str) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        if exc.errno == errno.ENOTDIR and not os.path.islink(root / key):
            return NotFoundError(f"{root}/{key} is a file where a directory was expected; move it away")
        return FormatError(f"{root}/{key} is or passes through a symbolic link; tierio does not follow links out of {root}")
    if exc.errno == errno.ENOENT:
        return NotFoundError(f"{root}/{key} does not exist")
    return exc


def open_dir_beneath(root: str | Path, parts: list[str], *, create: bool = False) -> int:
    """A descriptor of the directory ``root/parts...``, following no symlink below ``root``."""
    root = Path(root)
    dfd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for i, part in enumerate(parts):
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=dfd)
                    # The new name must be durable before anything inside it counts as written:
                    # fsyncing a file never makes the directory that holds it durable.
                    os.fsync(dfd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dfd)
            except OSError as exc:
                raise _refused(exc, root, "/".join(parts[: i + 1])) from None
            os.close(dfd)
            dfd = nfd
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def open_beneath(root: str | Path, key: str, flags: int = os.O_RDONLY, mode: int = 0o644, *,
                 where: str | None = None, create_dirs: bool = False) -> int:
    """``os.open(root/key, flags)`` that follows no symlink below ``root``; returns a descriptor.

    Reads (no ``O_WRONLY``/``O_RDWR``) must land on a regular file. ``create_dirs`` makes the
    missing parent directories (for writers)."""
    parts = key_parts(key, where)
    root = Path(root)
    dfd = open_dir_beneath(root, parts[:-1], create=create_dirs)
    try:
        try:
            fd = os.open(parts[-1], flags | _NOFOLLOW | _CLOEXEC | (_NONBLOCK if not flags & (os.O_WRONLY | os.O_RDWR) else 0),
                         mode, dir_fd=dfd)
        except OSError as exc:
            raise _refused(exc, root, key) from None
    finally:
        os.close(dfd)
    if not flags & (os.O_WRONLY | os.O_RDWR):
        try:
            require_regular(fd, f"{root}/{key}")
            _clear_nonblock(fd)
        except BaseException:
            os.close(fd)
            raise
    return fd


def require_regular(fd: int, where: str) -> os.stat_result:
    """fstat ``fd`` and refuse anything but a regular file (a FIFO would block a reader forever)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{where} is not a regular file (a FIFO, device, socket or directory); refusing to read it")
    return st


def _clear_nonblock(fd: int) -> None:
    if _NONBLOCK:
        os.set_blocking(fd, True)


def open_regular(path: str | Path, flags: int = os.O_RDONLY, *, follow: bool = True) -> int:
    """Open an existing file for reading without blocking on a FIFO; refuse non-regular files.

    ``follow=False`` also refuses a symlink as the last component."""
    try:
        fd = os.open(path, flags | _CLOEXEC | _NONBLOCK | (0 if follow else _NOFOLLOW))
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise FormatError(f"{path} is a symbolic link; tierio does not follow links here") from None
        raise
    try:
        require_regular(fd, str(path))
        _clear_nonblock(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


__all__ = ["key_parts", "open_beneath", "open_dir_beneath", "open_regular", "require_regular"]
