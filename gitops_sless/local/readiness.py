"""How a replica says it is ready: one line on a pipe, with when each start phase ended.

The supervisor hands every runtime server the write end of a pipe
(``SLESS_READY_FD``); the server writes one JSON line once it listens, its
phases on the monotonic clock that this process reads too, and closes it. A
start is seen the moment it is done, with no polling of ``/health``, and its
phases go to the cold-start histogram. EOF without a line: the start failed
(or a runtime that does not speak this; the supervisor then polls).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import time
from pathlib import Path

from ..metrics import METRICS
from ..plan.backend import ApplyFailed
from .oneshot import LOG_TAIL_BYTES
from .replica_logs import unstamped
from .units import ProcessSpec

__all__ = ["ReadyLine", "StartFailed", "record_start", "tail"]


class ReadyLine:
    """The line a runtime writes on ``SLESS_READY_FD`` once it listens (runtimes/*/README.md):
    when its start phases ended, on the monotonic clock that this process reads too."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""
        self.done = False  # the runtime closed its end (or wrote its line)

    def wait(self, timeout: float) -> dict[str, float] | None:
        """The phases once the line is in; None while it is not (``done``: never will be)."""
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if not readable:
            return None
        chunk = os.read(self.fd, 4096)
        self.data += chunk
        if chunk and b"\n" not in self.data and len(self.data) < 65536:
            return None
        self.done = True
        try:
            line = json.loads(self.data.partition(b"\n")[0])
            phases = line["t"]
            return {k: float(phases[k]) for k in ("start", "runtime", "handler", "listening")}
        except (ValueError, KeyError, TypeError):
            return None  # EOF without a line: the start failed, or an older runtime

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def record_start(spec: ProcessSpec, spawned: float, phases: dict[str, float] | None) -> None:
    """The phases of a replica's start in the cold-start histogram (METRICS.cold_start)."""
    if phases is None:
        return
    now = time.monotonic()
    labels = {"env": spec.env_name, "function": spec.function, "runtime": spec.runtime.name}
    edges = [("process", spawned, phases["start"]), ("runtime", phases["start"], phases["runtime"])]
    edges += [("handler", phases["runtime"], phases["handler"])]
    edges += [("ready", phases["handler"], now)]
    for phase, begun, ended in edges:
        METRICS.cold_start.observe_labelled(max(0.0, ended - begun), phase=phase, **labels)


def tail(path: Path, since: int) -> str:
    """What was written to ``path`` after offset ``since`` (its last LOG_TAIL_BYTES),
    without the timestamps: as the runtime printed it, for ``failure.cause``."""
    try:
        with path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            since = since if since <= end else 0  # the file was truncated meanwhile
            f.seek(max(since, end - LOG_TAIL_BYTES))
            return unstamped(f.read()).decode("utf-8", "replace")
    except OSError:
        return ""


class StartFailed(ApplyFailed):
    """A replica did not become ready: ``reason``, how its runtime ended, if it did."""

    def __init__(self, message: str, reason: str | None) -> None:
        super().__init__(message)
        self.reason = reason  # how the runtime ended, if it did
