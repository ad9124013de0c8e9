"""Publishing files that only make sense together (a dataset's ``.bin`` and ``.idx``) as one unit.

One file is made durable by temp name + fsync + rename (io.durable). Two files need more: renaming
them one after the other leaves a window where the new ``.bin`` sits next to the old ``.idx``, and
a failure there (a full disk on the second file, a kill) destroys the old pair without giving the
new one. So a group is published in three steps:

1. every file is written completely under its temp name and fsynced (:class:`PendingFile`; it
   holds the writer's flock, so cleanup never takes it from a live writer). A failure here,
   the likely one (ENOSPC), leaves the old group untouched;
2. a small journal naming every (temp, final) pair is written atomically next to the group;
3. the temps are renamed over their finals, then the journal is removed.

A crash after step 2 is rolled forward by :func:`finish_publish`, which readers and writers of
the group call before they touch it: they see the old group or the new one, never a mix. Stale
temps of a killed writer are removed by :func:`remove_stale_temps` (only those no live process
holds the lock of).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from tierio.errors import ConfigError, FormatError, StorageError, os_error
from tierio.io.durable import TMP_MARK, atomic_write, fsync_dir, temp_name
from tierio.io.direct import pwrite_all
from tierio.io.locks import hold_write_lock, writer_gone
from tierio.io.paths import open_regular
from tierio.io.untrusted import Fields, loads

JOURNAL_FORMAT = "tierio-publish"
JOURNAL_VERSION = 1
JOURNAL_LIMIT = 64 << 10
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def journal_path(anchor: Path) -> Path:
    """The journal of the group named after ``anchor`` (one of its files): ``.corpus.idx.publishing``."""
    return anchor.with_name(f".{anchor.name}.publishing")


class PendingFile:
    """A file being written under a temp name next to ``final``, owned (flock) by this process
    until it is published or discarded."""

    def __init__(self, final: Path) -> None:
        self.final = Path(final)
        self.path = temp_name(self.final)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
        except OSError as exc:
            raise os_error(exc, self.path, "creating") from exc
        hold_write_lock(self.fd)
        self.size = 0
        self._published = False

    def write(self, data) -> None:
        """Append ``data`` (a bytes-like object)."""
        view = memoryview(data).cast("B")
        pwrite_all(self.fd, view, self.size, self.path)
        self.size += len(view)

    def sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise os_error(exc, self.path, "syncing") from exc

    def discard(self) -> None:
        """Remove the temp file (not once its publication has begun: the journal needs it)."""
        if self._published or self.fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def publish(files: list[PendingFile], anchor: Path) -> None:
    """Make every file durable, then put them all in place as one unit (see the module notes)."""
    for f in files:
        f.sync()
    if any(f.final.parent != anchor.parent for f in files):
        raise ConfigError("the files of a published group must share one directory")
    doc = {"format": JOURNAL_FORMAT, "version": JOURNAL_VERSION, "files": [[f.path.name, f.final.name] for f in files]}
    journal = journal_path(anchor)
    atomic_write(journal, [json.dumps(doc).encode()], direct=False)
    for f in files:
        f._published = True  # from here on the journal owns the temps: never discard them
    try:
        _roll_forward(anchor.parent, [(f.path.name, f.final.name) for f in files], journal)
    finally:
        for f in files:
            f.close()


def _roll_forward(directory: Path, pairs: list[tuple[str, str]], journal: Path) -> None:
    for temp, final in pairs:
        try:
            os.replace(directory / temp, directory / final)
        except FileNotFoundError:
            pass  # renamed already (by a concurrent reader finishing the same journal)
        except OSError as exc:
            raise os_error(exc, directory / final, "publishing") from exc
    try:
        fsync_dir(directory)
        journal.unlink(missing_ok=True)
        fsync_dir(directory)
    except OSError as exc:
        raise os_error(exc, journal, "removing the publication journal") from exc


def finish_publish(anchor: Path) -> bool:
    """Complete a publication of ``anchor``'s group that a crash interrupted; True if there was one.

    Readers call this before opening the group. A directory they cannot write leaves the journal
    for the next writer (the group then fails its own checks loudly if it is mixed)."""
    journal = journal_path(anchor)
    try:
        fd = open_regular(journal, follow=False)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.EACCES):
            return False
        raise os_error(exc, journal, "reading") from exc
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(JOURNAL_LIMIT + 1)
    pairs = _parse_journal(raw, str(journal))
    try:
        _roll_forward(anchor.parent, pairs, journal)
    except StorageError:
        return False
    return True


def _parse_journal(raw: bytes, where: str) -> list[tuple[str, str]]:
    doc = Fields(loads(raw, where, limit=JOURNAL_LIMIT), where)
    doc.const("format", JOURNAL_FORMAT)
    doc.const("version", JOURNAL_VERSION)
    pairs = []
    for i, item in enumerate(doc.list("files", 16)):
        w = f"{where}: files[{i}]"
        if not isinstance(item, list) or len(item) != 2:
            raise FormatError(f"{w}: expected [temp name, final name]; the journal is corrupt or hostile: remove it")
        temp, final = (_entry_name(x, w) for x in item)
        if not temp.startswith(f".{final}{TMP_MARK}"):
            raise FormatError(f"{w}: {temp!r} is not a temp file of {final!r}; the journal is corrupt or hostile: remove it")
        pairs.append((temp, final))
    return pairs


def _entry_name(name: object, where: str) -> str:
    """One name inside the group's directory (the user chose the dataset's name: any characters
    a file name may hold, but no separator and no '..')."""
    if not isinstance(name, str) or not 0 < len(name) <= 255 or "/" in name or "\x00" in name or name in (".", ".."):
        raise FormatError(f"{where}: {name!r:.80} is not a file name in this directory; the journal is corrupt or hostile: remove it")
    return name


def recover(anchor: Path, finals: list[Path]) -> int:
    """What a writer of a group does first: finish an interrupted publication, then remove the
    temps killed writers left (none while a journal that may name them remains); returns how many."""
    finish_publish(anchor)
    journal = journal_path(anchor)
    if journal.exists():
        return 0
    return sum(remove_stale_temps(f) for f in [*finals, journal])


def remove_stale_temps(final: Path) -> int:
    """Remove the temp files of ``final`` (``.NAME.tmp-*`` next to it) that no live writer owns;
    returns how many. Only that directory is scanned, not the tree under it."""
    prefix = f".{final.name}{TMP_MARK}"
    removed = 0
    try:
        entries = [e for e in os.scandir(final.parent) if e.name.startswith(prefix)]
    except FileNotFoundError:
        return 0
    for e in entries:
        if writer_gone(e.path):
            try:
                os.unlink(e.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed



__all__ = ["PendingFile", "finish_publish", "journal_path", "publish", "recover", "remove_stale_temps"]
