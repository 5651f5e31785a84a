"""The status API, webhooks and health endpoints (FastAPI). The /fn/ proxy is not here.

Reads come from the status store; the only writes are "sync now" requests,
which need the bearer token, and webhooks, which need a valid signature.
With no token or secret configured those calls are refused, never open.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import webhooks
from .metrics import METRICS
from .reconciler import Reconciler
from .store import Store

__all__ = ["MAX_WEBHOOK_BYTES", "create_api"]

MAX_WEBHOOK_BYTES = 1 << 20
LOG_TAIL = 4000


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _read_capped(request: Request, limit: int) -> bytes | None:
    """The body, or None when it exceeds ``limit`` (checked before and while reading)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _function_detail(store: Store, env: str, record: dict[str, Any]) -> dict[str, Any]:
    build = store.build(record["build_tag"]) if record.get("build_tag") else None
    if build:
        build = {**build, "log": build["log"][-LOG_TAIL:]}
    return {
        **record,
        "build": build,
        "jobs": [j for j in store.jobs(env) if j["function"] == record["name"]],
        "invocations": store.invocations(env, record["name"]),
    }


def create_api(
    reconciler: Reconciler,
    store: Store,
    branch: str,
    repo: str,
    api_token: str | None,
    webhook_secret: str | None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so code after
        # server.run() may never run: the lifespan's end is the place to clean up
        if on_shutdown:
            await on_shutdown()

    app = FastAPI(
        title="gitops-sless",
        summary="Serverless functions on Kubernetes, deployed by git push.",
        version="0.1.0",
        lifespan=lifespan,
    )

    def authorize(request: Request) -> JSONResponse | None:
        if not api_token:
            return _error(403, "mutating API calls are disabled: no API token is configured")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_token}".encode()):
            return _error(401, "a valid 'Authorization: Bearer <token>' header is required")
        return None

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def metrics() -> str:
        return METRICS.render()

    @app.get("/api/v1/status", tags=["status"])
    def status() -> dict[str, Any]:
        env = reconciler.env
        functions = store.functions(env)
        phases: dict[str, int] = {}
        for fn in functions:
            phases[fn["phase"]] = phases.get(fn["phase"], 0) + 1
        last = store.last_sync(env)
        good = next((s for s in store.syncs(50, env) if s["result"] != "Failed"), None)
        return {
            "repository": repo,
            "branch": branch,
            "environment": env,
            "revision": good["revision"] if good else None,
            "lastSync": last,
            "functions": len(functions),
            "phases": phases,
        }

    @app.get("/api/v1/environments", tags=["status"])
    def environments() -> list[dict[str, Any]]:
        return [
            {"name": env, "functions": len(store.functions(env)), "lastSync": store.last_sync(env)}
            for env in store.environments()
        ]

    @app.get("/api/v1/environments/{env}/functions", tags=["status"])
    def functions(env: str) -> list[dict[str, Any]]:
        return store.functions(env)

    @app.get("/api/v1/environments/{env}/functions/{name}", tags=["status"])
    def function(env: str, name: str) -> dict[str, Any]:
        record = store.function(env, name)
        if record is None:
            raise HTTPException(404, f"no function {name!r} in environment {env!r}")
        return _function_detail(store, env, record)

    @app.get("/api/v1/environments/{env}/jobs", tags=["status"])
    def jobs(env: str) -> list[dict[str, Any]]:
        return store.jobs(env)

    @app.get("/api/v1/syncs", tags=["status"])
    def syncs(limit: int = 50) -> list[dict[str, Any]]:
        return store.syncs(min(max(limit, 1), 1000))

    @app.post("/api/v1/sync", tags=["sync"], status_code=202)
    def sync(request: Request, wait: float = 0) -> Any:
        refused = authorize(request)
        if refused:
            return refused
        before = reconciler.passes
        reconciler.request_sync("api")
        finished = reconciler.wait_for_pass(before, min(wait, 600)) if wait > 0 else False
        return {"accepted": True, "finished": finished, "lastSync": store.last_sync(reconciler.env)}

    @app.post("/api/v1/webhooks/{forge}", tags=["webhooks"], status_code=202)
    async def webhook(forge: str, request: Request) -> Any:
        if forge not in webhooks.FORGES:
            return _error(404, f"no webhook for {forge!r}; use one of {', '.join(webhooks.FORGES)}")
        if not webhook_secret:
            return _error(403, "webhooks are disabled: no webhook secret is configured")
        body = await _read_capped(request, MAX_WEBHOOK_BYTES)
        if body is None:
            return _error(413, f"webhook body is larger than {MAX_WEBHOOK_BYTES} bytes")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            webhooks.verify(forge, headers, body, webhook_secret)
            push = webhooks.parse_push(forge, headers, body)
        except webhooks.SignatureError as exc:
            return _error(401, f"webhook refused: {exc}")
        except ValueError as exc:
            return _error(400, str(exc))
        if push.event != "push" or push.branch != branch:
            what = f"push to {push.branch}" if push.event == "push" else f"{push.event} event"
            return JSONResponse({"accepted": False, "ignored": what}, status_code=200)
        reconciler.request_sync(f"webhook:{forge}")
        return {"accepted": True}

    return app
