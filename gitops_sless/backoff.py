"""How long to wait before starting again something that failed to start: Kubernetes'
CrashLoopBackOff, 10 s doubling to 5 minutes, forgotten after 10 minutes of health.

Used for replicas that die and for deploys whose new version never becomes healthy.
"""

from __future__ import annotations

__all__ = ["FIRST_SEC", "MAX_SEC", "RESET_AFTER_SEC", "delay"]

FIRST_SEC = 10.0
MAX_SEC = 300.0
RESET_AFTER_SEC = 600.0


def delay(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (1, 2, ...)."""
    return min(MAX_SEC, FIRST_SEC * 2 ** max(0, failures - 1))
