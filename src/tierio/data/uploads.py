"""Finished shards stored in the background while the next one fills.

A dataset writer produces a shard in memory and hands it here: ``put`` returns at once while at
most ``in_flight`` shards are being stored (each an S3 multipart upload with its parts in
parallel, or a local write), and waits when that many are, so memory stays bounded at
``in_flight + 1`` shards. The first failure is raised by the next ``put`` or by ``wait``, and
nothing is stored after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierio.storage.base import Buffer, Store


class BackgroundPuts:
    def __init__(self, store: Store, in_flight: int = 2) -> None:
        self.store = store
        self.in_flight = max(1, in_flight)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()

    def put(self, key: str, pieces: Sequence[Buffer]) -> None:
        """Store ``pieces`` (concatenated) under ``key``; they must stay unchanged until stored."""
        self._reap(block=False)
        while len(self._pending) >= self.in_flight:
            self._pending.popleft().result()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.in_flight, thread_name_prefix="tierio-shard-put")
        self._pending.append(self._pool.submit(self.store.put_buffers, key, list(pieces)))

    def _reap(self, block: bool) -> None:
        while self._pending and (block or self._pending[0].done()):
            self._pending.popleft().result()  # raises the first failure

    def wait(self) -> None:
        """Every shard put so far is stored (or the first failure is raised)."""
        try:
            self._reap(block=True)
        except BaseException:
            self.abort()
            raise
        self._shutdown()

    def abort(self) -> None:
        """Drop shards not yet started and wait for those being stored (their outcome ignored)."""
        for f in self._pending:
            f.cancel()
        for f in self._pending:
            if not f.cancelled():
                f.exception()
        self._pending.clear()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["BackgroundPuts"]
