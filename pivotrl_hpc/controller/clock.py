"""The controller's two clocks: monotonic wall time (live) and virtual time (simulation).

The loop never sleeps by itself: it asks the clock to wait until the next event, and the
replica handles may wake it earlier (a reply arrived). Virtual time jumps instead of waiting.
"""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the run started."""

    def wait_until(self, t: float) -> None:
        """Return at `t` at the latest (earlier is allowed: the loop re-checks)."""


class MonotonicClock:
    """Live time. `wait_until` naps in short slices so replies are noticed quickly."""

    def __init__(self, nap_s: float = 0.002) -> None:
        self._t0 = time.monotonic()
        self.nap_s = nap_s

    def now(self) -> float:
        return time.monotonic() - self._t0

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(min(delay, self.nap_s))


class VirtualClock:
    """Simulated time: `wait_until` jumps straight there (never backwards)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)
