"""Tier leases: one run writes a tier at a time, proven by compare-and-swap and a fencing token.

Two managers writing one tier corrupt it (the same step numbers from two jobs, or one job's
retention deleting the other's steps). Before its first write to a tier, the tier's leader (rank 0;
a node's lowest rank for its node-local tier) takes the tier's lease.

**Generations.** A lease is a sequence of small JSON objects ``tierio-lease/<generation>.json``;
the newest generation is the lease. Every change of holder (a take-over, a release, a break) is the
creation of the *next* generation with ``Store.create_exclusive`` (a link on a filesystem, a PUT
with ``If-None-Match: *`` on S3): of any number of contenders that read generation ``g``, exactly
one creates ``g+1``. Nothing is ever deleted-then-created, so there is no moment at which two
takers can both win, and the generation only grows: it is the fencing token. Every manifest
records the generation it was committed under (``GENERATION_FIELD``), and a commit is refused
unless the writer's generation is still the newest, checked just before the manifest is written
and again just after (a writer paused between the two retracts its manifest).

**Renewal.** The holder rewrites its own generation's object every ``LeaseTiming.heartbeat`` s
with a growing beat counter. It never writes another generation's object, so a holder paused
across a take-over (GC pause, SIGSTOP, a slow S3 call) can only rewrite its superseded generation,
never its successor's lease; its next renewal or commit sees the newer generation and stops.

**Staleness, on the taker's clock.** A taker never compares the holder's wall clock with its own:
it watches the newest generation's bytes and takes over only when they stayed unchanged for
``LeaseTiming.expires`` s on *its* monotonic clock (a live holder renews well within that: the
watch ends with a refusal naming it). A holder whose last successful renewal is older than
``expires - margin`` on its own monotonic clock stops writing (self-fencing) before anyone may take
over. Shortcuts: a holder that is provably dead (same node and pid namespace, pid gone), a released
or broken lease, this run's own lease (a restarted rank 0), ``break_lease`` / ``tierio ckpt
unlock --force``, and, on a node-local tier, a free ``flock`` on ``tierio-lease.lock``: the leader
holds it for the life of its process and the kernel drops it when the process dies.

This module is the protocol, as plain functions over a ``Store``; ``ckpt.steps.tier_leases.TierLeases``
is what a manager holds: its tiers' leases, their renewal thread and the fence of every commit.

**Stores that ignore conditions.** Before its first lease on a store, a process creates a probe
object twice: a store that lets both creations succeed would let two takers win, and is refused.
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

from tierio.dist import machine
from tierio.errors import ConfigError, FormatError, IntegrityError, LeaseError, NotFoundError, StorageError
from tierio.io.untrusted import Fields, loads
from tierio.storage.base import Store, read_small, where

log = logging.getLogger("tierio.ckpt")

LEASE_PREFIX = "tierio-lease/"
NODE_LOCK = "tierio-lease.lock"  # flocked for life by a node-local tier's leader
GENERATION_FIELD = "tierio.lease_generation"  # in a manifest's extra: the generation it was committed under
SCHEMA = "tierio.lease"
MAX_LEASE_BYTES = 64 << 10
MAX_GENERATION = 10**12 - 2
_GEN_NAME = re.compile(r"(\d{12})\.json")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_STATES = ("held", "released", "broken")


@dataclass(frozen=True)
class LeaseTiming:
    """How often a holder renews, after how long unchanged a lease may be taken over, and how long
    before that a holder that could not renew stops writing (seconds). ``TIERIO_LEASE_EXPIRES``
    sets ``expires`` for every process that does not pass its own (``tierio ckpt`` tools too)."""

    expires: float = 120.0

    @property
    def heartbeat(self) -> float:
        return self.expires / 12

    @property
    def margin(self) -> float:
        """Time left, after a holder's self-fence, for a write it already started (one manifest PUT)."""
        return self.expires / 4

    @staticmethod
    def default() -> LeaseTiming:
        raw = os.environ.get("TIERIO_LEASE_EXPIRES")
        if not raw:
            return LeaseTiming()
        try:
            return LeaseTiming(float(raw)).checked()
        except ValueError:
            raise ConfigError(f"TIERIO_LEASE_EXPIRES={raw!r} must be a number of seconds (e.g. 120)") from None

    def checked(self) -> LeaseTiming:
        if not 0.5 <= self.expires <= 86400:
            raise ConfigError(f"a lease expiry of {self.expires!r} s is out of range; use 0.5-86400 s (default 120)")
        return self


def new_run_id() -> str:
    return uuid.uuid4().hex


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run_id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
    return run_id


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def generation_key(generation: int) -> str:
    return f"{LEASE_PREFIX}{generation:012d}.json"


@dataclass(frozen=True)
class Holder:
    """The content of one generation of a tier's lease: who, and in which state."""

    run: str
    host: str
    node: str
    pid: int
    world_size: int
    generation: int = 0
    state: str = "held"  # "released" by its holder, "broken" by an operator: free to take
    acquired: float = 0.0  # the holder's wall clock: shown to people, never used to decide
    renewed: float = 0.0
    beat: int = 0  # grows with every renewal: what a watcher sees change

    @staticmethod
    def mine(run: str, world_size: int) -> Holder:
        now = time.time()
        return Holder(run, socket.gethostname(), machine(), os.getpid(), world_size, 0, "held", now, now)

    def encode(self) -> bytes:
        return json.dumps({"schema": SCHEMA, "version": 2, "run": self.run, "host": self.host, "node": self.node,
                           "pid": self.pid, "world_size": self.world_size, "generation": self.generation,
                           "state": self.state, "acquired": self.acquired, "renewed": self.renewed,
                           "beat": self.beat}).encode()

    @staticmethod
    def parse(raw: bytes, where: str, generation: int) -> Holder:
        f = Fields(loads(raw, where, limit=MAX_LEASE_BYTES), where)
        f.const("schema", SCHEMA)
        f.const("version", 2)
        run = f.str("run", 128)
        if not _RUN_ID.fullmatch(run):
            raise FormatError(f"{where}: run id {run[:40]!r} is not a plain identifier; the lease is corrupt or hostile")
        state = f.str("state", 16)
        if state not in _STATES:
            raise FormatError(f"{where}: state {state[:20]!r} is not one of {', '.join(_STATES)}")
        h = Holder(run, f.str("host", 255), f.str("node", 255), f.int("pid", 0, 1 << 31), f.int("world_size", 1, 1 << 20),
                   f.int("generation", 1, MAX_GENERATION + 1), state, f.float("acquired", 0.0, 1e11),
                   f.float("renewed", 0.0, 1e11), f.int("beat", 0, 1 << 62))
        if h.generation != generation:
            raise FormatError(f"{where}: it says generation {h.generation}; its name says {generation}")
        return h

    def dead(self) -> bool:
        """Provably gone: on this node, in this process namespace, and its pid no longer exists."""
        return bool(self.node) and self.node == machine() and not _alive(self.pid)

    def hint(self, now: float, timing: LeaseTiming) -> str | None:
        """Why this lease looks free to a person (never used to take it: see ``acquire``)."""
        if self.state != "held":
            return f"it was {self.state}"
        if self.dead():
            return f"its holder (pid {self.pid} on {self.host}) is no longer running"
        if now - self.renewed > timing.expires:
            return f"last renewed {now - self.renewed:.0f} s ago by the holder's clock"
        return None

    def describe(self, now: float) -> str:
        return (f"run {self.run} on host {self.host} (pid {self.pid}, {self.world_size} rank(s)), generation "
                f"{self.generation}, taken {max(0.0, now - self.acquired):.0f} s ago, last renewed "
                f"{max(0.0, now - self.renewed):.0f} s ago by its clock")


@dataclass(frozen=True)
class Seen:
    """One look at a tier's lease: its newest generation, that object's bytes, and what they say."""

    generation: int
    raw: bytes
    holder: Holder | None  # None: unreadable
    problem: str | None = None

    def describe(self, now: float) -> str:
        return self.holder.describe(now) if self.holder else f"an unreadable lease, generation {self.generation} ({self.problem})"


def newest_generation(store: Store) -> int:
    """The newest generation of the tier's lease (0: never leased), from one listing."""
    newest = 0
    for key in store.list(LEASE_PREFIX):
        m = _GEN_NAME.fullmatch(key[len(LEASE_PREFIX):])
        if m:
            newest = max(newest, int(m.group(1)))
    if newest > MAX_GENERATION:
        raise FormatError(f"{where(store, LEASE_PREFIX)} has generation {newest}, beyond any real lease: it is corrupt or "
                          f"hostile; remove the directory {LEASE_PREFIX} (no tierio run is writing the tier then)")
    return newest


def look(store: Store) -> Seen | None:
    """The newest generation of the lease and what it says; None when the tier was never leased."""
    for _ in range(8):
        g = newest_generation(store)
        if g == 0:
            return None
        key = generation_key(g)
        try:
            raw = read_small(store, key, MAX_LEASE_BYTES)
        except NotFoundError:
            continue  # cleaned up by a newer holder between the listing and the read
        except IntegrityError:
            # Shorter than it said while being read: the holder's renewal was rewriting it (an S3
            # server may show a replaced object empty for a moment). Read it again.
            time.sleep(0.05)
            continue
        except FormatError as exc:
            return Seen(g, b"", None, str(exc))
        try:
            return Seen(g, raw, Holder.parse(raw, where(store, key), g))
        except FormatError as exc:
            return Seen(g, raw, None, str(exc))
    raise StorageError(f"{where(store, LEASE_PREFIX)} kept changing while it was read; is something deleting lease files?")


def read_lease(store: Store) -> Holder | None:
    """The tier's current holder; None when the tier is free (never leased, released or broken).
    An unreadable newest generation is a FormatError."""
    seen = look(store)
    if seen is None:
        return None
    if seen.holder is None:
        raise FormatError(f"{where(store, generation_key(seen.generation))}: {seen.problem}")
    return seen.holder if seen.holder.state == "held" else None


_probed: set[str] = set()
_probe_lock = threading.Lock()


def check_conditions(store: Store) -> None:
    """Refuse a store whose create-if-absent is not exclusive: there two takers would both win."""
    with _probe_lock:
        if store.url in _probed:
            return
    key = f"{LEASE_PREFIX}probe-{new_run_id()}"
    try:
        first = store.create_exclusive(key, b"1")
        second = store.create_exclusive(key, b"2")
    finally:
        try:
            store.delete(key)
        except StorageError:
            pass
    if not first or second:
        raise LeaseError(
            f"{store.url} does not honour create-if-absent (If-None-Match: * on S3): creating one object twice "
            f"{'succeeded both times' if second else 'failed the first time'}. Two jobs could then both take its lease; "
            "use a server that honours conditional writes (AWS S3, SeaweedFS, MinIO) for checkpoint tiers")
    with _probe_lock:
        _probed.add(store.url)


def _refusal(store: Store, seen: Seen, why: str) -> LeaseError:
    return LeaseError(
        f"{store.url} is leased by another writer: {seen.describe(time.time())}; {why}. Two managers writing one "
        f"tier corrupt it; wait for that run to finish, point this run at another tier, or - only if that run is "
        f"gone - break the lease with 'tierio ckpt unlock {store.url}' or CheckpointManager(..., break_lease=True)"
    )


def watch(store: Store, seen: Seen, timing: LeaseTiming, deadline_s: float) -> Seen | None:
    """Watch the newest generation for ``deadline_s`` on this process's monotonic clock: None when
    it stayed exactly as ``seen`` throughout (its holder stopped renewing), else what it became."""
    log.warning("%s is leased by %s; watching it for up to %.0f s: a holder that renews is alive, one that "
                "does not has stopped writing", store.url, seen.describe(time.time()), deadline_s)
    end = time.monotonic() + deadline_s
    step = min(1.0, timing.heartbeat / 4)
    while time.monotonic() < end:
        time.sleep(min(step, max(0.0, end - time.monotonic())))
        now = look(store)
        if now is None or now.generation != seen.generation or now.raw != seen.raw:
            return now if now is not None else Seen(0, b"", None, "removed")
    return None


def _take(store: Store, me: Holder, after: int) -> Holder | None:
    """Create generation ``after + 1`` for ``me``; None when another contender created it first."""
    now = time.time()
    mine = replace(me, generation=after + 1, state="held", acquired=now, renewed=now, beat=0)
    if not store.create_exclusive(generation_key(mine.generation), mine.encode()):
        return None
    _forget_older(store, after)
    return mine


def _forget_older(store: Store, keep_from: int) -> None:
    """Remove generations before ``keep_from`` (the one just superseded stays, as the record of
    whom the lease came from). Only ever called by the creator of a newer generation."""
    for key in store.list(LEASE_PREFIX):
        m = _GEN_NAME.fullmatch(key[len(LEASE_PREFIX):])
        if m and int(m.group(1)) < keep_from:
            try:
                store.delete(key)
            except StorageError as exc:
                log.debug("could not remove the old lease generation %s: %s", key, exc)


def acquire(store: Store, me: Holder, *, force: bool = False, timing: LeaseTiming | None = None,
            proven_free: str | None = None) -> Holder:
    """Take the lease of ``store`` for ``me``; returns ``me`` with its generation.

    ``proven_free`` says why the current holder cannot be writing any more (a free node lock)."""
    timing = timing or LeaseTiming.default()
    check_conditions(store)
    for _ in range(16):
        seen = look(store)
        if seen is None:
            got = _take(store, me, 0)
        else:
            h = seen.holder
            why = ("it is free" if h is not None and h.state != "held" else
                   "it is this run's own (a restarted leader)" if h is not None and h.run == me.run else
                   "break_lease was requested" if force else
                   proven_free or (h.hint(time.time(), timing) if h is not None and h.dead() else None))
            if why is None:
                after = watch(store, seen, timing, timing.expires)
                if after is not None and after.generation == seen.generation:
                    raise _refusal(store, after, "it renewed its lease while this run watched it, so it is alive")
                if after is not None:
                    continue  # someone else took it or released it meanwhile: look again
                why = f"it stayed unchanged for {timing.expires:.0f} s on this node's clock"
            if h is not None and h.state == "held" and h.run != me.run:
                log.warning("taking over the lease on %s from %s: %s", store.url, seen.describe(time.time()), why)
            got = _take(store, me, seen.generation)
        if got is not None:
            return got
        after = look(store)
        if (after.generation if after else 0) == (seen.generation if seen else 0):
            # The name is taken, yet no newer lease is listed: not a regular file, so not a lease.
            key = generation_key((seen.generation if seen else 0) + 1)
            raise LeaseError(f"{where(store, key)} is not a lease (a link or a special file planted there?); "
                             "tierio neither follows nor removes it: remove it by hand, then retry")
        proven_free = None  # a fresh holder won the race: it is not the one that was proven gone
    raise LeaseError(f"could not take the lease on {store.url}: other writers keep taking it; is another job "
                     "starting on this tier?")


def renew(store: Store, me: Holder) -> tuple[Holder, str | None]:
    """Rewrite this holder's own generation with the next beat; the holder, and who holds the tier
    now when a newer generation exists (then nothing was written)."""
    g = newest_generation(store)
    if g != me.generation:
        seen = look(store)
        return me, "nobody (the lease was removed)" if seen is None else seen.describe(time.time())
    mine = replace(me, renewed=time.time(), beat=me.beat + 1)
    store.put_buffers(generation_key(me.generation), [mine.encode()])
    return mine, None


def release(store: Store, me: Holder, state: str = "released") -> bool:
    """End ``me``'s lease by creating the next generation, free to take (only if ``me`` still holds
    it: a superseded holder changes nothing)."""
    if newest_generation(store) != me.generation:
        return False
    freed = replace(me, generation=me.generation + 1, state=state, renewed=time.time())
    if not store.create_exclusive(generation_key(freed.generation), freed.encode()):
        return False
    _forget_older(store, me.generation)
    return True


def unlock(store: Store, *, force: bool = False, timing: LeaseTiming | None = None) -> Holder | None:
    """Break the lease of ``store`` when its holder is gone: provably dead, or unchanged for
    ``timing.expires`` s while this call watches (at once with ``force``). Returns the holder removed."""
    timing = timing or LeaseTiming.default()
    check_conditions(store)
    seen = look(store)
    if seen is None or (seen.holder is not None and seen.holder.state != "held"):
        return None
    h = seen.holder
    if not force and not (h is not None and h.dead()):
        after = watch(store, seen, timing, timing.expires)
        if after is not None:
            raise LeaseError(
                f"the lease on {store.url} looks alive: {after.describe(time.time())} changed while this command "
                f"watched it; stop that run first, or pass --force if you know it is gone")
    breaker = replace(Holder.mine(f"unlock-{new_run_id()}", 1), generation=seen.generation)
    if not release(store, breaker, "broken"):
        raise LeaseError(f"the lease on {store.url} changed while it was being broken; look again (tierio ckpt ls)")
    return h or Holder("unreadable", "?", "", 0, 1, seen.generation)


@contextmanager
def tool_lease(store: Store, *, force: bool = False) -> Iterator[Holder]:
    """The lease of ``store`` for a one-off writer (``tierio ckpt gc``, ``promote``), held while it runs.
    A tool never waits out another writer's lease: a holder that is not provably gone is refused."""
    me = Holder.mine(f"tool-{new_run_id()}", 1)
    seen = look(store)
    if seen is not None and seen.holder is not None and seen.holder.state == "held" and not force \
            and not seen.holder.dead():
        raise _refusal(store, seen, "this tool does not wait for a live-looking lease")
    if seen is not None and seen.holder is None and not force:
        raise _refusal(store, seen, "its lease is unreadable; 'tierio ckpt unlock' breaks it once its holder is gone")
    held = acquire(store, me, force=force)
    try:
        yield held
    finally:
        release(store, held)
