"""Who may read and who may write: the server's tokens, and browsers signed in with one.

Three levels. *Public*: ``/healthz``, ``/readyz``, the webhooks (each checks its
forge's signature), the dashboard's stylesheet and script, and the sign-in page
(``/fn/`` never reaches this app). *Read*: every other request, the dashboard's
pages, ``/metrics``, ``/docs`` and ``/openapi.json`` included, because job
results, build logs and messages hold whatever functions print. *Write*: the
calls that change something (``POST /api/v1/sync``, ``DELETE``), checked by
their routes with :meth:`Access.write_refusal`.

``api_token`` grants read and write, ``read_token`` read only. With neither (or
``anonymous_read``) reads are open; the command line allows that only on a
loopback address unless asked (:func:`open_reads_refusal`), and on the local
backend never without a token: it generates one (:mod:`tokenfile`), as functions
share the loopback. No request is admitted for the address it comes from.

A browser signs in by posting a token to ``/signin`` and gets a session cookie,
``<expiry>.<nonce>.<HMAC-SHA256>``: it never holds the token, it expires after
:data:`SESSION_SEC`, and its key is derived from the tokens, so every replica
that has them accepts it and changing a token ends every session. A session
reads only: writes need the bearer header, which a browser never adds on its
own, so a cross-site request could not write even if the cookie went with it.
Signing out clears the cookie and remembers its nonce until it expires; replicas
tell each other the nonces they remember (:meth:`Access.signed_out_text`, carried by
their member Leases on Kubernetes), so a copy of the cookie is refused by every
replica within a round of theirs (5 s).

The cookie alone reads the dashboard's own pages, never ``/api/``: a call there
with a session also needs :data:`CSRF_HEADER` holding the session's CSRF token
(:meth:`Access.csrf_token`, derived from the cookie and written into the
dashboard's pages for its script). A function's page served on the same origin
(``/fn/``) gets the cookie sent with its requests like any page there, but not
that token: a page it cannot read (its responses are sandboxed, see
:mod:`.proxy.http`) never shows it.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import ipaddress
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from ..proxy.http import SESSION_COOKIE, parse_networks, peer_of

__all__ = [
    "COOKIE",
    "CSRF_HEADER",
    "SESSION_SEC",
    "Access",
    "Level",
    "ReadGate",
    "is_loopback",
    "is_public",
    "open_reads_refusal",
]

COOKIE = SESSION_COOKIE  # named where the proxy can withhold it from functions
CSRF_HEADER = "x-sless-csrf"  # with a session, /api/ calls need it (Access.csrf_token)
API_PREFIX = "/api/"
SESSION_SEC = 12 * 3600
MAX_SIGNED_OUT = 10_000  # nonces of sessions signed out before they expire
SHARED_SIGNED_OUT = 2_000  # of them, the newest told to the other replicas (~80 KB)
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/signin", "/signout"})
# webhooks verify their own signatures; the assets are the dashboard's CSS and JS, no data;
# the runtimes' spans are taken with a replica's key (web.otlp)
PUBLIC_PREFIXES = ("/api/v1/webhooks/", "/dashboard/assets/", "/internal/otlp/")
BEARER_NEEDED = "a valid 'Authorization: Bearer <token>' header is required"
READ_REFUSED = f"{BEARER_NEEDED} to read (the read token or the API token), or sign in at /signin"
SESSION_NOT_API = (
    f"{BEARER_NEEDED}: a dashboard session reads /api/ only with the dashboard's "
    f"{CSRF_HEADER} header"
)


class Level(enum.IntEnum):
    NONE = 0
    READ = 1
    WRITE = 2


def is_public(path: str) -> bool:
    """Whether ``path`` is answered to anyone, token or not."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def is_loopback(host: str) -> bool:
    """``localhost`` or an address in 127.0.0.0/8 or ::1 (an IPv4-mapped one too)."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def open_reads_refusal(
    listen: str, host: str, api_token: str | None, read_token: str | None, anonymous_read: bool
) -> str | None:
    """Why serving on ``host`` (``--listen`` ``listen``) is refused, or None when it is not."""
    if api_token or read_token or anonymous_read or is_loopback(host):
        return None
    return (
        f"--listen {listen}: not a loopback address and no token is set, so anyone who can "
        "reach it could read every job result and log; set SLESS_READ_TOKEN or "
        "SLESS_API_TOKEN (--read-token, --api-token), or pass --anonymous-read to serve "
        "reads to anyone"
    )


def bearer(request: HTTPConnection) -> str | None:
    """The token of an ``Authorization: Bearer`` header; None without one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _same(given: str, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(given.encode(), (token or "").encode())


_WRITES = "w~"  # a session nonce's prefix: signed in with the API token ('~': never urlsafe)


class Access:
    """The tokens of one server and the sessions of browsers signed in to it."""

    def __init__(
        self,
        api_token: str | None,
        read_token: str | None = None,
        *,
        anonymous_read: bool = False,
        trusted_proxies: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api_token = api_token or None
        self.read_token = read_token or None
        self.open_reads = anonymous_read or not (self.api_token or self.read_token)
        self.trusted = parse_networks(trusted_proxies)
        self._clock = clock
        tokens = f"{self.api_token or ''}\0{self.read_token or ''}".encode()
        self._key = hashlib.sha256(b"gitops-sless session key\0" + tokens).digest()
        self._signed_out: dict[str, int] = {}  # nonce -> expiry, oldest first
        self._signed_out_lock = threading.Lock()
        # called after a sign-out: the other replicas learn it sooner (see signed_out_text)
        self.on_sign_out: Callable[[], None] | None = None

    # --- tokens ------------------------------------------------------------------------

    def token_level(self, given: str) -> Level:
        if _same(given, self.api_token):
            return Level.WRITE
        return Level.READ if _same(given, self.read_token) else Level.NONE

    def read_refusal(self, request: HTTPConnection) -> str | None:
        """Why ``request`` may not read, or None when it may."""
        if self.open_reads:
            return None
        token = bearer(request)
        if token is not None and self.token_level(token) >= Level.READ:
            return None
        cookie = request.cookies.get(COOKIE)
        if self.session_valid(cookie):
            if not request.url.path.startswith(API_PREFIX) or self._csrf_sent(request, cookie):
                return None
            return SESSION_NOT_API
        # a write is checked again by its route: this one says what either needs
        return READ_REFUSED if request.scope.get("method") in ("GET", "HEAD") else BEARER_NEEDED

    def csrf_token(self, cookie: str | None) -> str | None:
        """The CSRF token of a valid session cookie (None without one): what the
        dashboard's script sends in :data:`CSRF_HEADER` for /api/ calls."""
        found = self._session(cookie)
        if found is None:
            return None
        return self._sign(f"csrf\0{found[1]}")

    def _csrf_sent(self, request: HTTPConnection, cookie: str | None) -> bool:
        sent, expected = request.headers.get(CSRF_HEADER, ""), self.csrf_token(cookie)
        return bool(sent and expected) and hmac.compare_digest(sent.encode(), expected.encode())

    def write_refusal(self, token: str | None) -> tuple[int, str] | None:
        """(status, reason) when the bearer ``token`` may not change anything; None when it may.

        401 says who are you (no token, or a wrong one), 403 you may not (no API token is
        configured, or the token given is the read token). A session cookie never writes
        through the API; a session signed in with the API token may post the dashboard's own
        forms (see :meth:`form_refusal`).
        """
        if not self.api_token:
            return 403, "mutating API calls are disabled: no API token is configured"
        level = self.token_level(token or "")
        if level == Level.WRITE:
            return None
        if level == Level.READ:
            return 403, "the read token cannot change anything: this call needs the API token"
        return 401, BEARER_NEEDED

    # --- sessions ----------------------------------------------------------------------

    def new_session(self, write: bool = False) -> str:
        """A signed session cookie; ``write``: signed in with the API token, so the
        dashboard's own forms (a rollback, an unpin) may change things with it."""
        nonce = (_WRITES if write else "") + secrets.token_urlsafe(18)
        payload = f"{int(self._clock()) + SESSION_SEC}.{nonce}"
        return f"{payload}.{self._sign(payload)}"

    def session_valid(self, cookie: str | None) -> bool:
        found = self._session(cookie)
        return found is not None and found[1] not in self._signed_out

    def session_writes(self, cookie: str | None) -> bool:
        """A valid session that was signed in with the API token (the nonce says so, and
        the signature covers it: a read session cannot make itself one)."""
        found = self._session(cookie)
        return self.session_valid(cookie) and found is not None and found[1].startswith(_WRITES)

    def form_refusal(self, request: HTTPConnection, csrf: str | None) -> tuple[int, str] | None:
        """(status, reason) when a dashboard form that changes something may not; None
        when it may: from one of this server's pages, a session signed in with the API
        token, and the session's CSRF token in the form."""
        if not self.same_origin(request):
            return 403, "Refused: the form was sent by another site."
        cookie = request.cookies.get(COOKIE)
        if not self.api_token:
            return 403, "Refused: no API token is configured, so nothing may be changed."
        if not self.session_writes(cookie):
            return 403, "Refused: sign in with the API token to change anything."
        expected = self.csrf_token(cookie)
        if not (csrf and expected and hmac.compare_digest(csrf.encode(), expected.encode())):
            return 403, "Refused: the form is stale; load the page again."
        return None

    def end_session(self, cookie: str | None) -> None:
        found = self._session(cookie)
        if found is None:
            return
        self._remember({found[1]: found[0]})
        if self.on_sign_out is not None:
            self.on_sign_out()

    def _remember(self, ended: dict[str, int]) -> None:
        now = self._clock()
        with self._signed_out_lock:
            for nonce, expiry in list(self._signed_out.items()):
                if expiry <= now:
                    del self._signed_out[nonce]
            for nonce, expiry in ended.items():
                if expiry <= now or nonce in self._signed_out:
                    continue
                while len(self._signed_out) >= MAX_SIGNED_OUT:
                    self._signed_out.pop(next(iter(self._signed_out)))
                self._signed_out[nonce] = expiry

    def signed_out_text(self) -> str:
        """The newest sessions signed out here or learnt from others, as JSON
        ``{nonce: expiry}``: what this replica tells the others (on Kubernetes, in its
        member Lease), so that a sign-out on one replica ends the session on all of them
        (and on one started later, while any replica still remembers it)."""
        now = self._clock()
        with self._signed_out_lock:
            live = [(n, e) for n, e in self._signed_out.items() if e > now]
        return json.dumps(dict(live[-SHARED_SIGNED_OUT:]), separators=(",", ":"))

    def learn_signed_out(self, text: str) -> None:
        """What another replica's :meth:`signed_out_text` said; anything else is ignored
        (a session is never revived: only ended)."""
        try:
            data = json.loads(text)
        except ValueError:
            return
        if isinstance(data, dict):
            ended = {
                n: e
                for n, e in data.items()
                if isinstance(n, str) and len(n) <= 64 and type(e) is int
            }
            self._remember(ended)

    def _session(self, cookie: str | None) -> tuple[int, str] | None:
        """(expiry, nonce) of a cookie this server signed that has not expired."""
        payload, _, signature = (cookie or "").rpartition(".")
        expiry, _, nonce = payload.partition(".")
        if not (nonce and expiry.isdigit()):
            return None
        if not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            return None
        return (int(expiry), nonce) if int(expiry) > self._clock() else None

    def _sign(self, payload: str) -> str:
        digest = hmac.new(self._key, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    # --- where a request came from -------------------------------------------------------

    def _from_trusted_proxy(self, request: HTTPConnection) -> bool:
        client = request.client
        return bool(client and self.trusted and peer_of(client.host, self.trusted).trusted)

    def is_https(self, request: HTTPConnection) -> bool:
        """Over TLS here, or at a trusted proxy in front that says so (X-Forwarded-Proto)."""
        if request.url.scheme == "https":
            return True
        proto = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
        return proto == "https" and self._from_trusted_proxy(request)

    def same_origin(self, request: HTTPConnection) -> bool:
        """Whether a form post came from one of this server's own pages.

        Browsers send Origin with every POST (Referer where an old one does not); a
        client that sends neither is not a browser, so no other site can have sent it.
        """
        source = request.headers.get("origin") or request.headers.get("referer")
        if source is None:
            return True
        hosts = {request.headers.get("host", "")}
        if self._from_trusted_proxy(request):
            hosts.add(request.headers.get("x-forwarded-host", "").split(",")[0].strip())
        netloc = urlsplit(source).netloc if source != "null" else ""
        return bool(netloc) and netloc.lower() in {h.lower() for h in hosts if h}

    def set_session(self, response: Response, request: HTTPConnection, write: bool = False) -> None:
        response.set_cookie(
            COOKIE,
            self.new_session(write),
            max_age=SESSION_SEC,
            path="/",
            secure=self.is_https(request),
            httponly=True,
            samesite="strict",
        )

    def clear_session(self, response: Response, request: HTTPConnection) -> None:
        self.end_session(request.cookies.get(COOKIE))
        response.delete_cookie(
            COOKIE, path="/", secure=self.is_https(request), httponly=True, samesite="strict"
        )


Scope = MutableMapping[str, Any]


class ReadGate:
    """ASGI middleware: a request that is not public needs the read level, whatever route.

    Closed by default, so a route added later is never readable anonymously by mistake.
    A browser (a GET that accepts HTML) is shown ``signin_page`` instead of the JSON 401.
    """

    def __init__(
        self, app: Any, access: Access, signin_page: Callable[[Request], Response]
    ) -> None:
        self.app = app
        self.access = access
        self.signin_page = signin_page

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.access.open_reads or is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        refusal = self.access.read_refusal(HTTPConnection(scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if kind == "websocket":  # none today; one added later is closed like the rest
            await send({"type": "websocket.close", "code": 1008, "reason": refusal})
            return
        request = Request(scope)
        # (signed in already, a browser at /api/ is told why: the form would bring it back)
        browser = (
            scope["method"] in ("GET", "HEAD")
            and "text/html" in request.headers.get("accept", "")
            and refusal != SESSION_NOT_API
        )
        response = (
            self.signin_page(request)
            if browser
            else JSONResponse(
                {"error": refusal}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
            )
        )
        await response(scope, receive, send)
