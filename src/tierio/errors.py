"""Typed errors. Every message says what went wrong, where, and what to do next."""

from __future__ import annotations

import errno
from pathlib import Path


class TierioError(Exception):
    """Base class of every error tierio raises on purpose."""


class StorageError(TierioError):
    """A store could not complete an operation."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file, key or checkpoint does not exist."""


class PermissionDeniedError(StorageError, PermissionError):
    """The path or bucket exists but may not be written or read."""


class DiskFullError(StorageError):
    """The target filesystem ran out of space (ENOSPC / EDQUOT)."""


class StoreUnavailableError(StorageError):
    """The store's endpoint did not answer (dead server, wrong port, network)."""


class AuthError(StorageError):
    """The store refused the credentials."""


class BucketNotFoundError(StorageError):
    """The S3 bucket named in the URL does not exist."""


class IntegrityError(TierioError):
    """Bytes read back do not match their recorded size or checksum."""


class FormatError(TierioError):
    """A file or manifest is malformed, truncated, or hostile."""


class DanglingReferenceError(IntegrityError):
    """An incremental checkpoint refers to a chunk of an earlier step whose file is missing on a tier.
    ``step``, ``tensor`` and ``file`` name the reference (``file`` is the referenced file's key)."""

    def __init__(self, message: str, step: int, tensor: str, file: str) -> None:
        super().__init__(message)
        self.step, self.tensor, self.file = step, tensor, file

    def __reduce__(self) -> tuple:  # crosses process boundaries (the persist process) whole
        return type(self), (str(self), self.step, self.tensor, self.file)


class ConfigError(TierioError, ValueError):
    """An argument or setting is invalid."""


class SettingError(TierioError):
    """An error fixed by changing one setting. The message names it where the template says
    ``{setting}``, as the library calls it (``max_bytes``); a front end with its own name for it (the
    CLI's ``--max-size``) words the same message with ``naming(name)``."""

    def __init__(self, message: str, setting: str = "") -> None:
        self.template, self.setting = message, setting
        super().__init__(self.naming(setting) if setting else message)

    def naming(self, name: str) -> str:
        return self.template.replace("{setting}", name)

    def __reduce__(self) -> tuple:  # crosses process boundaries (DataLoader workers) whole
        return type(self), (self.template, self.setting)


class CacheLimitError(SettingError, ConfigError):
    """A node-local cache is too small for what it must hold at once; ``setting`` is its size limit."""


class UnstorableError(ConfigError):
    """A value in a state cannot be stored without pickle; ``key`` is its path in the state ("a/b/0")."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.key)


class SnapshotChangedError(TierioError):
    """A tensor handed to an overlapped save changed in place after ``save`` and before the next
    update (its copy may mix two states); ``names`` are the tensors that changed. That save is not
    committed: the previous checkpoint stays."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.names)


class GroupError(TierioError):
    """A rank of a process group died or stopped answering during a collective operation."""


class LeaseError(StorageError):
    """Another run holds the tier's write lease (or this run lost it): one writer per tier."""


def os_error(exc: OSError, path: str | Path, doing: str) -> StorageError:
    """Turn an OSError into a typed tierio error that names the path and says what to do."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left while {doing} {path}: free space on that filesystem or point this tier elsewhere")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDeniedError(f"permission denied while {doing} {path} ({exc.strerror}): check ownership and mount options")
    if code in (errno.ENOENT, errno.ENOTDIR):
        return NotFoundError(f"{path} does not exist (while {doing}); check the path")
    return StorageError(f"I/O error while {doing} {path}: {exc.strerror or exc}")
