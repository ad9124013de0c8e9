"""Every crash point of a scenario, enumerated (ALICE / CrashMonkey style) instead of sampled.

A scenario runs once in a child process that records each durable operation it makes under its
trial directory and on S3: file creates, writes, truncates, fsyncs, renames, links, unlinks,
mkdirs and rmdirs (by wrapping the ``os`` functions and ``open`` in that child only) and S3 PUTs
(conditional or not), multipart completes, copies and DELETEs (botocore's API call). Then, for
every operation k, the scenario runs again in a fresh child that dies by SIGKILL:

* ``before`` k: the process dies just before the operation (its page cache survives, as it does
  when a job is killed);
* ``after-drop`` k (local operations that leave something unsynced): right after the operation,
  with every change not yet made durable undone first, as a power loss would: each file written
  since its last fsync gets back its content of then, and each name changed in a directory since
  that directory's last fsync gets back its entry of then (a file, a directory, or nothing).

A fresh process then runs the scenario's check (restores, listings, a later save). A point is
named by its operation's signature (kind and paths relative to the trial, random parts of names
masked) and its occurrence, so the threads of a save and of its promotion may interleave
differently in each run and the point still means the same operation. A point a rerun never
reaches is counted as unreached, not as a failure.

``tierio bench crash`` runs every scenario of ``tierio.bench.crash_scenarios``.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import stat
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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
        keeps what it acknowledged, is not."""
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
def _quiet(ctx: Ctx, name: str) -> None:
    """The child's output (warnings of a recovery, say) goes to its control directory."""
    fd = _o["open"](ctx.control / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _trial_child(scenario: Scenario, ctx: Ctx) -> None:
    os.setpgid(0, 0)  # the trial's own group: a crash kills it and every rank it started, nothing else
    ctx.group = os.getpid()
    (ctx.control / "group").write_text(str(ctx.group))
    os.environ.update(ctx.env)
    _quiet(ctx, "run.log")
    try:
        scenario.run(ctx)
    except BaseException:
        (ctx.control / "error.txt").write_text(traceback.format_exc())
        os._exit(3)
    os._exit(0)


def _wait_group_gone(control: Path, timeout: float = 60.0) -> None:
    """Wait until no process of the trial's group exists, zombies included: the ranks a crash
    killed are orphans until init reaps them, and a lease whose holder's pid still exists is
    (rightly) not taken over as dead, so the check would wait out its expiry."""
    try:
        group = int((control / "group").read_text())
    except (FileNotFoundError, ValueError):
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = False
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[2]) == group:
                    alive = True
                    break
            except (OSError, IndexError, ValueError):
                continue
        if not alive:
            return
        time.sleep(0.05)


def _check_child(scenario: Scenario, ctx: Ctx) -> None:
    os.environ.update(ctx.env)
    _quiet(ctx, "check.log")
    try:
        problems = scenario.check(ctx)
    except BaseException:
        problems = [f"check raised: {traceback.format_exc(limit=6)}"]
    (ctx.control / "check.json").write_text(json.dumps(problems))
    os._exit(0)


def _in_child(target: Callable[..., None], *args: Any, timeout: float = TRIAL_TIMEOUT) -> int | None:
    """Run ``target(*args)`` in a fresh child forked from the warm fork server; its exit code (None: hung)."""
    p = _context().Process(target=target, args=args)
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the trial's group (its ranks too), when it made one
        except ProcessLookupError:
            pass
        p.kill()
        p.join()
        return None
    return p.exitcode


_ctx: Any = None


def _context() -> Any:
    """A fork server with torch and tierio imported: each trial is a fork of it (milliseconds)
    instead of a new interpreter importing torch (seconds)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "botocore.client", "tierio.ckpt", "tierio.weights", "tierio.data",
                                     "tierio.bench.crash", "tierio.bench.crash_scenarios"])
    return _ctx


@dataclass
class Outcome:
    point: Point | None
    result: str  # "ok" | "failed" | "unreached"
    problems: list[str] = field(default_factory=list)


def run_trial(scenario: Scenario, base: Path, point: Point | None, *, s3_endpoint_url: str | None = None,
              env: dict[str, str] | None = None, keep: bool = False) -> tuple[Outcome, Ctx]:
    """One run of ``scenario`` that crashes at ``point`` (records, when None), then its check."""
    trial = f"t{uuid.uuid4().hex[:10]}"
    ctx = Ctx(root=base / trial / "root", control=base / trial / "control", env=dict(env or {}), point=point)
    ctx.root.mkdir(parents=True)
    ctx.control.mkdir()
    if scenario.s3:
        if s3_endpoint_url is None:
            raise ValueError(f"scenario {scenario.name} needs an S3 store")
        bucket_path, _, query = s3_endpoint_url.removeprefix("s3://").partition("?")
        ctx.s3_prefix = f"{bucket_path.split('/', 1)[1]}/{trial}" if "/" in bucket_path else trial
        ctx.s3_url = f"s3://{bucket_path}/{trial}/data" + (f"?{query}" if query else "")
    code = _in_child(_trial_child, scenario, ctx)
    _wait_group_gone(ctx.control)
    if code == 255 and (ctx.control / "crashed").exists():
        code = CRASHED
    problems: list[str] = []
    if (ctx.control / "drop-failed.txt").exists():
        problems.append(f"the power loss could not be simulated: {(ctx.control / 'drop-failed.txt').read_text()}")
    if code is None:
        problems.append("the run hung")
    elif code not in (0, CRASHED):
        err = ctx.control / "error.txt"
        problems.append(f"the run failed (exit {code}): {err.read_text() if err.exists() else ''}")
    if not problems:
        if _in_child(_check_child, scenario, ctx) is None:
            problems.append("the check hung")
        else:
            problems.extend(json.loads((ctx.control / "check.json").read_text()))
    result = "failed" if problems else ("unreached" if point is not None and code == 0 else "ok")
    if not keep and not problems:
        shutil.rmtree(base / trial, ignore_errors=True)
    return Outcome(point, result, problems), ctx


def points_of(ctx: Ctx) -> tuple[int, list[Point]]:
    """The recorded operations' count and their crash points (both variants where they differ)."""
    ops = 0
    out: list[Point] = []
    for log in sorted(ctx.control.glob("ops-*.jsonl")):
        label = log.stem.removeprefix("ops-")
        for line in log.read_text().splitlines():
            op = json.loads(line)
            ops += 1
            out.append(Point(label, op["sig"], op["nth"], "before"))
            if op["pending"]:
                out.append(Point(label, op["sig"], op["nth"], "after-drop"))
    return ops, out


@dataclass
class Report:
    scenario: str
    operations: int
    points: int
    run: int
    failures: int
    unreached: int
    seconds: float
    failed: list[dict[str, Any]] = field(default_factory=list)


def enumerate_scenario(scenario: Scenario, base: Path, *, limit: int | None = None, seed: int = 0, jobs: int = 1,
                       s3_endpoint_url: str | None = None, env: dict[str, str] | None = None,
                       log: Callable[[str], None] = lambda m: None) -> Report:
    """Record ``scenario``, then crash it at each of its points (``limit``: a deterministic sample
    of that many) and check each crash; failures are kept on disk under ``base``."""
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    rec, ctx = run_trial(scenario, base, None, s3_endpoint_url=s3_endpoint_url, env=env, keep=True)
    ops, points = points_of(ctx)
    shutil.rmtree(ctx.root.parent, ignore_errors=True)
    chosen = points if limit is None or limit >= len(points) else sorted(random.Random(seed).sample(points, limit), key=points.index)
    log(f"{scenario.name}: {ops} operations, {len(points)} crash points, running {len(chosen)}")
    outcomes = [rec]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for o in pool.map(lambda p: run_trial(scenario, base, p, s3_endpoint_url=s3_endpoint_url, env=env)[0], chosen):
            outcomes.append(o)
            if o.result == "failed":
                log(f"{scenario.name}: FAILED at {o.point}: {'; '.join(o.problems)[:600]}")
    failed = [o for o in outcomes if o.result == "failed"]
    return Report(scenario.name, ops, len(points), len(chosen), len(failed), sum(o.result == "unreached" for o in outcomes),
                  round(time.monotonic() - t0, 1),
                  [{"point": str(o.point) if o.point else "no crash", "problems": o.problems} for o in failed])


# -- `tierio bench crash` --------------------------------------------------------------------------
TARGETS = {"failures": ("<=", 0)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", action="append", help="run only these scenarios (repeatable; default all)")
    p.add_argument("--limit", type=int, help="crash at a deterministic sample of this many points per scenario")
    p.add_argument("--jobs", type=int, default=2, help="trials run at once")
    p.add_argument("--dir", help="where trial directories go (default: the system's temporary directory)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tierio.bench.common import logger, work_dir
    from tierio.bench.crash_scenarios import SCENARIOS
    from tierio.storage.seaweed import SeaweedServer

    say = logger("crash")
    wanted = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    base = work_dir(args.dir, "crash")
    server = None
    env: dict[str, str] = {}
    s3 = None
    try:
        if any(s.s3 for s in wanted):
            server = SeaweedServer()
            server.start()
            env = dict(server.env())
            os.environ.update(env)
            from tierio.storage import S3Store

            bucket = f"crash-{uuid.uuid4().hex[:8]}"
            store = S3Store(bucket, endpoint=server.endpoint)
            store.create_bucket()
            store.close()
            s3 = server.url(bucket)
        reports = [enumerate_scenario(s, base / s.name, limit=args.limit, jobs=args.jobs, s3_endpoint_url=s3, env=env, log=say)
                   for s in wanted]
    finally:
        if server is not None:
            server.close()
    print_reports(reports, sys.stderr)
    total = sum(r.failures for r in reports)
    if not total:
        shutil.rmtree(base, ignore_errors=True)
    return {"scenarios": [asdict(r) for r in reports], "ratios": {"failures": total},
            "points": sum(r.points for r in reports), "seconds": round(sum(r.seconds for r in reports), 1),
            "kept": None if not total else str(base)}


def print_reports(reports: list[Report], out: Any = sys.stdout) -> None:
    cols = ("scenario", "operations", "points", "run", "failures", "unreached", "seconds")
    rows = [tuple(str(getattr(r, c)) for c in cols) for r in reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    for row in (cols, *rows):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=out)
    for r in reports:
        for f in r.failed[:5]:
            print(f"FAILED {r.scenario} at {f['point']}: {'; '.join(f['problems'])[:400]}", file=out)


def main(argv: list[str] | None = None) -> int:
    """``python -m tierio.bench.crash``: the table on stderr, the JSON on stdout."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    result = run(p.parse_args(argv))
    print(json.dumps(result, indent=1))
    return 1 if result["ratios"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
