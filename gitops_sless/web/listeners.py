"""Which address serves what: the API, the dashboard and /fn/ on one listener, or /fn/ on
a listener of its own (``--fn-listen``), so functions' pages get an origin apart."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

__all__ = ["ASGIApp", "Beside", "dispatch", "functions_only", "json_answer", "without_functions"]

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def dispatch(api: ASGIApp, proxy: ASGIApp) -> ASGIApp:
    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/fn/"):
            await proxy(scope, receive, send)
        else:
            await api(scope, receive, send)

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
        404, {"error": f"functions are served on the --fn-listen address: {fn_url}/fn/..."}
    )

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/fn/"):
            await moved(scope, receive, send)
        else:
            await api(scope, receive, send)

    return app


def functions_only(proxy: ASGIApp) -> ASGIApp:
    """The --fn-listen listener: /fn/ and /healthz; anything else 404."""
    healthy = json_answer(200, {"status": "ok"})
    elsewhere = json_answer(404, {"error": "not found: this address serves /fn/ only"})

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await proxy(scope, receive, send)
        elif scope["type"] != "http":
            await receive()
            await send({"type": "websocket.close", "code": 1008})
        elif scope["path"].startswith("/fn/"):
            await proxy(scope, receive, send)
        elif scope["path"] == "/healthz":
            await healthy(scope, receive, send)
        else:
            await elsewhere(scope, receive, send)

    return app


class Beside(uvicorn.Server):
    """A second listener in the main one's loop: the main one handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield
