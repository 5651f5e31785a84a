"""How the API answers besides its models: ``{"error": ...}`` replies and the handlers that
make them, request bodies read with a cap, and logs served in chunks that never cut a
UTF-8 character."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from .models import ErrorReply, LogChunk

bearer = HTTPBearer(
    auto_error=False,
    description="the server's API token (--api-token); for reads, its read token "
    "(--read-token) as well",
)
READ = [Security(bearer)]  # documents the token reads need; access.ReadGate checks it

__all__ = [
    "ERROR_TEXT",
    "READ",
    "bearer",
    "error",
    "errors",
    "inline_refs",
    "install_error_handlers",
    "invalid_body",
    "invalid_parameters",
    "log_chunk",
    "read_capped",
    "read_log",
    "read_log_lines",
    "text_log",
    "text_log_lines",
]


ERROR_TEXT = {
    400: "the payload is malformed",
    401: "the token or signature is missing or wrong",
    403: "refused: no token or secret is configured, or the read token was given for a change",
    404: "no such thing",
    413: "the body is too large",
    409: "the thing is not in a state that allows this",
    422: "a parameter is not valid",
    503: "the queue cannot answer now, or is not configured",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for error codes, all answered as ``{"error": ...}``."""
    return {code: {"model": ErrorReply, "description": ERROR_TEXT[code]} for code in codes}


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorReply(error=message).model_dump(), status_code=status, headers=headers)


def invalid_parameters(exc: RequestValidationError) -> str:
    return "; ".join(
        f"{err['loc'][0]} parameter {str(err['loc'][-1])!r}: {err['msg']}"
        if len(err["loc"]) > 1
        else str(err["msg"])
        for err in exc.errors()
    )


async def read_capped(request: Request, limit: int) -> bytes | None:
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


def invalid_body(exc: ValidationError) -> str:
    errors = exc.errors()
    text = "; ".join(
        f"body field {'.'.join(str(part) for part in err['loc']) or '(root)'!r}: {err['msg']}"
        for err in errors[:5]
    )
    return text + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")


def utf8_prefix(data: bytes) -> int:
    """The length of ``data`` without a UTF-8 character cut at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = (
            2
            if byte >> 5 == 0b110
            else 3
            if byte >> 4 == 0b1110
            else 4
            if byte >> 3 == 0b11110
            else 1
        )
        return len(data) - back if need > back else len(data)
    return len(data)


def log_chunk(data: bytes, size: int, start: int, reset: bool, finished: bool) -> LogChunk:
    if not (finished and start + len(data) == size):  # a writer may be mid-character
        data = data[: utf8_prefix(data)]
    return LogChunk(
        text=data.decode("utf-8", "replace"),
        offset=start,
        next_offset=start + len(data),
        size=size,
        reset=reset,
        finished=finished,
    )


def read_log(path: Path, offset: int, limit: int, finished: bool) -> LogChunk:
    """At most ``limit`` bytes of ``path`` from ``offset``; from 0 when the file got shorter."""
    data, size, start = _read(path, offset, limit)
    return log_chunk(data, size, start, offset > size, finished)


def read_log_lines(path: Path, offset: int, limit: int, needles: list[bytes]) -> LogChunk:
    """As :func:`read_log`, whole lines only, and only those tagged with ``needles`` (a
    request id and a trace id, b"" for any): paged and followed the same way."""
    data, size, start = _read(path, offset, limit)
    return _lines(data, size, start, offset, limit, needles)


def text_log_lines(text: str, offset: int, limit: int, needles: list[bytes]) -> LogChunk:
    """:func:`read_log_lines` of a log held as text (the pods' logs, on Kubernetes)."""
    data = text.encode("utf-8", "replace")
    start = offset if offset <= len(data) else 0
    return _lines(data[start : start + limit], len(data), start, offset, limit, needles)


# the tag a runtime puts on a line printed serving a call, where it puts it: right after
# the time (local) and the replica; the same text later in a line is what was printed
_TAGGED = re.compile(rb"^(?:\S+ )?\[replica [^\]]*\] \[request_id=(\S+) trace_id=([0-9a-f]{32})\] ")


def _lines(
    data: bytes, size: int, start: int, offset: int, limit: int, needles: list[bytes]
) -> LogChunk:
    """The whole lines of ``data`` whose tag is ``needles``' (request id, trace id; b""
    for either: any). Lines end at "\n" only, as the runtimes and the log pump end them:
    a "\r" a caller gets printed does not start a line of its own."""
    read = data.rfind(b"\n") + 1  # a line still being written is read when it ends
    if read == 0 and len(data) == limit:
        read = limit  # a line longer than a page: passed over
    request, trace = needles
    kept = []
    for line in data[:read].split(b"\n")[: data[:read].count(b"\n")]:
        tag = _TAGGED.match(line)
        if tag and (not request or tag[1] == request) and (not trace or tag[2] == trace):
            kept.append(line + b"\n")
    return LogChunk(
        text=b"".join(kept).decode("utf-8", "replace"),
        offset=start,
        next_offset=start + read,
        size=size,
        reset=offset > size,
        finished=False,
    )


def _read(path: Path, offset: int, limit: int) -> tuple[bytes, int, int]:
    """(at most ``limit`` bytes from ``offset``, or from 0 when the file got shorter; its
    size; where they start); nothing when there is no file."""
    try:
        with path.open("rb") as log_file:
            size = os.fstat(log_file.fileno()).st_size
            start = offset if offset <= size else 0
            log_file.seek(start)
            return log_file.read(min(limit, size - start)), size, start
    except (FileNotFoundError, NotADirectoryError):
        return b"", 0, 0


def text_log(text: str, offset: int, limit: int, finished: bool) -> LogChunk:
    data = text.encode("utf-8", "replace")
    start = offset if offset <= len(data) else 0
    return log_chunk(data[start : start + limit], len(data), start, offset > len(data), finished)


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its ``$defs`` inlined (OpenAPI resolves refs from its root)."""
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return inline(schema)


def install_error_handlers(app: FastAPI) -> None:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error(exc.status_code, str(exc.detail), exc.headers)

    async def invalid_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error(422, invalid_parameters(exc))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
