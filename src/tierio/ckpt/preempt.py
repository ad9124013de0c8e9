"""Preemption: a scheduler's signal becomes one emergency save, durable before the process exits.

SLURM sends SIGTERM (or, with ``--signal=USR1@120``, SIGUSR1 two minutes ahead) before it kills a
job; torchelastic sends SIGTERM on scale-down. Without a handler everything since the last
periodic save is lost. With one:

    with CheckpointManager(tiers) as mgr, Preemption(mgr) as preempt:
        for step in range(start, steps):
            train_step()
            if preempt.requested(step):
                preempt.save(step, state)   # durable on the fastest tier, then the process exits

* The **signal handler** only notes the signal: no I/O and no collective runs in it.
* **One step for every rank.** At each step boundary (``requested``) a rank that has seen a signal
  proposes the next step on the process group's TCPStore (``compare_set``: the first proposal
  wins); every rank reads the key there (one ``check`` a step, no collective, nothing on a
  background thread). Ranks of a data-parallel job are at most one step apart (each step holds a
  collective), so a proposal of ``step + 1`` reaches every rank before it passes that step.
  Without a process group the step is the current one.
* **The emergency save** is an ordinary save of that step to the manager's tiers (its manifest
  records ``reason="emergency: SIGTERM"``; ``tierio ckpt ls`` shows it), waited for until it is
  durable (``durable``), within ``grace_seconds``, the scheduler's grace period. On a shared tier 0
  that is its commit there. On a node-local tier 0 it is every rank's part persisted on its node's
  tier 0: each rank, once its own part is there, adds one to a counter of the step on the TCPStore
  and waits (in the caller's thread) until the counter reaches the world size. The copy to the
  shared tier is not waited for: a requeued job on the same nodes restores the step from the
  nodes' tier 0 and publishes it (``ckpt.promotion.buddy_restore``). Promotion to slower tiers is
  held from the emergency save's start (no new copy competes with it for the disks or the network;
  a shared tier 0 too) and left to the next run (its manager finds unpromoted steps), or resumed
  when ``exit_code=None`` lets the process go on. Then the process exits with
  ``exit_code`` (143, as SIGTERM's default would; ``requeue=True`` also asks SLURM to requeue the
  job from rank 0).
* **A second signal** during the emergency save ends the process at once: the step being written is
  not committed, and the previous durable step still restores.

A signal that arrives while an earlier save is in flight leaves that save to complete or fail as
any save does (a step is committed whole or not listed); the emergency save comes after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

from tierio.errors import ConfigError
from tierio.options import Options
from tierio.stats import Stats

from tierio.ckpt.manager import CheckpointManager
from tierio.ckpt.saving.job import SaveHandle

@dataclass(frozen=True)
class PreemptOptions(Options):
    """``signals``: the names of the signals a scheduler sends; ``grace_seconds``: how long the
    emergency save may take to be durable (the scheduler's grace period less a margin);
    ``exit_code``: the process's exit once it is (None: ``save`` returns instead); ``requeue``:
    rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` before exiting, where SLURM runs the job."""

    LABEL: ClassVar[str | None] = "Preemption"

    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    grace_seconds: float = 60.0
    exit_code: int | None = 143
    requeue: bool = False


@dataclass
class PreemptStats(Stats):
    """When the signal came, which step was saved for it, and the seconds from the signal to durable."""

    signal: str | None = None
    step: int | None = None
    signal_to_durable_seconds: float | None = None


class Preemption:
    """Signal handlers for a CheckpointManager's job (see the module docstring). Install it in the
    main thread, after the process group exists; ``close()`` (or the ``with`` block) puts the
    previous handlers back."""

    def __init__(self, manager: CheckpointManager, options: PreemptOptions | None = None, **overrides: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("Preemption installs signal handlers: create it in the main thread")
        self.manager = manager
        self.options = opts = PreemptOptions.resolve(options, overrides)
        names = [opts.signals] if isinstance(opts.signals, str) else list(opts.signals)
        unknown = [n for n in names if not isinstance(getattr(signal, str(n), None), signal.Signals)]
        if unknown or not names:
            raise ConfigError(f"Preemption(signals=...) takes signal names such as 'SIGTERM' or 'SIGUSR1'; got {unknown or names}")
        self.stats = PreemptStats()
        self._seen: float | None = None  # time.monotonic() of the first signal
        self._saving = False
        self._agreed: int | None = None
        self._cause: str | None = None  # the signal behind the agreed step (another rank's, maybe)
        self._store, self._key = _store_and_key(manager)
        self._previous = {signal.Signals[n]: signal.signal(signal.Signals[n], self._on_signal) for n in names}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._saving:  # a second signal while the emergency save runs: leave now, nothing half-listed
            print(f"tierio: {name} again during the emergency save: exiting at once; the previous durable step "
                  "restores", file=sys.stderr, flush=True)
            os._exit(self.options.exit_code if self.options.exit_code is not None else 128 + signum)
        if self._seen is None:
            self._seen, self.stats.signal = time.monotonic(), name

    @property
    def signalled(self) -> bool:
        return self._seen is not None

    def requested(self, step: int) -> bool:
        """At a step boundary, after ``step``: whether this is the step every rank saves at."""
        if self._agreed is None:
            if self._store is None:
                self._agreed = step if self._seen is not None else None
                self._cause = self.stats.signal
            elif self._seen is not None:
                self._agree(self._store.compare_set(self._key, "", f"{step + 1} {self.stats.signal}"))
            elif self._store.check([self._key]):
                self._agree(self._store.get(self._key))
        if self._agreed is not None and step > self._agreed:
            print(f"tierio: step {step} is past the agreed step {self._agreed}; saving this one", file=sys.stderr,
                  flush=True)
            return True
        return self._agreed == step

    def _agree(self, proposal: bytes | str) -> None:
        """The winning proposal on the store: the step, and the signal of the rank that proposed it."""
        text = proposal.decode() if isinstance(proposal, bytes) else proposal
        step, _, cause = text.partition(" ")
        self._agreed, self._cause = int(step), cause or None

    @property
    def reason(self) -> str:
        """What the emergency save's manifest records (``"emergency: SIGTERM"``): the signal of the
        rank whose proposal won, which may be another rank's."""
        return f"emergency: {self._cause or self.stats.signal or 'requested'}"

    def save(self, step: int, state: Any) -> SaveHandle:
        """The emergency save of ``step``: waits until it is durable (within ``grace_seconds`` of the
        signal), then exits the process with ``exit_code`` (returns the handle when that is None)."""
        self.begin(step)
        if self._counted:  # durable without promotion: it waits until the process goes on or a next run
            self.manager.hold_promotion()
        handle = self.manager.save(step, state, reason=self.reason)
        self.finish(step, self.durable(handle))
        return handle

    def durable(self, handle: SaveHandle) -> Future[Any]:
        """What an emergency save waits for: its commit on a shared tier 0; on a node-local tier 0,
        this rank's part persisted there (``finish`` then waits for every rank's, on the TCPStore).
        Without a process group to count on, node-local saves wait for the global commit."""
        return handle.persisted if self._counted else handle.committed

    @property
    def _counted(self) -> bool:
        """A node-local tier 0 whose emergency save is durable once every rank's part is persisted
        (counted on the TCPStore, or by the one rank): nothing the promotion thread does is waited
        for. Without a store, many ranks wait for the global commit, which promotion makes."""
        m = self.manager
        return m.node_local and (m.world_size == 1 or self._store is not None)

    def begin(self, step: int) -> None:
        """The emergency save of ``step`` starts: from now on a second signal exits at once.
        A framework adapter calls this, has the framework save through its tierio manager with
        ``reason=self.reason``, then calls :meth:`finish`."""
        self._saving = True
        if not self.manager.node_local:  # a shared tier 0 commits in the save itself, not in promotion
            self.manager.hold_promotion()  # released in finish(), or left to the next run at exit
        print(f"tierio: emergency save of step {step} ({self.stats.signal or 'requested'})", file=sys.stderr, flush=True)

    def finish(self, step: int, *durable: Future[Any]) -> None:
        """Wait until every future in ``durable`` is done (``durable(handle)``; for a framework, also
        the pointer it publishes) and then until every rank's are (counted on the TCPStore), within
        ``grace_seconds`` of the signal; then exit with ``exit_code`` (return when that is None).
        A failed save raises its error."""
        opts, started = self.options, self._seen if self._seen is not None else time.monotonic()

        def left() -> float:
            return max(0.0, opts.grace_seconds - (time.monotonic() - started))
        try:
            self._wait_durable(step, started, left, *durable)
        finally:  # reached only when the process goes on (exit_code=None): promotion resumes
            self.manager.hold_promotion(False)

    def _wait_durable(self, step: int, started: float, left: Callable[[], float], *durable: Future[Any]) -> None:
        opts = self.options
        try:
            for future in durable:
                future.result(left())
            if self._store is not None:
                self._every_rank(step, left)
        except TimeoutError:
            print(f"tierio: step {step} was not durable within grace_seconds={opts.grace_seconds:g} of the signal; "
                  "exiting; the previous durable step restores (raise grace_seconds, up to the scheduler's grace "
                  "period)", file=sys.stderr, flush=True)
            if opts.exit_code is None:
                raise
            os._exit(opts.exit_code)
        self.stats.step, self.stats.signal_to_durable_seconds = step, time.monotonic() - started
        where = "every rank's part on its node's tier 0" if self.manager.node_local else "committed"
        print(f"tierio: step {step} durable in {self.stats.signal_to_durable_seconds:.3f} s after "
              f"{self.stats.signal or 'request'} ({where})", file=sys.stderr, flush=True)
        self._saving = False
        if opts.exit_code is None:
            return
        if opts.requeue and self.manager.rank == 0 and os.environ.get("SLURM_JOB_ID"):
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False, timeout=30)
        sys.stdout.flush()
        sys.stderr.flush()
        # The step is durable: exit now, within the grace period. Promotion to slower tiers resumes
        # in the next run; the leases lapse (or are taken over by the requeued run of the same id).
        os._exit(opts.exit_code)

    def _every_rank(self, step: int, left: Callable[[], float]) -> None:
        """This rank's part of ``step`` is done (durable; for a framework, published): count it on the
        TCPStore, then wait until every rank's is (TimeoutError when ``left()`` runs out first).
        On a node-local tier 0 that count is what makes the step durable; on any tier it keeps a
        rank from exiting early, since a launcher such as torchrun stops the other ranks at the
        first exit, cutting short what rank 0 still publishes. Global rank 0 may host the store
        (``init_process_group`` without torchrun): it leaves last, once every rank has seen the
        count, so no rank waits on a store that is gone."""
        import torch.distributed as dist

        key, world = f"{self._key}/done/{step}", self.manager.world_size
        try:
            self._count_to(key, world, left, self._store.add(key, 1))
            seen = self._store.add(f"{key}/seen", 1)
            if dist.get_rank() == 0:
                try:
                    self._count_to(f"{key}/seen", world, left, seen)
                except TimeoutError:
                    pass  # every part is done: only the others' exit was not seen
        except RuntimeError as exc:  # the store is gone (its host exited): nobody can count any more
            raise TimeoutError(f"the TCPStore stopped answering while counting the parts of step {step}: {exc}") from exc

    def _count_to(self, key: str, n: int, left: Callable[[], float], count: int) -> None:
        """Poll the counter ``key`` on the store until it reaches ``n`` (TimeoutError after ``left()``)."""
        delay = 0.002
        while count < n:
            if left() <= 0:
                raise TimeoutError(f"{n - count} of {n} ranks have not finished their part")
            time.sleep(min(delay, left()))
            delay = min(delay * 1.5, 0.05)
            count = self._store.add(key, 0)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _store_and_key(manager: CheckpointManager) -> tuple[Any, str]:
    """The process group's TCPStore (None without a group) and this run's key on it."""
    if manager.world_size == 1:
        return None, ""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()):
        return None, ""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the rendezvous store outlives a restart
    return distributed_c10d._get_default_store(), f"tierio/preempt/{manager.run_id}/{restart}"


__all__ = ["PreemptOptions", "PreemptStats", "Preemption"]
