"""The leases one CheckpointManager holds on its tiers (``TierLeases``): taken before the first
write, renewed by one thread, checked by every commit and retention pass. The protocol itself
(generations, take-over, self-fencing) is ``ckpt.steps.lease``."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

from tierio.errors import ConfigError, FormatError, LeaseError, StorageError
from tierio.storage.base import Store

from tierio.ckpt.steps.lease import NODE_LOCK, Holder, LeaseTiming, Seen, acquire, look, newest_generation, release, renew

log = logging.getLogger("tierio.ckpt")


def lock_node_tier(root: str) -> int | None:
    """flock the node-local tier's lock file for this process's life: the descriptor, or None when
    another live process on this node holds it."""
    from tierio.io.paths import open_dir_beneath

    dfd = open_dir_beneath(root, [], create=True)
    try:
        fd = os.open(NODE_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                     0o644, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class TierLeases:
    """The leases one manager holds (a tier's leader) or has checked (the other ranks), their
    renewal thread, and the fence every commit and every retention pass goes through."""

    def __init__(self, run: str | None, rank: int, world_size: int, *, force: bool = False,
                 wait_timeout: float = 600.0, timing: LeaseTiming | None = None) -> None:
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.force = force
        self.wait_timeout = wait_timeout
        self.timing = (timing or LeaseTiming.default()).checked()
        self._ok: dict[str, Store] = {}  # url -> store: held (its leader) or checked (other ranks)
        self._mine: dict[str, Holder] = {}  # url -> this rank's generation there (held tiers)
        self._renewed: dict[str, float] = {}  # url -> monotonic time of the last successful renewal
        self._locks: dict[str, int] = {}  # url -> flocked node-tier lock file
        self._lost: dict[str, str] = {}  # url -> why this run no longer writes there
        self._lock = threading.Lock()
        self._taking: dict[str, threading.Lock] = {}  # url -> held while one thread takes or joins its lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure(self, store: Store, leader: bool | None = None, node_local: bool = False) -> None:
        """Before writing to ``store``: hold its lease (its leader) or check that it names this run
        (the other ranks). Raises LeaseError once this run lost the tier or could not renew in time."""
        leader = self.rank == 0 if leader is None else leader
        with self._lock:
            if store.url in self._ok:
                self._check_locked(store.url)
                return
            taking = self._taking.setdefault(store.url, threading.Lock())
        # One thread at a time per tier: a persist and a promotion thread both writing first would
        # otherwise both take the lease, the second taking it over from the first (same run id),
        # and the first's commits would then be fenced off as if another run held the tier.
        with taking:
            with self._lock:
                if store.url in self._ok:
                    self._check_locked(store.url)
                    return
            self._take(store, leader, node_local)

    def _take(self, store: Store, leader: bool, node_local: bool) -> None:
        if self.run is None:
            # A guess (any live lease of a job of this size) could join another job's lease.
            raise ConfigError(
                f"rank {self.rank} of {self.world_size} has no process group to agree on a run id with, so it cannot "
                f"tell its job's lease of {store.url} from another job's; pass the same run_id= to every rank (e.g. the "
                "scheduler's job id), or initialise torch.distributed before the CheckpointManager")
        if not leader:
            self._join(store)
            with self._lock:
                self._ok[store.url] = store
            return
        proven = None
        if node_local and hasattr(store, "root"):
            fd = lock_node_tier(str(store.root))
            if fd is None:
                raise LeaseError(f"another process on this node holds {store.url} (its {NODE_LOCK} is locked): "
                                 f"{self._who(store)}; two jobs must not share a node-local tier")
            with self._lock:
                self._locks[store.url] = fd
            proven = f"its {NODE_LOCK} was free, so no process on this node holds it"
        held = acquire(store, Holder.mine(self.run, self.world_size), force=self.force, timing=self.timing,
                       proven_free=proven)
        started = time.monotonic()  # the self-fence counts from a renewal, not from before a watch
        held, other = renew(store, held)
        if other is not None:
            raise LeaseError(f"the lease on {store.url} was taken over right after this run took it; it is now held "
                             f"by {other}; is another job starting on this tier?")
        with self._lock:
            self._mine[store.url] = held
            self._renewed[store.url] = started
            self._ok[store.url] = store
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="tierio-ckpt-lease", daemon=True)
                self._thread.start()

    @staticmethod
    def _who(store: Store) -> str:
        try:
            seen = look(store)
        except (StorageError, FormatError) as exc:
            return f"its lease could not be read ({exc})"
        return "its lease: " + (seen.describe(time.time()) if seen else "none")

    def _check_locked(self, url: str) -> None:
        lost = self._lost.get(url)
        if lost is not None:
            raise LeaseError(f"this run no longer writes {url}: {lost}")
        last = self._renewed.get(url)
        if last is not None and time.monotonic() - last > self.timing.expires - self.timing.margin:
            why = (f"its lease has not been renewed for {time.monotonic() - last:.0f} s (the store did not answer); "
                   f"another run may take the tier over after {self.timing.expires:.0f} s, so this run stopped "
                   "writing there (self-fenced). Restart the job once the store is reachable")
            self._lost[url] = why
            raise LeaseError(f"this run no longer writes {url}: {why}")

    def fence(self, store: Store) -> int:
        """Right before a commit or a retention pass on ``store`` by its leader: the generation this
        run holds there, once one listing shows it is still the newest; LeaseError otherwise."""
        with self._lock:
            self._check_locked(store.url)
            mine = self._mine.get(store.url)
        if mine is None:
            return 0  # not this rank's to lead: it writes only what its leader commits
        newest = newest_generation(store)
        if newest != mine.generation:
            why = (f"its lease was taken over (this run holds generation {mine.generation}, the tier is at "
                   f"{newest}: {self._who(store)})")
            with self._lock:
                self._lost[store.url] = why
            raise LeaseError(f"this run no longer writes {store.url}: {why}; nothing it commits there now counts")
        with self._lock:
            self._check_locked(store.url)  # the listing may have taken long
        return mine.generation

    def status(self) -> dict[str, str]:
        """Per tier url: "held" (its leader), "joined" (other ranks) or why this run lost it."""
        with self._lock:
            out = {url: ("held" if url in self._mine else "joined") for url in self._ok}
            out.update({url: f"lost: {why}" for url, why in self._lost.items()})
            return out

    def _join(self, store: Store) -> None:
        """A rank that does not lead the tier waits for its leader's lease naming this run."""
        deadline = time.monotonic() + self.wait_timeout
        seen: Seen | None = None
        while time.monotonic() < deadline:
            try:
                seen = look(store)
            except (StorageError, FormatError):
                seen = None
            if seen is not None and seen.holder is not None and seen.holder.state == "held" \
                    and seen.holder.run == self.run:
                return
            time.sleep(0.05)
        raise LeaseError(
            f"rank {self.rank} waited {self.wait_timeout:.0f} s for its leader to lease {store.url} for run "
            f"{self.run}, but " + (f"it is leased by {seen.describe(time.time())}" if seen else "nobody leased it")
            + "; did the leader fail, or is another job using this tier?"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.timing.heartbeat):
            with self._lock:
                todo = [(self._ok[url], h) for url, h in self._mine.items() if url not in self._lost]
            for store, me in todo:
                if self._stop.is_set():
                    return
                started = time.monotonic()  # the self-fence counts from before the write could land
                try:
                    mine, other = renew(store, me)
                except Exception as exc:  # any failure is a missed beat; the fence counts the time
                    log.warning("could not renew the lease on %s: %s", store.url, exc)
                    continue
                with self._lock:
                    if other is not None:
                        log.error("the lease on %s was taken over; it is now held by %s", store.url, other)
                        self._lost[store.url] = f"its lease was taken over; it is now held by {other}"
                    else:
                        self._mine[store.url] = mine
                        self._renewed[store.url] = started

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # a renewal in flight must not rewrite a lease after its release
        with self._lock:
            held = [(self._ok[url], h) for url, h in self._mine.items() if url not in self._lost]
            locks = list(self._locks.values())
            self._ok.clear()
            self._mine.clear()
            self._locks.clear()
        for store, me in held:
            try:
                release(store, me)
            except StorageError as exc:
                log.warning("could not release the lease on %s (it expires by itself): %s", store.url, exc)
        for fd in locks:
            os.close(fd)  # after the release: a successor on this node finds the lease free, not just the lock
