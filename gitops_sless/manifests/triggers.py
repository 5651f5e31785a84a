"""A function's triggers: the checks the schema cannot make, and what they say together.

At most one http and one websocket trigger, and cron schedules that parse; the
functions a websocket trigger names (checked against the entrypoint's file, as the
entrypoint is); and what the triggers make of the function: whether it takes calls at
its URL (an http, queue or websocket trigger), whether plain calls are among them (not
with only a websocket trigger), and its :class:`~.model.WebSocketTrigger`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import cron
from .model import WebSocketTrigger

__all__ = ["hooks", "problems", "served"]

Path = tuple[str | int, ...]


def problems(triggers: list[dict[str, Any]]) -> Iterator[tuple[Path, str]]:
    """(where under ``triggers``, why) of each trigger the schema lets through wrongly."""
    seen: set[str] = set()
    for j, trigger in enumerate(triggers):
        kind = trigger["type"]
        if kind in ("http", "websocket"):
            if kind in seen:
                yield (j,), f"a function has at most one {kind} trigger"
            seen.add(kind)
        elif kind == "cron":
            try:
                cron.parse(trigger["schedule"])
            except cron.CronError as exc:
                yield (j, "schedule"), str(exc)


def hooks(triggers: Any) -> list[tuple[Path, str]]:
    """The functions a websocket trigger names (onConnect, onDisconnect), with where
    under ``triggers`` (read before the schema's verdict: anything may be there)."""
    return [
        ((j, key), trigger[key])
        for j, trigger in enumerate(triggers if isinstance(triggers, list) else ())
        if isinstance(trigger, dict) and trigger.get("type") == "websocket"
        for key in ("onConnect", "onDisconnect")
        if isinstance(trigger.get(key), str)
    ]


def served(triggers: list[dict[str, Any]]) -> dict[str, Any]:
    """The Function fields the (valid) triggers decide besides crons and subjects."""
    kinds = {t["type"] for t in triggers}
    socket = next((t for t in triggers if t["type"] == "websocket"), None)
    return {
        # queue events and websocket connections arrive as calls: each serves it as http does
        "http": bool(kinds & {"http", "queue", "websocket"}),
        "plain_http": "websocket" not in kinds or bool(kinds & {"http", "queue"}),
        "websocket": None
        if socket is None
        else WebSocketTrigger(
            socket.get("onConnect"), socket.get("onDisconnect"), socket["maxMessageBytes"]
        ),
    }
