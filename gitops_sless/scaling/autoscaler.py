"""The decision for one function: replicas for its observed concurrency (Knative's KPA).

Concurrency (in-flight calls through the proxy, waiting ones included) is
averaged over two windows ending now, from the function's integrated load
(``state.load``): the stable window (60 s by default) and the panic window
(6 s). The stable count is ``ceil(stable average / target)``. When the panic
window asks for at least twice the replicas that serve, the function panics
for a stable window: it scales up on the panic window's figure, and never
down, until the burst has been gone that long. The result stays within
``[floor, max]``; with a floor of 0 the last replica goes only after ``idle``
seconds without a call.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ..manifests.model import Scale

__all__ = ["Autoscaler", "Decision", "Windows"]

PANIC_THRESHOLD = 2.0  # the panic window wants this many times the ready replicas


@dataclass(frozen=True)
class Windows:
    """How the autoscaler looks at load (``serve --scale-*``; tests use seconds)."""

    stable_sec: float = 60.0
    panic_sec: float = 6.0
    tick_sec: float = 1.0


@dataclass(frozen=True)
class Decision:
    desired: int
    stable: float  # average concurrency over the stable window
    panic: float  # ... over the panic window
    panicking: bool


class Autoscaler:
    """One function's windows of load and its last decision."""

    def __init__(self, windows: Windows, now: float, busy: float) -> None:
        self.windows = windows
        self.samples: deque[tuple[float, float]] = deque([(now, busy)])  # (time, busy)
        self.panic_until = 0.0
        self.desired: int | None = None  # the last decision; None: none yet

    def restart(self, now: float, busy: float) -> None:
        """Forget the windows (the busy seconds are now read elsewhere); the last decision
        and a panic under way stay."""
        self.samples = deque([(now, busy)])

    def _average(self, now: float, busy: float, window: float) -> float:
        # the oldest sample inside the window (or the first ever, early on)
        then, busy_then = self.samples[0]
        for at, value in self.samples:
            if at >= now - window:
                then, busy_then = at, value
                break
        return (busy - busy_then) / (now - then) if now > then else 0.0

    def decide(
        self,
        policy: Scale,
        floor: int,
        now: float,
        busy: float,
        ready: int,
        idle_for: float,
    ) -> Decision:
        """Replicas to run now. ``busy``: the function's call-seconds so far; ``ready``:
        replicas serving; ``idle_for``: seconds without a call in flight."""
        windows = self.windows
        samples = self.samples
        samples.append((now, busy))
        while len(samples) > 2 and samples[1][0] <= now - windows.stable_sec:
            samples.popleft()
        stable = self._average(now, busy, windows.stable_sec)
        panic = self._average(now, busy, windows.panic_sec)
        want_stable = math.ceil(stable / policy.target - 1e-9)
        want_panic = math.ceil(panic / policy.target - 1e-9)
        if want_panic >= PANIC_THRESHOLD * max(ready, 1) and want_panic > ready:
            self.panic_until = now + windows.stable_sec
        panicking = now < self.panic_until
        previous = self.desired if self.desired is not None else ready
        desired = max(want_panic, want_stable, previous) if panicking else want_stable
        if idle_for >= policy.idle_sec:
            desired = 0  # nobody called for idle seconds: whatever the window still holds
        elif desired == 0 and previous > 0:
            desired = 1  # not idle long enough for the last replica to go
        desired = min(max(desired, floor), policy.max)
        self.desired = desired
        return Decision(desired, stable, panic, panicking)
