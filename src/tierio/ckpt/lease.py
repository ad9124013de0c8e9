"""Tier leases: one run writes a tier at a time.

Two managers writing one tier corrupt it (the same step numbers from two jobs, or one job's
retention deleting the other's steps). Before its first write to a tier, rank 0 of a job takes the
tier's lease: a small JSON object ``tierio-lease.json`` at the tier's root, created only if absent
(``Store.create_exclusive``: ``O_EXCL`` on a filesystem, a conditional PUT on S3). It names the
holder — run id, host, node, pid, world size, when it was taken and its last heartbeat — and is
refreshed every ``HEARTBEAT`` seconds while the manager lives and deleted by ``close()``.

Every rank of one job shares the lease: ranks agree on one run id (``nodes.agree_job``), and a
rank that does not lead a tier only checks that its lease names its run before writing there.

A lease is *stale*, and the next writer takes it over with a warning, when its holder is provably
dead (same node and process namespace, pid gone) or its heartbeat is older than ``EXPIRES``
seconds. Anything else is refused with :class:`~tierio.errors.LeaseError` naming the holder;
``tierio ckpt unlock URL`` or ``CheckpointManager(..., break_lease=True)`` break a lease whose
holder is known to be gone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from tierio.errors import ConfigError, FormatError, LeaseError, NotFoundError, StorageError
from tierio.io.untrusted import Fields, loads
from tierio.storage.base import Store, read_bytes

log = logging.getLogger("tierio.ckpt")

LEASE_KEY = "tierio-lease.json"
SCHEMA = "tierio.lease"
HEARTBEAT = 30.0  # seconds between refreshes of a held lease
EXPIRES = 600.0  # a lease not refreshed for this long belongs to a dead or cut-off holder
UNREADABLE_GRACE = 60.0  # an unreadable lease younger than this may still be being written
MAX_LEASE_BYTES = 64 << 10
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def new_run_id() -> str:
    return uuid.uuid4().hex


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run_id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
    return run_id


def _node() -> str:
    """This machine's boot and process namespace: two holders with the same value see each other's
    pids. Empty where that cannot be known (then a holder's death is never assumed)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """Who holds a tier's lease (the content of the lease object)."""

    run: str
    host: str
    node: str
    pid: int
    world_size: int
    acquired: float  # seconds since the epoch, holder's clock
    heartbeat: float

    @staticmethod
    def mine(run: str, world_size: int) -> Holder:
        now = time.time()
        return Holder(run, socket.gethostname(), _node(), os.getpid(), world_size, now, now)

    def encode(self) -> bytes:
        return json.dumps({"schema": SCHEMA, "version": 1, "run": self.run, "host": self.host, "node": self.node,
                           "pid": self.pid, "world_size": self.world_size, "acquired": self.acquired,
                           "heartbeat": self.heartbeat}).encode()

    @staticmethod
    def parse(raw: bytes, where: str) -> Holder:
        f = Fields(loads(raw, where, limit=MAX_LEASE_BYTES), where)
        f.const("schema", SCHEMA)
        f.const("version", 1)
        run = f.str("run", 128)
        if not _RUN_ID.fullmatch(run):
            raise FormatError(f"{where}: run id {run[:40]!r} is not a plain identifier; the lease is corrupt or hostile")
        return Holder(run, f.str("host", 255), f.str("node", 255),
                      f.int("pid", 0, 1 << 31), f.int("world_size", 1, 1 << 20),
                      f.float("acquired", 0.0, 1e11), f.float("heartbeat", 0.0, 1e11))

    def dead(self) -> bool:
        """Provably gone: on this node, in this process namespace, and its pid no longer exists."""
        return bool(self.node) and self.node == _node() and not _alive(self.pid)

    def stale(self, now: float, expires: float = EXPIRES) -> str | None:
        """Why this lease may be taken over, or None while its holder may still be writing."""
        if self.dead():
            return f"its holder (pid {self.pid} on {self.host}) is no longer running"
        if now - self.heartbeat > expires:
            return f"its last heartbeat is {now - self.heartbeat:.0f} s old (leases expire after {expires:.0f} s)"
        return None

    def describe(self, now: float) -> str:
        return (f"run {self.run} on host {self.host} (pid {self.pid}, {self.world_size} rank(s)), "
                f"taken {max(0.0, now - self.acquired):.0f} s ago, last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")


def _where(store: Store) -> str:
    return f"{store.url.split('?')[0].rstrip('/')}/{LEASE_KEY}"


def read_lease(store: Store) -> Holder | None:
    """The tier's lease holder; None when there is no lease. An unreadable lease is a FormatError."""
    try:
        size = store.stat(LEASE_KEY).size
        if size > MAX_LEASE_BYTES:
            raise FormatError(f"{_where(store)} is {size} bytes; a lease is a few hundred: it is corrupt or hostile")
        raw = read_bytes(store, LEASE_KEY, 0, size)
    except NotFoundError:
        return None
    return Holder.parse(raw, _where(store))


def _unreadable_age(store: Store) -> float:
    """How long an unreadable lease has been there; infinite when it is not even a regular file
    (a planted link: deleting it removes the link, never what it points to)."""
    try:
        return time.time() - store.stat(LEASE_KEY).mtime
    except NotFoundError:
        return 0.0
    except FormatError:
        return float("inf")


def _refusal(store: Store, holder: Holder) -> LeaseError:
    now = time.time()
    return LeaseError(
        f"{store.url} is leased by another writer: {holder.describe(now)}. Two managers writing one tier "
        f"corrupt it; wait for that run to finish, point this run at another tier, or - only if that run is "
        f"gone - break the lease with 'tierio ckpt unlock {store.url}' or CheckpointManager(..., break_lease=True)"
    )


def acquire(store: Store, me: Holder, *, force: bool = False, expires: float = EXPIRES) -> Holder | None:
    """Take the lease of ``store`` for ``me``; returns the holder whose stale lease was broken.

    A lease already naming ``me.run`` is taken over (a restarted rank 0 of the same run)."""
    broken: Holder | None = None
    problem = "other writers keep taking it; is another job starting on this tier?"
    for _ in range(5):
        if store.create_exclusive(LEASE_KEY, me.encode()):
            return broken
        try:
            holder = read_lease(store)
        except FormatError as exc:
            if _unreadable_age(store) < UNREADABLE_GRACE and not force:
                problem = (f"its lease is unreadable ({exc}) and too recent to be debris; retry in a minute "
                           f"or remove it with 'tierio ckpt unlock {store.url}'")
                time.sleep(0.2)  # maybe being written right now
                continue
            log.warning("breaking an unreadable lease on %s: %s", store.url, exc)
            store.delete(LEASE_KEY)
            continue
        if holder is None:
            continue  # released in between
        if holder.run == me.run:
            store.put_buffers(LEASE_KEY, [me.encode()])
            return None
        why = holder.stale(time.time(), expires) or ("break_lease was requested" if force else None)
        if why is None:
            raise _refusal(store, holder)
        log.warning("taking over the lease on %s from %s: %s", store.url, holder.describe(time.time()), why)
        store.delete(LEASE_KEY)
        broken = holder
    raise LeaseError(f"could not take the lease on {store.url}: {problem}")


def refresh(store: Store, me: Holder) -> str | None:
    """Renew the heartbeat; when the lease is no longer ``me.run``'s, say who holds it now."""
    holder = read_lease(store)
    if holder is None:
        return "nobody: the lease was deleted (tierio ckpt unlock?)"
    if holder.run != me.run:
        return holder.describe(time.time())
    store.put_buffers(LEASE_KEY, [replace(me, heartbeat=time.time()).encode()])
    return None


def release(store: Store, run: str) -> None:
    """Delete the lease if it still names ``run``."""
    try:
        holder = read_lease(store)
    except FormatError:
        return
    if holder is not None and holder.run == run:
        store.delete(LEASE_KEY)


def unlock(store: Store, *, force: bool = False, expires: float = EXPIRES) -> Holder | None:
    """Break the lease of ``store`` if it is stale (or at all with ``force``); returns the holder removed."""
    try:
        holder = read_lease(store)
    except FormatError:
        store.delete(LEASE_KEY)
        return None
    if holder is None:
        return None
    if not force and holder.stale(time.time(), expires) is None:
        raise LeaseError(
            f"the lease on {store.url} looks alive: {holder.describe(time.time())}; stop that run first, or pass "
            "--force if you know it is gone (its heartbeat stops when its process dies)"
        )
    store.delete(LEASE_KEY)
    return holder


@contextmanager
def tool_lease(store: Store, *, force: bool = False) -> Iterator[Holder]:
    """The lease of ``store`` for a one-off writer (``tierio ckpt gc``, ``promote``), held while it runs."""
    me = Holder.mine(f"tool-{new_run_id()}", 1)
    acquire(store, me, force=force)
    try:
        yield me
    finally:
        release(store, me.run)


class TierLeases:
    """The leases one manager holds (rank 0) or has checked (other ranks), and their heartbeat."""

    def __init__(self, run: str | None, rank: int, world_size: int, *, force: bool = False,
                 wait_timeout: float = 600.0) -> None:
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.force = force
        self.wait_timeout = wait_timeout
        self._me: Holder | None = None
        self._ok: dict[str, Store] = {}  # url -> store: held (its leader) or checked (other ranks)
        self._held: set[str] = set()  # the urls this rank leads
        self._lost: dict[str, str] = {}  # url -> who holds its lease now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure(self, store: Store, leader: bool | None = None) -> None:
        """Before writing to ``store``: hold its lease (its leader: rank 0, or the lowest rank of a
        node for a node-local tier) or check that it names this run (the other ranks)."""
        leader = self.rank == 0 if leader is None else leader
        with self._lock:
            lost = self._lost.get(store.url)
            if lost is not None:
                raise LeaseError(f"this run's lease on {store.url} was taken over; it is now held by {lost}; "
                                 "this manager no longer writes there")
            if store.url in self._ok:
                return
        if leader:
            assert self.run is not None
            me = Holder.mine(self.run, self.world_size)
            acquire(store, me, force=self.force)
            with self._lock:
                self._me = me
                self._ok[store.url] = store
                self._held.add(store.url)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._beat, name="tierio-ckpt-lease", daemon=True)
                    self._thread.start()
        else:
            self._join(store)
            with self._lock:
                self._ok[store.url] = store

    def status(self) -> dict[str, str]:
        """Per tier url: "held" (rank 0), "joined" (other ranks) or why this run lost it."""
        with self._lock:
            out = {url: ("held" if url in self._held else "joined") for url in self._ok}
            out.update({url: f"lost: now held by {who}" for url, who in self._lost.items()})
            return out

    def _join(self, store: Store) -> None:
        """A non-zero rank waits for rank 0's lease: the same run id, or, when ranks could not agree
        on one (no process group, no run_id), a live lease of a job of the same size, whose run it adopts."""
        deadline = time.monotonic() + self.wait_timeout
        holder: Holder | None = None
        while time.monotonic() < deadline:
            try:
                holder = read_lease(store)
            except FormatError:
                holder = None
            if holder is not None:
                if self.run is not None and holder.run == self.run:
                    return
                if self.run is None and holder.world_size == self.world_size and holder.stale(time.time()) is None:
                    self.run = holder.run
                    return
            time.sleep(0.05)
        now = time.time()
        raise LeaseError(
            f"rank {self.rank} waited {self.wait_timeout:.0f} s for rank 0 of run {self.run or '(unknown)'} to lease "
            f"{store.url}, but " + (f"it is leased by {holder.describe(now)}" if holder else "nobody leased it")
            + "; did rank 0 fail, or is another job using this tier?"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            with self._lock:
                held = [s for url, s in self._ok.items() if url in self._held]
                me = self._me
            for store in held:
                if me is None or store.url in self._lost or self._stop.is_set():
                    continue
                try:
                    other = refresh(store, me)
                except (StorageError, FormatError) as exc:  # an outage: try again at the next beat
                    log.warning("could not renew the lease on %s: %s", store.url, exc)
                    continue
                if other is not None:
                    log.error("the lease on %s was taken over; it is now held by %s", store.url, other)
                    with self._lock:
                        self._lost[store.url] = other

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # a renewal in flight must not rewrite a lease after its release
        if self.run is None:
            return
        with self._lock:
            held = [s for url, s in self._ok.items() if url in self._held and url not in self._lost]
            self._ok.clear()
            self._held.clear()
        for store in held:
            try:
                release(store, self.run)
            except StorageError as exc:
                log.warning("could not release the lease on %s (it expires by itself): %s", store.url, exc)
