"""``POST /internal/otlp/v1/traces``: the local backend's runtimes send their spans here
(OTLP/HTTP JSON, the replica's key as a bearer token), and the reconciler exports them
as the function's (see :mod:`gitops_sless.telemetry.relay`). Not for callers: 401 without a
replica's key, whatever the API tokens."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from .. import telemetry
from ..local.backend import LocalBackend
from ..plan.backend import Backend
from ..telemetry import relay as spanrelay
from . import replies

__all__ = ["otlp_router", "relay_local_spans"]


def relay_local_spans(api: FastAPI, backend: Backend, public_url: str) -> None:
    """With spans exported, the local backend's runtimes send theirs to ``api`` (at
    ``public_url``), which exports them; nothing otherwise."""
    if not telemetry.enabled() or not isinstance(backend, LocalBackend):
        return
    supervisor = backend.supervisor
    supervisor.span_relay = f"{public_url}/internal/otlp"
    api.include_router(otlp_router(supervisor.key_owner))


def otlp_router(owner: Callable[[str], tuple[str, str] | None]) -> APIRouter:
    """``owner(key)``: the (environment, function) whose replicas hold ``key``."""
    router = APIRouter(include_in_schema=False)

    @router.post("/internal/otlp/v1/traces")
    async def spans(request: Request) -> JSONResponse:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        found = owner(key) if scheme.lower() == "bearer" and key else None
        if found is None:
            raise HTTPException(401, "spans are taken from the local backend's replicas only")
        try:
            body = await replies.read_capped(request, spanrelay.MAX_BODY_BYTES)
        except ClientDisconnect:
            raise HTTPException(400, "client closed the connection") from None
        if body is None:
            raise HTTPException(413, f"spans are at most {spanrelay.MAX_BODY_BYTES} bytes a post")
        try:
            await run_in_threadpool(spanrelay.relay, body, *found)
        except spanrelay.BadSpans as exc:
            raise HTTPException(400, str(exc)) from None
        return JSONResponse({"partialSuccess": {}})

    return router
