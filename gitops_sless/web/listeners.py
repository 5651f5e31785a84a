"""Which address serves what: the API, the dashboard and /fn/ (with /async/) on one
listener, or /fn/ and /async/ on a listener of its own (``--fn-listen``), so functions'
pages get an origin apart."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from ..invocations.submit import wants_async

__all__ = [
    "ASGIApp",
    "Beside",
    "Listener",
    "dispatch",
    "functions_only",
    "json_answer",
    "without_functions",
]

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def functions(proxy: ASGIApp, submit: ASGIApp | None) -> Callable[[str, Any], ASGIApp | None]:
    """Which app serves a path of the functions' (None: neither): ``/fn/`` the proxy, or
    ``submit`` when it asks to be answered at once (``Prefer: respond-async``); ``/async/``
    always ``submit``."""

    def which(path: str, headers: Any) -> ASGIApp | None:
        if path.startswith("/fn/"):
            return submit if submit is not None and wants_async(headers) else proxy
        if path.startswith("/async/") and submit is not None:
            return submit
        return None

    return which


def dispatch(api: ASGIApp, proxy: ASGIApp, submit: ASGIApp | None = None) -> ASGIApp:
    which = functions(proxy, submit)

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        target = which(scope["path"], scope["headers"]) if scope["type"] == "http" else None
        await (target or api)(scope, receive, send)

    return app


def json_answer(status: int, body: dict[str, str]) -> ASGIApp:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def without_functions(api: ASGIApp, fn_url: str) -> ASGIApp:
    """The main listener with --fn-listen: /fn/ is 404 with where functions are served."""
    moved = json_answer(
        404,
        {
            "error": f"functions are served on the --fn-listen address: {fn_url}/fn/... "
            "(and /async/)"
        },
    )

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith(("/fn/", "/async/")):
            await moved(scope, receive, send)
        else:
            await api(scope, receive, send)

    return app


def functions_only(proxy: ASGIApp, submit: ASGIApp | None = None) -> ASGIApp:
    """The --fn-listen listener: /fn/, /async/ and /healthz; anything else 404."""
    which = functions(proxy, submit)
    healthy = json_answer(200, {"status": "ok"})
    elsewhere = json_answer(404, {"error": "not found: this address serves /fn/ only"})

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await proxy(scope, receive, send)
        elif scope["type"] != "http":
            await receive()
            await send({"type": "websocket.close", "code": 1008})
        elif (target := which(scope["path"], scope["headers"])) is not None:
            await target(scope, receive, send)
        elif scope["path"] == "/healthz":
            await healthy(scope, receive, send)
        else:
            await elsewhere(scope, receive, send)

    return app


ACCEPTED_GRACE_SEC = 0.1


class Listener(uvicorn.Server):
    """uvicorn's server, with a stop that loses no call accepted before it, and ends the
    process with 0 rather than by the signal that asked for it.

    uvicorn stops accepting and, in the same step, closes every connection with
    no request under way, including one accepted a moment ago whose request is
    still on its way (on a restart under load, that caller's connection was
    reset). Here a short grace lets such requests arrive first; they are then
    under way, and answered before the stop completes.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        # uvicorn raises the SIGINT or SIGTERM it stopped on again once it is done, so the
        # process would end by the signal (130 or 143), not by the documented 0 of a stop
        # that was asked for and went cleanly
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    async def shutdown(self, sockets: Any = None) -> None:
        for server in getattr(self, "servers", []):
            server.close()
        await asyncio.sleep(ACCEPTED_GRACE_SEC)
        await super().shutdown(sockets=sockets)


class Beside(Listener):
    """A second listener in the main one's loop: the main one handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield
