"""The crash harness's recorder: the durable operations a trial process makes, logged or crashed at
(``Ctx.arm``), and the ``Ctx``/``Scenario`` records the scenarios are written against. Its own module
so that the scenarios (bench/crash_scenarios.py) and the trial runner (bench/crash.py) both use it
without importing each other."""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import signal
import stat
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
# Random parts of names (temp suffixes, run ids, cache entry hashes), masked in signatures; all-digit
# runs (step numbers) are kept.
_HEX = re.compile(r"(?<=tmp-)[0-9a-f]+|(?=[0-9]*[a-f])[0-9a-f]{8,}")
S3_OPS = {"PutObject", "CompleteMultipartUpload", "CopyObject", "DeleteObject", "DeleteObjects"}
CRASHED = -signal.SIGKILL
TRIAL_TIMEOUT = 180.0

# The real functions, captured before any wrapping: the harness does its own I/O through these.
_o = {name: getattr(os, name) for name in ("open", "write", "pwrite", "writev", "pwritev", "ftruncate", "truncate",
                                            "fsync", "fdatasync", "rename", "replace", "link", "unlink", "remove",
                                            "rmdir", "mkdir", "sendfile", "copy_file_range") if hasattr(os, name)}
_open = io.open


@dataclass(frozen=True)
class Point:
    """One crash point: die at occurrence ``nth`` of operation ``sig`` in process ``label``."""

    label: str
    sig: str
    nth: int
    variant: str  # "before" | "after-drop"

    def __str__(self) -> str:
        return f"{self.variant} {self.sig} #{self.nth} ({self.label})"


@dataclass
class Ctx:
    """What a scenario's run and check see (pickled into each child)."""

    root: Path  # every local tier of the trial lives below it
    control: Path  # outside root: operation logs, notes, errors
    s3_url: str | None = None  # this trial's own S3 prefix (s3://bucket/<trial>/data?endpoint=...)
    s3_prefix: str = ""  # the trial's part of the S3 keys, masked in signatures
    env: dict[str, str] = field(default_factory=dict)
    point: Point | None = None  # None: record
    group: int = 0  # the trial's process group (killed whole at a crash)

    def arm(self, label: str = "main", volatile: list[Path] | None = None) -> None:
        """From here on this process's durable operations are recorded (or crashed at).

        ``volatile``: the directories this process's power loss undoes unsynced changes in
        (default the whole trial). A rank's node-local tier is; a shared file system, whose server
        keeps what it acknowledged, is not. The recorder sees this interpreter's calls only, so the
        persist process's work (the same ``LocalStore`` code, ``io.offload``) stays in it."""
        from tierio.io import offload

        offload.stay_in_process()
        _Recorder(self, label, volatile).install()

    def note(self, key: str, value: Any) -> None:
        """Tell the check something the run knew at this moment (``step 3 durable``)."""
        fd = _o["open"](self.control / "notes.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _o["write"](fd, (json.dumps([key, value]) + "\n").encode())
        finally:
            os.close(fd)

    def notes(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        try:
            lines = (self.control / "notes.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            k, v = json.loads(line)
            out.setdefault(k, []).append(v)
        return out


@dataclass(frozen=True)
class Scenario:
    """``run(ctx)`` does its setup, calls ``ctx.arm()`` and then the operations under test;
    ``check(ctx)`` runs in a fresh process after the crash and returns what is wrong."""

    name: str
    run: Callable[[Ctx], None]
    check: Callable[[Ctx], list[str]]
    s3: bool = False
    about: str = ""


Entry = tuple[str, int] | None  # ("f" | "d", identity) or no entry


class _Recorder:
    """The wrappers of one armed process: records operations, keeps what is durable, crashes."""

    def __init__(self, ctx: Ctx, label: str, volatile: list[Path] | None = None) -> None:
        self.ctx, self.label = ctx, label
        self.roots = {str(ctx.root.absolute()), os.path.realpath(ctx.root)}
        self.volatile = [os.path.realpath(v) for v in (volatile or [ctx.root])]
        self.lock = threading.RLock()
        self.counts: Counter[str] = Counter()
        # Files and directories by identity, not inode number: a file unlinked here keeps its
        # durable content under its identity while a new file reuses the inode.
        self.ids: dict[tuple[int, int], int] = {}
        self.last_id = 0
        self.data: dict[int, bytes] = {}  # content as of the last fsync (or first change)
        self.dirty_data: set[int] = set()
        self.dirty_names: dict[int, dict[str, Entry]] = {}  # dir -> name -> entry as of its last fsync
        self.renames: dict[tuple[int, str], tuple[int, str]] = {}  # both halves of a rename
        self.log = (_o["open"](ctx.control / f"ops-{label}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    if ctx.point is None else -1)  # only the recording run keeps a log

    # -- where an operation lands -----------------------------------------------------------------
    def _inside(self, path: str) -> bool:
        return any(path == r or path.startswith(r + "/") for r in self.roots)

    def _resolve(self, path: Any, dir_fd: int | None) -> str | None:
        """The absolute path ``path`` names (relative to ``dir_fd`` when given), if inside the trial."""
        if isinstance(path, int):
            return None
        p = os.fsdecode(os.fspath(path))
        if not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd(), p)
        p = os.path.normpath(p)
        return p if self._inside(p) else None

    def _fd_path(self, fd: int) -> str | None:
        try:
            p = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return p if self._inside(p.removesuffix(" (deleted)")) else None

    def _ident(self, st: os.stat_result, new: bool = False) -> int:
        """The identity of what ``st`` describes (``new``: just created, whatever the inode held before)."""
        key = (st.st_dev, st.st_ino)
        if new or key not in self.ids:
            self.ids[key] = self._fresh()
        return self.ids[key]

    def _fresh(self) -> int:
        self.last_id += 1
        return self.last_id

    def _entry(self, path: str) -> Entry:
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return ("d" if stat.S_ISDIR(st.st_mode) else "f", self._ident(st))

    def _norm(self, path: str) -> str:
        for r in self.roots:
            if path == r or path.startswith(r + "/"):
                path = path[len(r):].lstrip("/") or "."
        return _HEX.sub("*", path)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _capture(self, e: Entry, path: str) -> None:
        """Remember a file's content before this process first changes or removes it."""
        if e is not None and e[0] == "f" and e[1] not in self.data:
            try:
                with _open(path, "rb") as f:
                    self.data[e[1]] = f.read()
            except OSError:
                pass

    def _changing(self, path: str) -> tuple[int, str] | None:
        """The name ``path`` is about to change: keep its durable entry (the first change since the
        directory's last fsync is the one that still holds on disk)."""
        parent, name = os.path.split(path)
        d = self._entry(parent)
        if d is None or not self._is_volatile(parent):
            return None
        e = self._entry(path)
        self._capture(e, path)
        self.dirty_names.setdefault(d[1], {}).setdefault(name, e)
        return d[1], name

    def _synced_dir(self, ino: int) -> None:
        """A directory's fsync makes its names durable, and with them the other half of every
        rename they took part in (a rename is atomic: it never persists in one directory only)."""
        for name in self.dirty_names.pop(ino, {}):
            other = self.renames.pop((ino, name), None)
            if other is not None:
                self.renames.pop(other, None)
                self.dirty_names.get(other[0], {}).pop(other[1], None)

    def _point(self, kind: str, *paths: str, extra: str = "", local: bool = True) -> Callable[[], None]:
        """Count the operation, crash before it if it is the point; returns what to call after it."""
        sig = f"{kind} {' -> '.join(self._norm(p) for p in paths)}{extra}"
        nth = self.counts[sig]
        self.counts[sig] += 1
        target = self.ctx.point
        hit = target is not None and target.label == self.label and target.sig == sig and target.nth == nth
        if hit and target.variant == "before":
            self._crash(drop=False)

        def after() -> None:
            if target is None:
                pending = bool(self.dirty_data) or any(self.dirty_names.values())
                _o["write"](self.log, (json.dumps({"sig": sig, "nth": nth, "local": local, "pending": local and pending}) + "\n").encode())
            elif hit:
                self._crash(drop=True)

        return after

    def _crash(self, drop: bool) -> None:
        _uninstall()  # other threads stop at the lock; the undoing itself is not recorded
        try:
            if drop:
                self._drop_unsynced()
        except BaseException:  # the trial must still die here; the parent reports the harness's failure
            (self.ctx.control / "drop-failed.txt").write_text(traceback.format_exc())
        # The fork server relays a child's exit status; should it lose one (exit 255), this says the
        # child died at its point rather than failing on its own.
        os.close(_o["open"](self.ctx.control / "crashed", os.O_WRONLY | os.O_CREAT, 0o644))
        group = self.ctx.group
        if group and os.getpgrp() == group:
            os.killpg(group, signal.SIGKILL)  # every process of the trial (the other ranks too)
        os.kill(os.getpid(), signal.SIGKILL)

    # -- the power loss ---------------------------------------------------------------------------
    def _is_volatile(self, path: str) -> bool:
        path = os.path.realpath(path.removesuffix(" (deleted)"))
        return any(path == v or path.startswith(v + "/") for v in self.volatile)

    def _where(self) -> dict[int, str]:
        """Where each known file and directory of the volatile trees is now."""
        out: dict[int, str] = {}
        for root in self.volatile:
            for dirpath, dirnames, filenames in os.walk(root):
                for path in (dirpath, *(os.path.join(dirpath, n) for n in filenames)):
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:
                        continue
                    if (st.st_dev, st.st_ino) in self.ids:
                        out.setdefault(self.ids[(st.st_dev, st.st_ino)], path)
        return out

    def _drop_unsynced(self) -> None:
        """Undo what a power loss would: names changed since their directory's fsync, then file
        content written since the file's fsync. Directories moved away are moved back first, so
        what they hold keeps its own durable state."""
        names = [(d, n, e) for d, m in self.dirty_names.items() for n, e in m.items()]
        for want in ("moved dirs", "new names", "old names"):
            where = self._where()
            for d, n, e in names:
                if d not in where:
                    continue  # the directory itself does not survive
                path = os.path.join(where[d], n)
                now = self._entry(path)
                if now == e:
                    continue
                if want == "moved dirs" and e is not None and e[0] == "d" and e[1] in where:
                    _remove(path)
                    _o["rename"](where[e[1]], path)
                    where = self._where()
                elif want == "new names" and e is None:
                    _remove(path)
                elif want == "old names" and e is not None:
                    _remove(path)
                    if e[0] == "d":
                        _o["mkdir"](path)
                    else:
                        with _open(path, "wb") as f:
                            f.write(self.data.get(e[1], b""))
        where = self._where()
        for ino in self.dirty_data:
            if ino in where and os.path.isfile(where[ino]):
                with _open(where[ino], "wb") as f:
                    f.write(self.data.get(ino, b""))

    # -- the wrappers -----------------------------------------------------------------------------
    def install(self) -> None:
        w = self
        o = _o

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            p = w._resolve(path, dir_fd) if flags & _WRITE_FLAGS else None
            if p is None:
                return o["open"](path, flags, mode, dir_fd=dir_fd)
            with w.lock:
                e = w._entry(p)
                if e is None and flags & os.O_CREAT:
                    after = w._point("create", p)
                    w._changing(p)
                elif e is not None and e[0] == "f" and flags & os.O_TRUNC and not flags & os.O_EXCL:
                    after = w._point("truncate", p)
                    w._capture(e, p)
                else:
                    after = None
                    w._capture(e, p)
                fd = o["open"](path, flags, mode, dir_fd=dir_fd)
                w._opened(fd, new=e is None)
                if after:
                    after()
                return fd

        def io_open(file, mode="r", *args, **kw):
            p = None if isinstance(file, int) or not any(c in mode for c in "wax+") else w._resolve(file, None)
            if p is None:
                return _open(file, mode, *args, **kw)
            with w.lock:
                e = w._entry(p)
                after = w._point("create" if e is None else "truncate" if "w" in mode else "open-write", p)
                if e is None:
                    w._changing(p)
                else:
                    w._capture(e, p)
                f = _open(file, mode, *args, **kw)
                w._opened(f.fileno(), new=e is None)
                after()
                return f

        def fd_op(kind: str, fd_arg: int, real: Callable, offset: Callable[[tuple], str] = lambda a: "") -> Callable:
            def wrapped(*args, **kw):
                p = w._fd_path(args[fd_arg])
                if p is None:
                    return real(*args, **kw)
                with w.lock:
                    after = w._point(kind, p, extra=offset(args))
                    w._opened(args[fd_arg])
                    r = real(*args, **kw)
                    after()
                    return r
            return wrapped

        def sync(real: Callable) -> Callable:
            def wrapped(fd):
                p = w._fd_path(fd)
                if p is None:
                    return real(fd)
                with w.lock:
                    st = os.fstat(fd)
                    ino = w._ident(st)
                    is_dir = stat.S_ISDIR(st.st_mode)
                    after = w._point("fsync-dir" if is_dir else "fsync", p)
                    r = real(fd)
                    if is_dir:
                        w._synced_dir(ino)
                    else:
                        with _open(f"/proc/self/fd/{fd}", "rb") as f:
                            w.data[ino] = f.read()
                        w.dirty_data.discard(ino)
                    after()
                    return r
            return wrapped

        def move(kind: str, real: Callable) -> Callable:
            def wrapped(src, dst, *, src_dir_fd=None, dst_dir_fd=None, **kw):
                s, d = w._resolve(src, src_dir_fd), w._resolve(dst, dst_dir_fd)
                if s is None and d is None:
                    return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, **kw)
                with w.lock:
                    after = w._point(kind, s or str(src), d or str(dst))
                    gone = w._changing(s) if kind != "link" and s else None
                    came = w._changing(d) if d else None
                    if gone and came:
                        w.renames[gone], w.renames[came] = came, gone
                    r = real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, **kw)
                    after()
                    return r
            return wrapped

        def name_op(kind: str, real: Callable, applies: Callable[[str], bool]) -> Callable:
            def wrapped(path, *args, dir_fd=None, **kw):
                p = w._resolve(path, dir_fd)
                if p is None or not applies(p):
                    return real(path, *args, dir_fd=dir_fd, **kw)  # outside, or an operation that changes nothing
                with w.lock:
                    after = w._point(kind, p)
                    w._changing(p)
                    r = real(path, *args, dir_fd=dir_fd, **kw)
                    if kind == "mkdir":
                        w._ident(os.lstat(p), new=True)
                    after()
                    return r
            return wrapped

        def empty_dir(p: str) -> bool:
            try:
                return os.path.isdir(p) and not os.path.islink(p) and not os.listdir(p)
            except OSError:
                return False

        os.open = open_
        io.open = builtins.open = io_open
        os.write = fd_op("write", 0, o["write"], lambda a: f" @{_tell(a[0])}")
        os.pwrite = fd_op("write", 0, o["pwrite"], lambda a: f" @{a[2]}")
        os.writev = fd_op("write", 0, o["writev"], lambda a: f" @{_tell(a[0])}")
        os.pwritev = fd_op("write", 0, o["pwritev"], lambda a: f" @{a[2]}")
        os.sendfile = fd_op("write", 0, o["sendfile"], lambda a: f" @{_tell(a[0])}")
        if "copy_file_range" in o:
            os.copy_file_range = fd_op("write", 1, o["copy_file_range"], lambda a: f" @{_tell(a[1])}")
        os.ftruncate = fd_op("truncate", 0, o["ftruncate"], lambda a: f" to {a[1]}")
        os.fsync = sync(o["fsync"])
        os.fdatasync = sync(o["fdatasync"])
        os.rename = move("rename", o["rename"])
        os.replace = move("rename", o["replace"])
        os.link = move("link", o["link"])
        os.unlink = name_op("unlink", o["unlink"], lambda p: os.path.lexists(p) and not os.path.isdir(p))
        os.remove = name_op("unlink", o["remove"], lambda p: os.path.lexists(p) and not os.path.isdir(p))
        os.rmdir = name_op("rmdir", o["rmdir"], empty_dir)
        os.mkdir = name_op("mkdir", o["mkdir"], lambda p: not os.path.lexists(p))
        self._install_s3()

    def _opened(self, fd: int, new: bool = False) -> None:
        """A file this process writes: its content until the next fsync is not durable."""
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and self._is_volatile(os.readlink(f"/proc/self/fd/{fd}")):
            ident = self._ident(st, new)
            self.data.setdefault(ident, b"")  # a new file (an existing one was captured before)
            self.dirty_data.add(ident)

    def _install_s3(self) -> None:
        try:
            from botocore.client import BaseClient
        except ImportError:
            return
        real = BaseClient._make_api_call
        w = self

        def call(client, operation: str, params: dict) -> Any:
            if operation not in S3_OPS:
                return real(client, operation, params)
            keys = [o["Key"] for o in params.get("Delete", {}).get("Objects", [])] or [params.get("Key", "")]
            names = [k.replace(w.ctx.s3_prefix, "<s3>") if w.ctx.s3_prefix else k for k in sorted(keys)]
            cond = "".join(f" {c}" for c in ("IfMatch", "IfNoneMatch") if c in params)
            with w.lock:
                after = w._point(f"s3:{operation}", *[f"s3/{_HEX.sub('*', n)}" for n in names], extra=cond, local=False)
            r = real(client, operation, params)
            with w.lock:
                after()
            return r

        BaseClient._make_api_call = call


def _uninstall() -> None:
    for name, fn in _o.items():
        setattr(os, name, fn)
    io.open = builtins.open = _open


def _tell(fd: int) -> int:
    try:
        return os.lseek(fd, 0, os.SEEK_CUR)
    except OSError:
        return -1


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        _o["unlink"](path)


# -- running trials ------------------------------------------------------------------------------
