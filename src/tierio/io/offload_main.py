"""The persist process (``io.offload``): ``python -m tierio.io.offload_main FD PARENT_PID NICE``.

It maps the staging buffers the training process shares with it and runs the byte loops asked of
it, each connection on a thread of its own, with the same ``LocalStore`` and checksum code as the
in-process path. It imports neither torch nor anything of the training job.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from tierio.errors import StorageError
from tierio.io.checksum import xxh3
from tierio.io.offload import Ref
from tierio.storage.local import LocalStore

# A scheduler signals the whole job; the training process decides when this process stops.
IGNORED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
PARENT_CHECK_SECONDS = 1.0

_maps: dict[int, mmap.mmap] = {}
_stores: dict[tuple[str, bool], LocalStore] = {}
_lock = threading.Lock()


def _views(parts: list[tuple[int, int, int]]) -> list[memoryview]:
    with _lock:
        return [memoryview(_maps[serial])[offset : offset + n] for serial, offset, n in parts]


def _store(root: str, direct: bool) -> LocalStore:
    with _lock:
        got = _stores.get((root, direct))
        if got is None:
            got = _stores[(root, direct)] = LocalStore(root, direct=direct, create=False)
        return got


def _unwire(value: Any, views: list[memoryview]) -> Any:
    """An argument as the caller passed it (a shared-memory reference as a memoryview, kept in
    ``views`` to be released after the call)."""
    if isinstance(value, Ref):
        views.extend(_views([value.part]))
        return views[-1]
    if isinstance(value, (list, tuple)):
        return type(value)(_unwire(v, views) for v in value)
    return value


def _run(op: str, parts: list[tuple[int, int, int]], args: tuple) -> Any:
    views: list[memoryview] = []
    try:
        if op == "store":  # a LocalStore method (offload.routed, offload.read_into)
            root, direct, name, pos, kw = args
            pos, kw = _unwire(pos, views), {k: _unwire(v, views) for k, v in kw.items()}
            return getattr(_store(root, direct), name)(*pos, **kw)
        if op == "xxh3":
            views = _views(parts)
            return [xxh3(v) for v in views]
        raise ValueError(f"unknown request {op!r}")
    finally:
        for v in views:
            v.release()


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an error that cannot cross keeps its text
        return StorageError(f"{type(exc).__name__}: {exc}")


def _serve(conn: Connection) -> None:
    while True:
        try:
            op, parts, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", _run(op, parts, args))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            reply = ("err", _picklable(exc))
        conn.send(reply)
        del reply  # an error's tracebacks hold frames, and their views of shared memory


def main(argv: list[str]) -> None:
    fd, parent, nice = int(argv[0]), int(argv[1]), int(argv[2])
    for name in IGNORED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if os.getppid() != parent:
        return  # the training process is already gone
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, parent) + nice))
        except OSError:
            pass
    control = Connection(fd)
    control.send("ready")
    while True:
        try:
            # Told to exit, the control socket closed, or the training process gone (a child it
            # forked may still hold a copy of the socket): requests still running end here.
            while not control.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != parent:
                    os._exit(0)
            msg = control.recv()
        except (EOFError, OSError):
            os._exit(0)
        if msg[0] == "exit":
            os._exit(0)
        if msg[0] == "map":
            _, serial, size = msg
            handle = recv_handle(control)
            with _lock:
                # populated: its pages exist already, and faulting them in one by one runs at well
                # under 1 GB/s on a VM (the first save would pay it)
                _maps[serial] = mmap.mmap(handle, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.close(handle)
            control.send("mapped")
        elif msg[0] == "unmap":
            with _lock:
                got = _maps.pop(msg[1], None)
            if got is not None:
                try:
                    got.close()
                except BufferError:  # a view still held (an error's traceback): unmapped when it goes
                    pass
        elif msg[0] == "connect":
            threading.Thread(target=_serve, args=(Connection(recv_handle(control)),), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
