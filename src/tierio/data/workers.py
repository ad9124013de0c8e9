"""Worker processes for whole batches that hand the loop slot numbers through a pipe each.

A ``torch.utils.data.DataLoader`` with workers spends about 0.2 ms of its own per batch, whatever
the batch holds: an index sent to the worker, the result pickled by a feeder thread and polled
for with a timeout in the loop. Taking a batch of 64 samples from a mapped shard costs less than
that in one process, so with it workers made streaming slower. ``BatchWorkers`` keeps the
DataLoader's contract and drops the machinery between:

* worker ``w`` of ``k`` iterates the dataset knowing it is ``w`` of ``k`` (``current_worker``), so
  it produces the batches ``w, w+k, ...``; the loop receives them round-robin (skipping workers
  that have finished), so the order is the same for any number of workers;
* each worker writes a batch's fixed-size fields into its next FieldRing slot (allocated once,
  before the workers start) and sends a small message naming the slot over its own pipe;
* a semaphore per worker bounds the batches it has in flight (``prefetch``), as the DataLoader's
  ``prefetch_factor`` does, and the workers persist across epochs (``persistent``).

Each ``iter()`` is one epoch, numbered: starting a new one while workers are still on the previous
one (the loop stopped early) tells them to move on, and whatever they had already sent of the old
one is dropped (its slots freed). A worker's exception is raised in the loop (the same type when
it can be pickled); a worker that dies is named in a ``WorkerError``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from tierio.data.ring import FieldRing, RingBatch
from tierio.errors import TierioError

POLL_S = 0.1  # how often a worker waiting for room looks for a command or a dead parent


class WorkerError(TierioError):
    """A batch worker process died, or failed with an error that could not be sent back."""


@dataclass(frozen=True)
class WorkerIdentity:
    """Which worker this process is: ``id`` of ``count``, started by ``parent`` (a pid)."""

    id: int
    count: int
    parent: int


_identity: WorkerIdentity | None = None  # set in a BatchWorkers worker process


def current_worker() -> tuple[int, int] | None:
    """(worker id, number of workers) in a BatchWorkers or DataLoader worker, None in the loop."""
    if _identity is not None:
        return _identity.id, _identity.count
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return None
    info = get_worker_info()
    return None if info is None else (info.id, info.num_workers)


@dataclass(frozen=True)
class WorkerOptions:
    """How BatchWorkers runs: ``num_workers`` processes, each with up to ``prefetch`` batches sent and
    not yet taken by the loop; ``persistent`` keeps them across epochs; ``timeout`` (seconds, 0 =
    none) bounds the wait for one batch; ``init_fn(worker_id)`` runs first in each worker;
    ``context`` is a multiprocessing context or start method name (default: the platform's)."""

    num_workers: int
    prefetch: int = 4
    persistent: bool = True
    timeout: float = 0.0
    init_fn: Callable[[int], None] | None = None
    context: Any = None


# -- messages (small: the batch's fixed-size fields travel in the ring) ---------------------------
@dataclass(frozen=True)
class _Start:
    epoch: int


@dataclass(frozen=True)
class _Stop:
    pass


# worker -> loop: a fixed header (epoch, kind, slot, rows), then a pickled payload for the rare kinds
_HEADER = struct.Struct("<qBii")
_SLOT, _WHOLE, _DONE, _FAILED = 1, 2, 3, 4


@dataclass(frozen=True)
class _Message:
    """A worker's message as the loop reads it."""

    epoch: int
    kind: int
    item: Any = None  # the batch: a RingBatch, or the batch itself when no slot was free
    error: BaseException | None = None
    text: str = ""


def _encode_batch(epoch: int, item: Any) -> bytes:
    if isinstance(item, RingBatch) and not item.rest:  # the usual case: two numbers, no pickle
        return _HEADER.pack(epoch, _SLOT, item.slot, item.rows)
    return _HEADER.pack(epoch, _WHOLE, 0, 0) + pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(raw: bytes) -> _Message:
    epoch, kind, slot, rows = _HEADER.unpack_from(raw)
    if kind == _SLOT:
        return _Message(epoch, kind, RingBatch(slot, rows))
    if kind == _WHOLE:
        return _Message(epoch, kind, pickle.loads(raw[_HEADER.size:]))
    if kind == _FAILED:
        error, text = pickle.loads(raw[_HEADER.size:])
        return _Message(epoch, kind, error=error, text=text)
    return _Message(epoch, kind)


@dataclass
class _Channel:
    """The loop's ends of one worker: its process, its commands, its results and its credits."""

    process: Any
    commands: Connection
    results: Connection
    credits: Any


class BatchWorkers:
    """Iterate ``source`` (an iterable dataset of whole batches, e.g. ``StreamingDataset.batched()``)
    in worker processes; yields the items it yields, in the order one process would."""

    def __init__(self, source: Iterable[Any], ring: FieldRing | None, options: WorkerOptions) -> None:
        self.source = source
        self.ring = ring
        self.options = options
        self._channels: list[_Channel] = []
        self._epoch = 0
        self._finalizer: weakref.finalize | None = None

    @property
    def started(self) -> bool:
        return bool(self._channels)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (empty before the first ``iter()``)."""
        return [ch.process.pid for ch in self._channels]

    def _start(self) -> None:
        o = self.options
        ctx = o.context if not isinstance(o.context, (str, type(None))) else multiprocessing.get_context(o.context)
        parent = os.getpid()
        for w in range(o.num_workers):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            res_recv, res_send = ctx.Pipe(duplex=False)
            credits = ctx.Semaphore(o.prefetch)
            p = ctx.Process(target=_worker_main, name=f"tierio-batch-worker-{w}", daemon=True,
                            args=(self.source, WorkerIdentity(w, o.num_workers, parent), cmd_recv, res_send, credits,
                                  o.init_fn))
            p.start()
            cmd_recv.close()
            res_send.close()
            self._channels.append(_Channel(p, cmd_send, res_recv, credits))
        self._finalizer = weakref.finalize(self, _shutdown, self._channels)

    def shutdown(self) -> None:
        """Stop the workers (the next ``iter()`` starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
        self._channels = []
        self._finalizer = None

    def __iter__(self) -> Iterator[Any]:
        if not self.started:
            self._start()
        self._epoch += 1
        epoch = self._epoch
        for w, ch in enumerate(self._channels):
            try:
                ch.commands.send(_Start(epoch))
            except OSError:
                raise WorkerError(f"batch worker {w} (pid {ch.process.pid}) died (exit code {ch.process.exitcode}) "
                                  "between epochs; build the loader again") from None
        live = list(range(len(self._channels)))
        at = 0
        try:
            while live:
                msg = self._receive(live[at], epoch)
                if msg.kind == _DONE:
                    live.pop(at)
                    at = at % len(live) if live else 0
                    continue
                at = (at + 1) % len(live)
                yield msg.item
        finally:
            if not self.options.persistent:
                self.shutdown()

    def _receive(self, w: int, epoch: int) -> _Message:
        """Worker ``w``'s next message of ``epoch`` (older epochs' are dropped)."""
        ch = self._channels[w]
        timeout = self.options.timeout or None
        while True:
            if not ch.results.poll():
                ready = wait([ch.results, ch.process.sentinel], timeout)
                if not ready:
                    raise WorkerError(f"batch worker {w} (pid {ch.process.pid}) sent nothing for {timeout} s; "
                                      "raise the loader's timeout or look for what blocks the worker")
                if ch.results not in ready and not ch.results.poll():
                    raise WorkerError(f"batch worker {w} (pid {ch.process.pid}) died (exit code "
                                      f"{ch.process.exitcode}); it may have run out of memory or been killed")
            try:
                msg = _decode(ch.results.recv_bytes())
            except EOFError:  # the pipe closes when the worker dies: the same error as its sentinel's
                ch.process.join(POLL_S)
                raise WorkerError(f"batch worker {w} (pid {ch.process.pid}) died (exit code {ch.process.exitcode}) "
                                  "and closed its pipe; it may have run out of memory or been killed") from None
            ch.credits.release()
            if msg.epoch != epoch:
                self._drop(msg)
            elif msg.kind == _FAILED:
                if msg.error is not None:
                    raise msg.error
                raise WorkerError(f"batch worker {w} failed:\n{msg.text}")
            else:
                return msg

    def _drop(self, msg: _Message) -> None:
        if isinstance(msg.item, RingBatch) and self.ring is not None:
            self.ring.release(msg.item.slot)


def _shutdown(channels: list[_Channel]) -> None:
    for ch in channels:
        try:
            ch.commands.send(_Stop())
        except (OSError, ValueError):
            pass  # already gone
    for ch in channels:
        ch.process.join(timeout=5)
        if ch.process.is_alive():
            ch.process.terminate()
            ch.process.join(timeout=5)
        ch.commands.close()
        ch.results.close()


# -- the worker side ------------------------------------------------------------------------------
def _worker_main(source: Iterable[Any], me: WorkerIdentity, commands: Connection, results: Connection,
                 credits: Any, init_fn: Callable[[int], None] | None) -> None:
    global _identity
    _identity = me
    try:
        import torch

        torch.set_num_threads(1)  # as DataLoader workers: the processes share the cores
    except ImportError:  # pragma: no cover
        pass
    try:
        if init_fn is not None:
            init_fn(me.id)
        cmd = commands.recv()
        while isinstance(cmd, _Start):
            cmd = _run_epoch(source, cmd.epoch, me, commands, results, credits)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the loop went away


def _run_epoch(source: Iterable[Any], epoch: int, me: WorkerIdentity, commands: Connection, results: Connection,
               credits: Any) -> Any:
    """Send this worker's batches of one epoch; returns the next command."""
    it = iter(source)
    try:
        while True:
            while not credits.acquire(timeout=POLL_S):
                if commands.poll():
                    return commands.recv()
                if os.getppid() != me.parent:
                    return _Stop()
            if commands.poll():  # a new epoch (the loop stopped early) or stop
                credits.release()
                return commands.recv()
            try:
                item = next(it)
            except StopIteration:
                results.send_bytes(_HEADER.pack(epoch, _DONE, 0, 0))
                break
            results.send_bytes(_encode_batch(epoch, item))
    except (EOFError, BrokenPipeError):
        raise
    except Exception as exc:  # noqa: BLE001 - every error goes to the loop
        results.send_bytes(_failure(epoch, exc))
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # a generator's finally: unpins the shards it held
    return commands.recv()


def _failure(epoch: int, exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(exc))
    try:
        payload = pickle.dumps((exc, text))
        pickle.loads(payload)
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling goes as text
        payload = pickle.dumps((None, text))
    return _HEADER.pack(epoch, _FAILED, 0, 0) + payload


__all__ = ["BatchWorkers", "WorkerError", "WorkerIdentity", "WorkerOptions", "current_worker"]
