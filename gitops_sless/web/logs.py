"""The logs' API: what a function's replicas printed (all of it, or one request's lines)
and a build's log, page by page (``gitops-sless logs``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from ..state.store import Store
from . import replies
from .models import LogChunk

__all__ = ["MAX_LOG_CHUNK", "logs_router"]

MAX_LOG_CHUNK = 256 << 10  # bytes of a log per answer

_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_OFFSET = Query(ge=0, description="byte offset to read from (nextOffset of the last read)")
_LIMIT = Query(ge=1, le=MAX_LOG_CHUNK, description=f"bytes to read, at most {MAX_LOG_CHUNK}")
_REQUEST = Query(
    pattern=r"^[!-~]{1,200}$",
    description="only the lines tagged with this request id (its X-Request-Id)",
)
_TRACE = Query(pattern=r"^[0-9a-f]{32}$", description="only the lines tagged with this trace id")


def logs_router(store: Store, state_dir: Path, backend: Any = None) -> APIRouter:
    """``state_dir``: the local backend's logs are its files; ``backend``: one that keeps
    the replicas' output itself (``function_log``: Kubernetes, its pods' logs)."""
    router = APIRouter()

    @router.get(
        "/api/v1/environments/{env}/functions/{name}/logs",
        tags=["logs"],
        dependencies=replies.READ,
        responses=replies.errors(401, 404, 422),
    )
    def function_logs(
        env: str,
        name: str,
        offset: Annotated[int, _OFFSET] = 0,
        limit: Annotated[int, _LIMIT] = MAX_LOG_CHUNK,
        request: Annotated[str | None, _REQUEST] = None,
        trace: Annotated[str | None, _TRACE] = None,
    ) -> LogChunk:
        """What the function's replicas printed (one log for all of them, each line naming
        its replica), page by page; with ``request`` or ``trace``, only the lines printed
        while serving that request (or trace): the runtimes tag them
        ``[request_id=ID trace_id=TRACE]``. On Kubernetes, the last 5,000 lines of each
        pod, in one answer (``finished``: a read of the pods, not a file followed)."""
        known = _LABEL.fullmatch(env) and _LABEL.fullmatch(name) and store.function(env, name)
        if not known:
            raise HTTPException(404, f"no function {name!r} in environment {env!r}")
        needles = [(request or "").encode(), (trace or "").encode()] if request or trace else []
        kept = getattr(backend, "function_log", None)
        text = kept(env, name) if kept is not None else None
        if text is not None:  # the pods' logs, read anew: one answer, whole, not followed
            if offset:
                return LogChunk(text="", offset=0, next_offset=0, size=0, reset=True, finished=True)
            whole = len(text.encode("utf-8", "replace")) + 1
            if needles:
                chunk = replies.text_log_lines(text, 0, whole, needles)
            else:
                chunk = replies.text_log(text, 0, whole, finished=True)
            return chunk.model_copy(update={"finished": True})
        path = state_dir / "logs" / env / f"{name}.log"
        if needles:
            return replies.read_log_lines(path, offset, limit, needles)
        return replies.read_log(path, offset, limit, finished=False)

    @router.get(
        "/api/v1/builds/{tag}/log",
        tags=["logs"],
        dependencies=replies.READ,
        responses=replies.errors(401, 404, 422),
    )
    def build_log(
        tag: str,
        offset: Annotated[int, _OFFSET] = 0,
        limit: Annotated[int, _LIMIT] = MAX_LOG_CHUNK,
    ) -> LogChunk:
        """The log of the last build of ``tag``; ``finished`` once that build has ended."""
        build = store.build(tag) if _TAG.fullmatch(tag) else None
        if build is None:
            raise HTTPException(404, f"no build {tag!r}")
        finished = build["phase"] != "Building"  # read before the file: never a short "finished"
        path = state_dir / "artifacts" / f"{tag}.log"
        if path.is_file():
            return replies.read_log(path, offset, limit, finished)
        return replies.text_log(build["log"] or "", offset, limit, finished)

    return router
