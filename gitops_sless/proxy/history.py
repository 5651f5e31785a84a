"""The invocation history: what the proxy (and the local backend's cron runs) did, written
to the status store in batches off the hot path."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from ..metrics import METRICS
from ..plan.backend import CronRun
from ..state.store import Store

__all__ = ["Invocation", "InvocationBuffer"]


@dataclass(slots=True)  # not frozen: its __init__ would set each field through object
class Invocation:
    """One call through the proxy, as recorded in the invocation history."""

    env: str
    name: str
    method: str
    path: str  # the sub-path and query sent to the function, as the client encoded it
    status: int  # 499: the client left before the answer (nginx's code)
    duration_ms: float
    time: float  # wall clock at the start of the call, seconds since the epoch
    request_id: str
    trace_id: str = ""  # "": the request id is the trace's (the proxy started it)
    cold_ms: float | None = None  # how long it waited for a replica to start; None: warm
    # a streamed response's or a WebSocket's bytes to the client, a stream's chunks (None:
    # an ordinary call, or a socket's chunks)
    bytes: int | None = None
    chunks: int | None = None


class InvocationBuffer:
    """Invocations from the proxy, written to the store in batches off the hot path."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._rows: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=100_000)

    def record(self, inv: Invocation) -> None:
        self._rows.append(
            (
                inv.env,
                inv.name,
                inv.method,
                inv.path,
                inv.status,
                inv.duration_ms,
                inv.time,
                inv.request_id,
                inv.trace_id,
                inv.cold_ms,
                inv.bytes,
                inv.chunks,
            )
        )

    def record_cron(self, run: CronRun) -> None:
        status = 200 if run.ok else 500
        METRICS.invocations.inc(env=run.env, name=run.function, status=str(status))
        self._rows.append(
            (
                run.env,
                run.function,
                "CRON",
                f"cron/{run.index}",
                status,
                run.duration_ms,
                run.at or time.time(),
                f"cron-{run.index}",
                "",
                None,
            )
        )

    def flush(self) -> None:
        rows = []
        while self._rows:
            rows.append(self._rows.popleft())
        self.store.record_invocations(rows)
