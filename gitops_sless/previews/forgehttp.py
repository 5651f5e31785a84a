"""HTTP to a forge's REST API: the token header, bounded waits, pages and typed errors.

One :class:`ForgeHttp` per forge, over a sync httpx client with short timeouts. A
rate-limited answer (429, or 403 with ``Retry-After`` or an exhausted
``X-RateLimit-Remaining``/``RateLimit-Remaining`` and its reset time, read on the
server's clock) is waited out within a bounded budget and retried; 5xx and network
errors are retried with backoff when resending cannot duplicate anything. What is
left becomes ``ForgeUnavailable`` (403, 429, 5xx, network: try later) or
``ForgeRefused`` (401, 404, other 4xx: fix the token or the URL), one line each,
with registered secrets masked. Redirects are not followed and later pages are
asked of the configured base, never of the host a ``Link`` names, so the token
goes nowhere else.
"""

from __future__ import annotations

import email.utils
import functools
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx

from .. import logs
from ..errors import ForgeRefused, ForgeUnavailable

__all__ = ["ForgeHttp", "error_message"]

log = logging.getLogger(__name__)

_MAX_PAGES = 100  # 10 000 pull requests: a longer list is refused, never cut short
# one TLS context for every client: building one reads the CA bundle (a tenth of a second);
# httpx's own rules pick it (SSL_CERT_FILE / SSL_CERT_DIR, else certifi)
_tls = functools.cache(httpx.create_ssl_context)


def _server_now(resp: httpx.Response) -> float:
    """The server's clock (its Date header) when it has one: reset times are on it."""
    try:
        return email.utils.parsedate_to_datetime(resp.headers["date"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return time.time()


def _rate_limit_wait(resp: httpx.Response) -> float | None:
    """Seconds the forge asks us to wait before retrying, or None when it does not say."""
    headers = resp.headers
    retry_after = headers.get("retry-after", "").strip()
    if retry_after.isdigit():
        return float(retry_after)
    if retry_after:
        try:
            when = email.utils.parsedate_to_datetime(retry_after).timestamp()
            return max(0.0, when - _server_now(resp))
        except (TypeError, ValueError):
            pass
    remaining = headers.get("x-ratelimit-remaining", headers.get("ratelimit-remaining", ""))
    reset = headers.get("x-ratelimit-reset", headers.get("ratelimit-reset", "")).strip()
    if remaining.strip() == "0" and reset.isdigit():
        return max(1.0, int(reset) - _server_now(resp))
    return None


def error_message(resp: httpx.Response) -> str:
    """What the forge says went wrong (its JSON ``message``/``error``), cut to 200 chars."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        return str(data.get("message") or data.get("error") or "")[:200]
    return ""


def _next_query(resp: httpx.Response, query: dict[str, Any], count: int) -> dict[str, Any] | None:
    """The query of the next page: from ``Link``, ``X-Next-Page``, or a full page."""
    if "link" in resp.headers:
        following = resp.links.get("next", {}).get("url")
        return {**query, **dict(parse_qsl(urlsplit(following).query))} if following else None
    if "x-next-page" in resp.headers:
        page = resp.headers["x-next-page"].strip()
        return {**query, "page": page} if page else None
    size = int(query.get("per_page") or query.get("limit") or 0)
    return {**query, "page": int(query.get("page", 1)) + 1} if size and count >= size else None


class ForgeHttp:
    """One forge's HTTP API: auth header, short timeouts, bounded waits, typed errors."""

    def __init__(
        self,
        kind: str,
        base_url: str,
        headers: dict[str, str],
        *,
        timeout: float,
        max_wait: float,
        retries: int,
        backoff: float,
        sleep: Callable[[float], None],
    ) -> None:
        self.kind = kind
        self._client = httpx.Client(
            base_url=base_url,
            headers={"User-Agent": "gitops-sless", **headers},
            timeout=timeout,
            verify=_tls(),
            follow_redirects=False,  # a redirect could carry the token to another host
        )
        self._max_wait, self._retries = max_wait, retries
        self._backoff, self._sleep = backoff, sleep

    def close(self) -> None:
        self._client.close()

    def line(self, method: str, path: str, what: str) -> str:
        """One log/error line about a call, whitespace collapsed, secrets masked."""
        return logs.redact(" ".join(f"{self.kind} API {method} {path}: {what}".split()))

    def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
        repeatable: bool = True,
        accept: tuple[int, ...] = (),
    ) -> httpx.Response:
        """The answer to one request; ``repeatable`` False: never resent after a 5xx."""
        waited = 0.0
        for attempt in range(self._retries + 1):
            asked: float | None = None  # what a rate-limited answer asks us to wait
            try:
                resp = self._client.request(method, path, params=params, json=body)
            except httpx.RequestError as exc:
                what, status = f"{type(exc).__name__}: {exc}", 0
            else:
                status = resp.status_code
                if status < 300 or status in accept:
                    return resp
                what = f"{status} {resp.reason_phrase}: {error_message(resp)}".rstrip(": ")
                if status in (403, 429):
                    asked = _rate_limit_wait(resp)
                elif status < 500:
                    raise ForgeRefused(self.line(method, path, what))
            if asked is not None:
                wait = asked
            elif status in (403, 429) or not repeatable:  # not a rate limit / maybe done
                raise ForgeUnavailable(self.line(method, path, what))
            else:  # a 5xx or a network error
                wait = self._backoff * 2**attempt
            if attempt == self._retries or waited + wait > self._max_wait:
                later = f"; the forge asks to wait {asked:.0f}s" if asked is not None else ""
                raise ForgeUnavailable(self.line(method, path, what + later))
            retry = self.line(method, path, f"{what}; retrying in {wait:.1f}s")
            logs.event(log, "forge.retry", retry, level=logging.INFO)
            self._sleep(wait)
            waited += wait
        raise AssertionError("unreachable")

    def json(self, resp: httpx.Response) -> Any:
        """The body of ``resp`` as JSON; a body that is not is ForgeUnavailable."""
        try:
            return resp.json()
        except ValueError:
            what = f"answered {resp.status_code} with a body that is not JSON"
            raise ForgeUnavailable(self.line(resp.request.method, resp.url.path, what)) from None

    def get_all(self, path: str, query: dict[str, Any]) -> list[Any]:
        """Every item of a paged list: ``Link`` next, else ``X-Next-Page``, else full pages."""
        items: list[Any] = []
        for _ in range(_MAX_PAGES):
            resp = self.call("GET", path, params=query)
            page = self.json(resp)
            if not isinstance(page, list):
                raise ForgeUnavailable(self.line("GET", path, "answered something not a list"))
            items.extend(page)
            following = _next_query(resp, query, len(page))
            if following is None:
                return items
            query = following
        raise ForgeRefused(self.line("GET", path, f"more than {_MAX_PAGES} pages; not read"))
