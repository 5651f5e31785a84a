"""The proxy's own watch over streamed responses: ``stream.idleSec`` and ``stream.maxSec``.

The runtimes end a stream past its limits themselves, with the reason in the function's
log. The proxy holds the same limits for the functions that name a ``stream`` block, a
second apart (so the runtime's ending, and its reason, normally comes first), for a
replica that cannot: a stuck process, a runtime of a user's own, a replica whose
connection went quiet. One sweep for every stream every SWEEP_SEC (a timer per chunk
would cost the data path); a stream past a limit is cut unfinished, as the runtime
would cut it, and the reason is logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from .. import logs

__all__ = ["MARGIN_SEC", "Opened", "StreamWatch", "Watched"]

_log = logging.getLogger(__name__)

SWEEP_SEC = 0.25
MARGIN_SEC = 1.0  # after the runtime's own limit: its ending, and its reason, come first


class Watched(Protocol):
    """A response under way (:class:`~gitops_sless.proxy.fast.FastCall`)."""

    last_chunk: float  # loop time of its last body bytes (or its head)
    head_at: float  # loop time of its head
    response_complete: bool

    def cut(self, why: str) -> None: ...


class StreamWatch:
    """The streamed responses under way, swept for their limits."""

    def __init__(self) -> None:
        self._watched: dict[Watched, tuple[float, float, str]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def watch(
        self,
        call: Watched,
        idle_sec: float,
        max_sec: float,
        what: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Sweep ``call`` (``what``: env/name, for the log) until its response completes."""
        self._watched[call] = (idle_sec + MARGIN_SEC, max_sec + MARGIN_SEC, what)
        if self._timer is None:
            self._timer = loop.call_later(SWEEP_SEC, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for call, (idle, most, what) in list(self._watched.items()):
            if call.response_complete:
                del self._watched[call]
            elif now - call.last_chunk > idle:
                self._cut(call, what, f"sent nothing for {idle - MARGIN_SEC:g}s (stream.idleSec)")
            elif now - call.head_at > most:
                self._cut(call, what, f"ran for {most - MARGIN_SEC:g}s (stream.maxSec)")
        self._timer = loop.call_later(SWEEP_SEC, self._sweep, loop) if self._watched else None

    def _cut(self, call: Watched, what: str, why: str) -> None:
        del self._watched[call]
        logs.event(_log, "stream.cut", f"{what}: the stream {why}; the proxy ended it")
        call.cut(why)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Opened:
    """A streamed response or a WebSocket of a call, open from its head until the call
    ends: counted on its function's load (``streams``, ``sockets``), with what went to the
    client (bytes, and a stream's chunks) for the invocation history."""

    __slots__ = ("bytes", "chunks", "load", "socket")

    def __init__(self, load: Any, socket: bool) -> None:
        self.load, self.socket = load, socket
        self.bytes = 0
        self.chunks = 0
        if socket:
            load.sockets += 1
        else:
            load.streams += 1

    def close(self) -> None:
        if self.socket:
            self.load.sockets -= 1
        else:
            self.load.streams -= 1
