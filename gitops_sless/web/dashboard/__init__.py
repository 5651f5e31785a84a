"""The dashboard: server-rendered pages at ``/`` and ``/functions/{env}/{name}``.

Everything on a page comes from the status store, read through the API's
models (so the page and ``/api/v1`` never disagree, and the store never holds
a secret value), plus a commit's subject and author, read from the mirror's
git objects. Every value passes through ``_h``: a field is escaped unless it
is already ``Html``. A page loads one stylesheet and one script from
``static/`` and nothing else; its Content-Security-Policy allows no other
source and no inline script, so a missed escape still could not run one. The
script fetches the page again every few seconds and patches what changed in
place: a push shows up on an open page, and focus stays where it was.

When the server has a token, a signed-out visitor of any page is shown the
sign-in form instead (by :class:`access.ReadGate`, with a 401); posting a token
to ``/signin`` sets the session cookie and goes back to the page, and the
header's "Sign out" button ends the session. The sign-in page's script fills
the form from a ``#token=`` fragment (the start-up banner's link: a fragment
never reaches the server, nor its logs) and sends it. The session reads the
pages, not ``/api/``: the sign-out form carries the session's CSRF token, which
the dashboard's script sends as :data:`access.CSRF_HEADER` for the API links. A
session signed in with the API token also gets a function page's rollback and unpin
forms (``revisions``), posted here with that CSRF token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from ...errors import SlessError
from ...invocations.service import Invocations
from ...state.routes import RouteTable
from ...state.store import Store
from ...steps import NoSuchRevision, RollbackRefused
from ..access import COOKIE, CSRF_HEADER, Access
from .function import FunctionPage
from .html import (
    _CSS,
    _JS,
    _SIGNIN_JS,
    ASSETS,
    REFRESH_MS,
    Commit,
    Commits,
    Html,
    _asset_response,
    _h,
)
from .overview import Overview
from .queue import QueueReader
from .signin import _SIGNOUT, _form, _signin_routes, signin_page

__all__ = ["ASSETS", "REFRESH_MS", "Commit", "Commits", "Pages", "router", "signin_page"]


class Pages(Overview, FunctionPage):
    """Every page of the dashboard."""


def router(
    reconciler: Any,
    store: Store,
    repository: str,
    branch: str,
    poll_interval: float | None = None,
    access: Access | None = None,
    forge: str | None = None,
    scaling: Callable[[str, str], dict[str, Any] | None] | None = None,
    invocations: Invocations | None = None,
    routes: RouteTable | None = None,
    fn_url: str = "",
    trace_url: str = "",
) -> APIRouter:
    """The dashboard's routes: ``/``, ``/functions/{env}/{name}``, its two assets, sign-in.

    ``poll_interval`` (seconds) lets the header say when the next poll is due. ``access``
    (default: open reads, nothing to sign in to) decides who may see the pages. ``forge``
    (else guessed from the repository's URL) links a preview to its pull request.
    ``scaling(env, name)``: an autoscaled function's replicas and cold starts.
    ``invocations``: asynchronous invocations, whose counts and dead letters a function's
    page shows (and the overview a function's dead ones). ``trace_url``: a trace viewer's
    URL with ``{trace_id}`` in it (``--trace-url-template``), linked from each call.
    """
    access = access or Access(None)
    pages = Pages(reconciler, store, repository, branch, poll_interval, forge)
    pages.scaling = scaling
    pages.queue = QueueReader(invocations)
    pages.routes = routes or RouteTable()
    pages.fn_url, pages.trace_url = fn_url, trace_url
    routes = APIRouter(include_in_schema=False)

    def signout(request: Request) -> Html:
        """The sign-out button, for a browser signed in with a session; it carries the
        session's CSRF token, for the script's calls to /api/."""
        cookie = request.cookies.get(COOKIE)
        session = not access.open_reads and access.session_valid(cookie)
        csrf = access.csrf_token(cookie) if session else None
        return _h(_SIGNOUT, csrf=csrf, header=CSRF_HEADER) if csrf else Html("")

    @routes.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        query = request.query_params
        unready = query.get("functions") == "unready"
        return pages.index(signout(request), query.get("syncs"), unready)

    @routes.get("/functions/{env}/{name}", response_class=HTMLResponse)
    async def function(env: str, name: str, request: Request) -> HTMLResponse:
        # the dead letters are read on this loop, the service's (its methods are its
        # coroutines); the page, from the store and the mirror, in a worker thread
        queue = await pages.queue.read(env, name)
        cookie = request.cookies.get(COOKIE)
        csrf = access.csrf_token(cookie) if access.session_writes(cookie) else None
        return await run_in_threadpool(
            lambda: pages.function(env, name, signout(request), queue, csrf)
        )

    async def switch(env: str, name: str, request: Request, action: str) -> Response:
        """A rollback or an unpin from the function's page (see dashboard.revisions)."""
        form = await _form(request)
        refusal = access.form_refusal(request, (form or {}).get("csrf"))
        if refusal is None and env != reconciler.env:
            refusal = 409, f"{env} follows a pull request: a preview is never rolled back."
        if refusal is not None:
            status, message = refusal
            return pages.refused(env, name, message, status, signout(request))
        to = (form or {}).get("to") or None

        def act() -> None:
            revisions = reconciler.revisions
            if action == "rollback":
                reconciler.between_passes(lambda: revisions.rollback(name, to, "dashboard"))
            elif reconciler.between_passes(lambda: revisions.unpin(name, "dashboard")):
                reconciler.request_sync("unpin")
            else:
                raise RollbackRefused(f"{env}/{name} is not pinned")

        try:
            await run_in_threadpool(act)
        except SlessError as exc:
            status = {NoSuchRevision: 404, RollbackRefused: 409}.get(type(exc), 503)
            return pages.refused(env, name, str(exc), status, signout(request))
        return RedirectResponse(f"/functions/{env}/{name}", status_code=303)

    @routes.post("/functions/{env}/{name}/rollback")
    async def rollback(env: str, name: str, request: Request) -> Response:
        return await switch(env, name, request, "rollback")

    @routes.post("/functions/{env}/{name}/unpin")
    async def unpin(env: str, name: str, request: Request) -> Response:
        return await switch(env, name, request, "unpin")

    @routes.get(f"{ASSETS}/dashboard.css")
    def css() -> Response:
        return _asset_response(_CSS, "text/css; charset=utf-8")

    @routes.get(f"{ASSETS}/dashboard.js")
    def js() -> Response:
        return _asset_response(_JS, "text/javascript; charset=utf-8")

    @routes.get(f"{ASSETS}/signin.js")
    def signin_js() -> Response:
        return _asset_response(_SIGNIN_JS, "text/javascript; charset=utf-8")

    _signin_routes(routes, access)
    return routes
