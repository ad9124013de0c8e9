"""Offload: background byte loops in a process of their own, off the training interpreter.

A checkpoint's byte loops (the shard's write, its checksums, the promotion's read and write) all
release the GIL, but every return from one asks for the GIL back, and a training step running
Python then waits for a handover: two context switches, a few hundred times per save. Here those
loops run in a helper process instead, on staging memory that both processes map (``memfd``
buffers, ``BufferPool(offload=True)``): the background thread sends one request and sleeps until
the answer, so a save costs the step a few dozen handovers. The helper runs at the background
niceness (``io.background``), so it takes a contended core after the step.

What goes there: ``xxh3_ranges`` and ``LocalStore.read_into`` on shared staging memory, and the
``LocalStore`` methods marked ``routed`` when a background thread calls them on a store marked
``offload`` (a checkpoint tier's; its shared buffers cross by reference, small ones as bytes). A
``CheckpointManager`` with ``persist_process=True`` holds a helper (``hold``/``let_go``; the last
holder stops it); anything else runs in the calling thread as before. The helper builds the same
``LocalStore`` and runs the same code, so durability, path checks and errors (their types too) are
those of the in-process path.

Faults: the helper ignores the signals a scheduler sends the job (SIGTERM, SIGINT, SIGUSR1/2,
SIGHUP), so an emergency save still has it; it exits when the training process does (its control
socket closes, or it finds its parent gone), and a write cut short that way leaves only a temp
file (``io.durable``). A helper that dies (OOM, kill -9) fails the request in flight with a
StorageError naming it, and the next request starts a new one. Where none can start, a warning
says so and everything runs here.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, TypeVar

from tierio.errors import StorageError
from tierio.io import background
from tierio.io.buffers import address_of

T = TypeVar("T")

log = logging.getLogger("tierio.io")

START_SECONDS = 60.0  # the longest a new helper may take to import what it runs
Part = tuple[int, int, int]  # (shared buffer serial, offset in it, bytes)


@dataclass
class _Shared:
    start: int
    end: int
    fd: int


_registry: dict[int, _Shared] = {}  # serial -> a live shared buffer
_dying: list[int] = []  # serials whose buffers were collected, not yet dropped from the registry
_retired: list[int] = []  # serials dropped here that the helper may still map
_next_serial = [0]
_lock = threading.Lock()


def share(address: int, size: int, fd: int) -> int:
    """Register a shared buffer (its memory at ``address``, backed by ``fd``); its serial."""
    with _lock:
        _settle()
        _next_serial[0] += 1
        _registry[_next_serial[0]] = _Shared(address, address + size, fd)
        return _next_serial[0]


def retire(serial: int) -> None:
    """A shared buffer was collected. This runs in its finalizer, which the garbage collector may
    call inside any code, this module's locked sections included: so it only notes the serial
    (``list.append`` needs no lock), and the next look-up drops it (``_settle``)."""
    _dying.append(serial)


def _settle() -> None:
    """Drop the collected buffers from the registry (``_lock`` held): before any look-up, so memory
    mapped again at a collected buffer's address is never taken for it."""
    while _dying:
        serial = _dying.pop()
        got = _registry.pop(serial, None)
        if got is not None:
            os.close(got.fd)
            _retired.append(serial)


def _part(view: Any) -> Part | None:
    mv = memoryview(view)
    n = mv.nbytes
    if n == 0 or not mv.contiguous:
        return None
    addr = address_of(mv)
    for serial, s in _registry.items():
        if s.start <= addr and addr + n <= s.end:
            return serial, addr - s.start, n
    return None


def shared_parts(buffers: Sequence[Any]) -> list[Part] | None:
    """Where ``buffers`` lie in shared staging memory, when a helper is held and they all do."""
    if not _helper.active or not buffers:
        return None
    with _lock:
        _settle()
        parts = [_part(b) for b in buffers]
    return None if any(p is None for p in parts) else parts  # type: ignore[return-value]


class _Conn(Connection):
    """A connection to one helper (``generation``: the how-manyth this process started)."""

    def __init__(self, fd: int, generation: int) -> None:
        super().__init__(fd)
        self.generation = generation


class Helper:
    """The helper process and the connections to it (one per calling thread at a time)."""

    def __init__(self) -> None:
        self.holders = 0
        self.calls = 0  # requests in flight: the helper outlives its last holder until they end
        self.nice = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: Connection | None = None
        self._idle: list[_Conn] = []
        self._mapped: set[int] = set()
        self._broken = False  # a request found the helper gone: the next one starts a new helper
        self.unavailable = False  # it could not be started: everything runs in this process
        self.requests = 0  # answered so far, by every helper this process started
        self.started = 0

    @property
    def active(self) -> bool:
        return self.holders > 0 and not self.unavailable

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._control = Connection(ours.detach())
        self._idle, self._mapped, self._broken = [], set(), False
        self.started += 1  # also the generation: a connection to an earlier helper is not reused
        try:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "tierio.io.offload_main", str(theirs.fileno()), str(os.getpid()), str(self.nice)],
                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
            finally:
                theirs.close()  # the helper's end is the helper's alone: its exit is then an EOF here
            # Ready once it has imported what it runs; one that cannot start leaves the work here.
            ready = self._control.poll(START_SECONDS) and self._control.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._stop()
            self.unavailable = True
            log.warning("the persist process did not start (%s -m tierio.io.offload_main); checkpoints move their "
                        "bytes on threads of this process instead (persist_process=False)", sys.executable)
            raise _Unavailable

    def _connection(self, serials: set[int]) -> _Conn:
        """A connection to a running helper that maps ``serials`` (started or restarted as needed)."""
        with self._lock:
            if self._proc is None or self._broken:
                self._stop()
                self._start()
            assert self._control is not None and self._proc is not None
            with _lock:
                _settle()
                retired = [s for s in _retired if s in self._mapped]
                _retired.clear()
                fds = {s: _registry[s] for s in serials - self._mapped}
            for s in retired:
                self._control.send(("unmap", s))
                self._mapped.discard(s)
            for s, shared in fds.items():
                self._control.send(("map", s, shared.end - shared.start))
                send_handle(self._control, shared.fd, self._proc.pid)
                self._control.recv()  # mapped before a request names it
                self._mapped.add(s)
            if self._idle:
                return self._idle.pop()
            ours, theirs = socket.socketpair()
            self._control.send(("connect",))
            send_handle(self._control, theirs.fileno(), self._proc.pid)
            theirs.close()
            return _Conn(ours.detach(), self.started)

    def call(self, what: str, op: str, parts: list[Part], *args: Any) -> Any:
        """Run ``op`` in the helper on ``parts`` of shared memory; ``what`` names the operation in errors
        (``_Unavailable`` once the last holder let go: the caller runs it itself)."""
        with self._lock:
            if self.holders == 0:
                raise _Unavailable
            self.calls += 1
        try:
            return self._call(what, op, parts, args)
        finally:
            self._end_call()

    def _call(self, what: str, op: str, parts: list[Part], args: tuple) -> Any:
        conn: _Conn | None = None
        try:
            conn = self._connection({p[0] for p in parts})
            conn.send((op, parts, args))
            status, value = conn.recv()
        except (EOFError, OSError) as exc:
            self._broken = True
            if conn is not None:
                conn.close()
            proc = self._proc
            try:
                code = proc.wait(timeout=1) if proc is not None else None
            except subprocess.TimeoutExpired:
                code = None
            how = f"exit status {code}" if code is not None and code >= 0 else \
                f"signal {signal.Signals(-code).name}" if code is not None else str(exc) or type(exc).__name__
            raise StorageError(f"the persist process (pid {proc.pid if proc else '?'}) ended ({how}) while {what}; "
                               "nothing of it was committed, and the next request starts a new process") from exc
        with self._lock:
            if conn.generation == self.started and self._proc is not None:
                self._idle.append(conn)
            else:
                conn.close()
            self.requests += 1
        if status == "err":
            raise value
        return value

    def _end_call(self) -> None:
        with self._lock:
            self.calls -= 1
            if self.calls == 0 and self.holders == 0:
                self._stop()

    def _stop(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle = []
        if self._control is not None:
            try:
                self._control.send(("exit",))
            except OSError:
                pass  # gone already
            self._control.close()
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def warm(self) -> None:
        """Start a helper on a thread of its own unless one runs (``_connection`` waits for it)."""
        if self._proc is None and not self.unavailable and self.holders > 0:
            threading.Thread(target=self._start_if_none, name="tierio-offload-start", daemon=True).start()

    def _start_if_none(self) -> None:
        with self._lock:
            if self._proc is None and not self.unavailable and self.holders > 0:
                try:
                    self._start()
                except _Unavailable:
                    pass

    def hold(self, nice: int) -> None:
        with self._lock:
            self.holders += 1
            self.nice = max(self.nice, nice)
        self.warm()  # ready before the first save, which may be an emergency save

    def let_go(self) -> None:
        """One holder fewer; the last one stops the helper, or leaves that to the last request still
        running in it (a promotion's write on a background thread): stopping it would cut that short."""
        with self._lock:
            self.holders -= 1
            if self.holders == 0 and self.calls == 0:
                self._stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


_helper = Helper()


def _forget_after_fork() -> None:
    """A forked child (a DataLoader worker) does not own its parent's helper: it has none, and
    closes its copies of the sockets to it, so the helper still sees the parent go."""
    global _helper, _lock
    for conn in [_helper._control, *_helper._idle]:
        if conn is not None:
            conn.close()
    _helper, _lock = Helper(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def hold(nice: int) -> None:
    """Keep a helper for this process's shared staging memory (started now, behind the caller)."""
    _helper.hold(nice)


def warm() -> None:
    """Start the helper behind the caller (a save's staging copy) if none runs (one that was
    stopped or died since): the save does not wait for it to start."""
    _helper.warm()


def let_go() -> None:
    """The holder is done with it; the last one stops the helper."""
    _helper.let_go()


def stay_in_process() -> None:
    """From now on every byte loop of this process runs here, whatever its managers ask (a harness
    that watches this interpreter's system calls: ``tierio.bench.crash``)."""
    _helper.unavailable = True


def helper_pid() -> int | None:
    """The running helper's process id (None: none runs)."""
    return _helper.pid


def stats() -> dict[str, Any]:
    """The persist process: its pid (None: none runs), the managers holding it, requests in flight,
    requests answered and helpers started so far in this process, and whether one could not be
    started (the work then runs on threads here)."""
    return {"pid": _helper.pid, "holders": _helper.holders, "in_flight": _helper.calls, "requests": _helper.requests,
            "started": _helper.started, "unavailable": _helper.unavailable}


INLINE_BYTES = 8 << 20  # a buffer outside shared memory crosses as bytes up to this size


@dataclass(frozen=True)
class Ref:
    """An argument in shared staging memory, sent by reference."""
    part: Part


class _Unsendable(Exception):
    """An argument that cannot cross: the call runs here."""


class _Unavailable(Exception):
    """No helper could be started: the call runs here."""


def _wire(value: Any, refs: list[Part]) -> Any:
    """``value`` as sent to the helper (shared memory by reference, small buffers as bytes)."""
    if isinstance(value, (memoryview, bytearray, bytes)):
        part = _part(value)
        if part is not None:
            refs.append(part)
            return Ref(part)
        if memoryview(value).nbytes > INLINE_BYTES:
            raise _Unsendable
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_wire(v, refs) for v in value)
    if value is None or isinstance(value, (str, int, float, bool, os.PathLike)):
        return value
    raise _Unsendable


def routed(method: Callable[..., T]) -> Callable[..., T]:
    """A ``LocalStore`` method that a background thread runs in the helper, for a store marked
    ``offload`` (a checkpoint tier's, ``persist_process``) while a helper is held; the training
    thread and stores with a rate limiter keep theirs here (``io.background``)."""
    name = method.__name__

    @functools.wraps(method)
    def run(store: Any, *args: Any, **kwargs: Any) -> T:
        if not (store.offload and _helper.active) or store.limiter is not None or background.level() == 0:
            return method(store, *args, **kwargs)
        refs: list[Part] = []
        try:
            with _lock:
                _settle()
                sent = _wire(args, refs), {k: _wire(v, refs) for k, v in kwargs.items()}
            return _helper.call(f"{name} under {store.root}", "store", refs, str(store.root), store.direct, name, *sent)
        except (_Unsendable, _Unavailable):
            return method(store, *args, **kwargs)
    return run


def read_into(root: str, direct: bool, key: str, offset: int, part: Part) -> int | None:
    """``LocalStore.read_into`` in the helper, into shared memory (None: none could be started, the
    caller reads). Not ``routed``: a destination outside shared memory cannot cross as bytes."""
    try:
        return _helper.call(f"reading {key} under {root}", "store", [part], root, direct, "read_into",
                            (key, offset, Ref(part)), {})
    except _Unavailable:
        return None


def xxh3_ranges(view: memoryview, ranges: Sequence[tuple[int, int]]) -> list[str] | None:
    """xxh3 of each ``(begin, end)`` range of ``view`` in the helper (None: ``view`` is not in
    shared memory or no helper is held: the caller hashes)."""
    got = shared_parts([view])
    if got is None:
        return None
    serial, offset, _ = got[0]
    try:
        return _helper.call("checksumming staged bytes", "xxh3", [(serial, offset + b, e - b) for b, e in ranges])
    except _Unavailable:
        return None


__all__ = ["Part", "Ref", "helper_pid", "hold", "let_go", "read_into", "retire", "routed", "share", "shared_parts", "stats", "stay_in_process", "warm", "xxh3_ranges"]
