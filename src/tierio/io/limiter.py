"""Token-bucket bandwidth limiter for background traffic (promotion, prefetch)."""

from __future__ import annotations

import threading
import time


class TokenBucket:
    """Allows ``rate`` bytes per second on average with bursts up to ``burst`` bytes.

    ``consume(n)`` blocks until n bytes may pass; large requests are never split.
    ``rate=None`` (or <= 0) disables limiting.
    """

    def __init__(self, rate: float | None, burst: float | None = None) -> None:
        self.rate = rate if rate and rate > 0 else None
        self.burst = float(burst if burst is not None else (rate or 0) / 4 or 1)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.waited_seconds = 0.0

    def consume(self, n: int) -> float:
        """Take n bytes worth of tokens; returns how long the caller waited."""
        if self.rate is None or n <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            # Pay after: the caller goes into debt and sleeps it off, so concurrent callers queue fairly
            # and the long-run rate holds however the requests are sized.
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
            self.waited_seconds += wait
        return wait
