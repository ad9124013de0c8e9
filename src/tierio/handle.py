"""The one handle type for background work: ``done()`` says whether it finished, ``wait()`` blocks
until it does and returns its result or raises its failure. A save (``ckpt.SaveHandle``), a batched
KV transfer and any later background operation are ``Handle``s, so callers learn one shape."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

T = TypeVar("T")


class Handle(ABC, Generic[T]):
    """Background work in flight. ``wait`` may be called any number of times and from any thread."""

    @abstractmethod
    def done(self) -> bool:
        """True once the work finished, well or not (``wait`` then returns at once)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> T:
        """Block until done (at most ``timeout`` seconds: ``TimeoutError`` past it); the result, or
        the work's failure raised here."""

    def result(self, timeout: float | None = None) -> T:
        """The same as ``wait``: the name ``concurrent.futures`` users reach for."""
        return self.wait(timeout)
