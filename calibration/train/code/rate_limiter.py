"""Small in-process rate limiting helpers.

Two strategies are provided:

* ``TokenBucket`` allows short bursts up to ``capacity`` and refills at a
  steady ``rate`` per second. Good for smoothing calls to an external API.
* ``SlidingWindowCounter`` counts events in the last ``window`` seconds and is
  handy for "at most N logins per minute per user" style rules.

Both take an injectable clock so that tests do not need to sleep.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, Hashable

Clock = Callable[[], float]


class TokenBucket:
    """A thread-safe token bucket.

    >>> t = [0.0]
    >>> bucket = TokenBucket(rate=2.0, capacity=4, clock=lambda: t[0])
    >>> [bucket.try_acquire() for _ in range(5)]
    [True, True, True, True, False]
    >>> t[0] = 0.5          # half a second later one token has refilled
    >>> bucket.try_acquire()
    True
    """

    def __init__(self, rate: float, capacity: int, clock: Clock = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock
        self._tokens = float(capacity)
        self._last = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)

    def try_acquire(self, tokens: float = 1.0) -> bool:
        """Take ``tokens`` if available and return True, else return False."""
        with self._lock:
            self._refill()
            if self._tokens >= tokens:
                self._tokens -= tokens
                return True
            return False

    def wait_time(self, tokens: float = 1.0) -> float:
        """Seconds until ``tokens`` would be available (0 if available now)."""
        with self._lock:
            self._refill()
            missing = tokens - self._tokens
            return 0.0 if missing <= 0 else missing / self.rate

    def acquire(self, tokens: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        """Block until ``tokens`` can be taken."""
        while not self.try_acquire(tokens):
            sleep(self.wait_time(tokens))


class SlidingWindowCounter:
    """Allow at most ``limit`` events per ``window`` seconds for each key."""

    def __init__(self, limit: int, window: float, clock: Clock = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self._clock = clock
        self._events: Dict[Hashable, Deque[float]] = {}
        self._lock = threading.Lock()

    def hit(self, key: Hashable) -> bool:
        """Record an event for ``key``; return False if it exceeds the limit.

        Rejected events are not recorded, so a client that keeps retrying
        does not extend its own lockout.
        """
        now = self._clock()
        cutoff = now - self.window
        with self._lock:
            events = self._events.setdefault(key, deque())
            while events and events[0] <= cutoff:
                events.popleft()
            if len(events) >= self.limit:
                return False
            events.append(now)
            return True

    def remaining(self, key: Hashable) -> int:
        now = self._clock()
        with self._lock:
            events = self._events.get(key)
            if not events:
                return self.limit
            recent = sum(1 for t in events if t > now - self.window)
            return max(0, self.limit - recent)

    def prune(self) -> int:
        """Drop keys with no recent events. Returns how many were removed."""
        cutoff = self._clock() - self.window
        with self._lock:
            stale = [k for k, ev in self._events.items() if not ev or ev[-1] <= cutoff]
            for key in stale:
                del self._events[key]
            return len(stale)


if __name__ == "__main__":
    import doctest

    failures, _ = doctest.testmod()
    limiter = SlidingWindowCounter(limit=3, window=60)
    for attempt in range(5):
        allowed = limiter.hit("alice@example.org")
        print(f"login attempt {attempt + 1}: {'ok' if allowed else 'blocked'}")
    raise SystemExit(1 if failures else 0)
