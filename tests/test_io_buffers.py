"""BufferPool as the one buffer holder: slot cap, grow on demand, wake-up on error and close."""

from __future__ import annotations

import threading

import pytest

from tierio.errors import ConfigError, StorageError
from tierio.io.buffers import BufferPool


def test_slot_cap_and_grow_on_demand():
    pool = BufferPool(budget_bytes=None, max_buffers=1)
    a = pool.acquire(4096)
    with pytest.raises(TimeoutError):
        pool.acquire(100, timeout=0.05)  # the one slot is in use
    pool.release(a)
    assert pool.acquire(100) is a
    pool.release(a)
    b = pool.acquire(3 * 4096)  # larger: the small one is let go, not kept beside it
    assert b is not a and pool.allocations == 2 and pool.allocated_bytes == b.capacity
    pool.release(b)
    assert pool.acquire(4096) is b  # a larger free buffer serves smaller requests


def test_waiters_wake_on_error_and_on_close():
    pool = BufferPool(budget_bytes=None, max_buffers=1)
    held = pool.acquire(4096)
    failure: list[BaseException] = []
    outcome: list[BaseException] = []

    def abort() -> None:
        if failure:
            raise failure[0]

    def waiter() -> None:
        try:
            pool.acquire(4096, abort=abort)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    failure.append(StorageError("the background write failed"))
    pool.wake()
    t.join(60)
    assert isinstance(outcome[0], StorageError)
    t = threading.Thread(target=waiter)
    failure.clear()
    t.start()
    pool.close()
    t.join(60)
    assert isinstance(outcome[1], ConfigError)
    pool.release(held)
    with pytest.raises(ConfigError, match="closed"):
        pool.acquire(1)
