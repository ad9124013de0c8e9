"""The save loop the kill -9 tests run in a child process (full and incremental saves alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def save_forever(mgr: Any, first: int, state_for: Callable[[int], dict], persisted: Any) -> None:
    """Save steps ``first, first+1, ...`` asynchronously until killed; ``persisted.value`` is the
    newest step known durable (each save's predecessor, once the next one has been handed over)."""
    step, prev = first, None
    while True:
        h = mgr.save(step, state_for(step))
        if prev is not None:
            prev.persisted.result()
            persisted.value = prev.step
        prev = h
        step += 1
