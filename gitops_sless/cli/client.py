"""The command line's HTTP client of a running ``gitops-sless serve``.

One place that knows the server's URL, the bearer token and what each failure
means for a person at a terminal: a server that cannot be reached, a token
that is missing or wrong, an answer that is not the API's. Every failure is a
``ClientError`` with one line to print; nothing here prints.

Reads send ``SLESS_READ_TOKEN`` when it is set, else ``SLESS_API_TOKEN``;
writes send ``SLESS_API_TOKEN``. Neither ever goes through the ``/fn/`` proxy
to a function.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

import gitops_sless

__all__ = ["DEFAULT_SERVER", "Client", "ClientError", "NotFound", "server_url"]

DEFAULT_SERVER = "http://127.0.0.1:8080"
TIMEOUT_SEC = 30.0


class ClientError(Exception):
    """The server could not be asked, or refused: one line for the terminal."""


class NotFound(ClientError):
    """The server answered 404: no such function, build or environment."""


def server_url(value: str | None = None) -> str:
    """``--server``, else ``$SLESS_SERVER``, else the default; checked to be an http(s) URL."""
    url = (value or os.environ.get("SLESS_SERVER") or DEFAULT_SERVER).strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return url


def segment(value: str) -> str:
    """``value`` as one path segment of a URL."""
    return quote(value, safe="")


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return response.reason_phrase or f"HTTP {response.status_code}"


def _is_read(method: str, path: str) -> bool:
    """A call that only reads: a GET, or a diff (posted, but it changes nothing)."""
    return method in ("GET", "HEAD") or path.split("?")[0].endswith("/diff")


class Client:
    """Calls to one server. ``token``: the API token; ``read_token``: for reads (not /fn/)."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        timeout: float = TIMEOUT_SEC,
        read_token: str | None = None,
    ):
        self.server = server.rstrip("/")
        self.token = token or None
        self.read_token = read_token or None
        self._http = httpx.Client(
            base_url=self.server,
            timeout=timeout,
            headers={"User-Agent": f"gitops-sless/{gitops_sless.__version__}"},
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the API ---------------------------------------------------------------------

    def api(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """One API call; the answer's JSON. Raises ClientError (NotFound for a 404)."""
        reads = _is_read(method, path)
        token = (self.read_token or self.token) if reads else self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        extra = {} if timeout is None else {"timeout": timeout}
        response = self._send(
            method, path, params=params, json=json, headers=headers, what="the API", **extra
        )
        self._check(response, reads)
        try:
            return response.json()
        except ValueError:
            raise ClientError(
                f"{self.server} answered {path} with something that is not the gitops-sless API"
            ) from None

    def get(self, path: str, **params: Any) -> Any:
        return self.api("GET", path, params=params or None)

    def _check(self, response: httpx.Response, reads: bool = False) -> None:
        if response.is_success:
            return
        status, message = response.status_code, _error_text(response)
        if status == 401:
            raise ClientError(self._refused_token(message, reads))
        if status == 403:
            raise ClientError(
                f"refused: {message} (start the server with --api-token or SLESS_API_TOKEN, "
                "then set SLESS_API_TOKEN here too)"
            )
        if status == 404:
            raise NotFound(message)
        raise ClientError(f"the server answered {status}: {message}")

    def _refused_token(self, message: str, reads: bool) -> str:
        """What to set after a 401, for a read (either token) or a write (the API token)."""
        sent = (self.read_token or self.token) if reads else self.token
        if reads:
            if sent:
                return (
                    f"the server refused the token ({message}): set SLESS_READ_TOKEN or "
                    "SLESS_API_TOKEN to a token the server was started with (--read-token, "
                    "--api-token)"
                )
            return (
                f"this server needs a token to read ({message}): set SLESS_READ_TOKEN or "
                "SLESS_API_TOKEN"
            )
        if sent:
            return (
                f"the server refused the API token ({message}): set SLESS_API_TOKEN to "
                "the token the server was started with (--api-token)"
            )
        return f"this needs the server's API token ({message}): set SLESS_API_TOKEN"

    # --- the proxy -------------------------------------------------------------------------

    def invoke(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """A call through /fn/; any status is returned, only transport failures raise."""
        extra = {} if timeout is None else {"timeout": timeout}
        return self._send(
            method, path, content=content, headers=headers or {}, what="the function", **extra
        )

    # --- transport -----------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, what: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise ClientError(
                f"cannot reach the server at {self.server} ({_reason(exc)}): is "
                "`gitops-sless serve` running there? (--server URL or SLESS_SERVER)"
            ) from None
        except httpx.TimeoutException:
            timeout = kwargs.get("timeout", self._http.timeout.read)
            raise ClientError(
                f"{what} at {self.server} did not answer within {timeout:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise ClientError(f"talking to {self.server} failed: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return text or type(exc).__name__
