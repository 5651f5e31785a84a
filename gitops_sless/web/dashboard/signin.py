"""Signing in to the dashboard with a token, and out again."""

from __future__ import annotations

from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.requests import ClientDisconnect

from ..access import Access, Level
from .html import _CSS_URL, _HEADERS, _SIGNIN_JS_URL, MAX_FORM_BYTES, Html, _h

# --- signing in -----------------------------------------------------------------------

_SIGNIN_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>Sign in · gitops-sless</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{css}">
<script src="{js}" defer></script>
</head>
<body class="signin">
<main id="main" tabindex="-1">
<h1>gitops-sless</h1>
<form class="signin" method="post" action="/signin">
<p>This server shows its functions, builds, job results and logs to people with a token.</p>
{notice}
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required \
autofocus>
<input type="hidden" name="next" value="{next}">
<button type="submit">Sign in</button>
<p class="muted">The read token (<code>SLESS_READ_TOKEN</code>) or the API token \
(<code>SLESS_API_TOKEN</code>) the server was started with. The browser keeps a session \
for 12 hours, never the token.</p>
</form>
</main>
</body>
</html>
"""
_SIGNOUT = (
    '<form class="signout" method="post" action="/signout" data-csrf="{csrf}" '
    'data-csrf-header="{header}"><button type="submit">Sign out</button></form>'
)


_CROSS_SITE = "Refused: the form was sent by another site."


def _next_path(value: str | None) -> str:
    """A path on this server to go back to; anything else (another site) is ``/``."""
    if (
        not value
        or len(value) > 2000
        or not value.startswith("/")
        or value.startswith(("//", "/\\"))
        or any(ord(c) < 0x20 or c == "\\" for c in value)
        or value.startswith(("/signin", "/signout"))
    ):
        return "/"
    return value


def _signin_response(next_path: str, notice: Html, status: int) -> HTMLResponse:
    body = _h(
        _SIGNIN_PAGE, css=_CSS_URL, js=_SIGNIN_JS_URL, notice=notice, next=_next_path(next_path)
    )
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


def signin_page(request: Request) -> HTMLResponse:
    """What a signed-out browser is shown at a page that needs a token: the form, 401."""
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return _signin_response(path, Html(""), 401)


def _notice(text: str, kind: str = "error") -> Html:
    role = "alert" if kind == "error" else "status"
    return _h('<p class="{k}" role="{r}" id="signin-{k}">{t}</p>', k=kind, r=role, t=text)


async def _form(request: Request) -> dict[str, str] | None:
    """The fields of a urlencoded form of at most MAX_FORM_BYTES; None past that."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return None
    except ClientDisconnect:
        return None
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    return {key: values[0] for key, values in fields.items()}


def _signin_routes(routes: APIRouter, access: Access) -> None:
    """``/signin`` (the form, and the post that exchanges a token for a session), ``/signout``."""

    @routes.get("/signin")
    def signin_form(request: Request) -> Response:
        if access.open_reads:
            return RedirectResponse("/", status_code=303)
        out = "signed-out" in request.query_params
        notice = _notice("You are signed out.", "notice") if out else Html("")
        return _signin_response(request.query_params.get("next", "/"), notice, 200)

    @routes.post("/signin")
    async def signin(request: Request) -> Response:
        if not access.same_origin(request):
            return _signin_response("/", _notice(_CROSS_SITE), 403)
        form = await _form(request)
        if form is None:
            return _signin_response("/", _notice("Refused: the form is too large."), 413)
        next_path = _next_path(form.get("next"))
        if access.open_reads:
            return RedirectResponse(next_path, status_code=303)
        level = access.token_level(form.get("token", ""))
        if level < Level.READ:
            return _signin_response(next_path, _notice("That token is not valid."), 401)
        response = RedirectResponse(next_path, status_code=303)
        access.set_session(response, request, write=level == Level.WRITE)
        return response

    @routes.post("/signout")
    def signout(request: Request) -> Response:
        if not access.same_origin(request):
            return _signin_response("/", _notice(_CROSS_SITE), 403)
        response = RedirectResponse("/signin?signed-out", status_code=303)
        access.clear_session(response, request)
        return response
