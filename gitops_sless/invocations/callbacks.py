"""Callbacks: when an invocation submitted with ``X-Callback-Url`` ends (succeeded,
failed or dead), the reconciler POSTs its outcome to that URL, signed.

**What is sent.** A ``POST`` whose body is the function's response body as the record
keeps it (``invocation.response.body``, at most ``MAX_RESPONSE_BYTES``; empty when the
function never answered). The headers follow OpenFaaS's queue-worker, so a receiver
written for OpenFaaS's async callbacks works unchanged:

- ``X-Call-Id``: the invocation id (OpenFaaS: the call id its 202 returned).
- ``X-Function-Name``: the function's name alone. OpenFaaS sends the name as the call
  addressed it, ``name`` or ``name.namespace``; ours is a plain name, as OpenFaaS's is
  for a call without a namespace, and the environment is in ``X-Function-Env`` (an
  environment is not a Kubernetes namespace's name, so ``name.env`` would mislead).
- ``X-Function-Status``: the function's status code; **503** when it never answered
  (a dead invocation whose attempts all timed out or could not connect), which is what
  OpenFaaS's nats-queue-worker sends when the call fails without a response.
- ``X-Duration-Seconds``: how long the last attempt ran, ``%f`` as Go prints it
  (``0.002885``); 0 when no attempt ran (died of age in the queue).
- ``Content-Type``: the function's, when it gave one. OpenFaaS copies every response
  header of the function; we copy only this one, since others (``Content-Length``,
  ``Transfer-Encoding``, ``Set-Cookie``) describe another message or could pose as ours.
- Ours: ``X-Function-Env``, ``X-Invocation-Id`` (= ``X-Call-Id``),
  ``X-Invocation-Status`` (``succeeded``, ``failed`` or ``dead``),
  ``X-Response-Truncated: true`` when the body was cut, and ``X-Signature``.

**What is signed.** ``X-Signature: sha256=<hex>``, the lowercase hex HMAC-SHA256 of the
exact body bytes sent, keyed with the environment's callback secret as bytes (the
file's content without its trailing newline: a generated secret's key is its 64 hex
*characters*, not the 32 bytes they spell). That is Flux notification-controller's
``generic-hmac`` provider, so its receivers' verification code applies; :func:`verify`
is that code. As with Flux, only the body is signed, not the headers nor the URL.

**Where the secret lives** (:class:`CallbackSecrets`): the operator's
``<secrets-dir>/sless-callbacks/<env>``, the same one-file-per-key layout as every
secret on the local backend, for a secret a receiver already knows. A preview (``pr-N``)
reads only ``--preview-secrets-dir``: production's secret must never sign what a pull
request's code produced. Without such a file, 32 random bytes, hex-encoded, are written
once to ``<state-dir>/callback-secrets/<env>`` (mode 0600) and reused from then on, so a
callback is never unsigned; ``where(env)`` tells which file is in use.

**Where a callback may go** (:func:`refusal`, at submission, and again at every
delivery). http or https with a host; every address the host resolves to must be
globally reachable: loopback, link-local (the cloud metadata service at
169.254.169.254), private (RFC 1918, ULA), CGNAT, unspecified, multicast, reserved and
other special-purpose addresses are refused, IPv4 inside IPv6 (mapped, 6to4) is judged
by its IPv4, and so are the server's own addresses (``own``); an address inside one of
the operator's ``--callback-allow`` networks (``allowed``) is accepted whatever it is.

**DNS rebinding.** A name may resolve to a public address at submission and to
127.0.0.1 an hour later. So delivery resolves the name once more, checks those
addresses and connects to the checked address itself: the request's URL carries the IP,
``Host`` carries the name, and https's SNI and certificate check use the name (httpcore's
``sni_hostname``), so no second resolution happens between the check and the connection.
Redirects are never followed: a 3xx is a failed delivery, like any non-2xx, a timeout
or a connection error.

**Retries.** A failed delivery is tried again after ``backoff.delay`` (10 s doubling to
5 min), at most :data:`ATTEMPTS` (8) times in all: the last try is about 15 minutes
after the first. A URL refused at delivery is failed at once (retrying cannot make it
safe); a name that does not resolve is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from pathlib import Path

import httpx

from .. import backoff, logs
from ..manifests.model import is_preview
from .model import ENDED, Callback, Invocation

__all__ = [
    "ATTEMPTS",
    "NO_RESPONSE_STATUS",
    "SECRET_NAME",
    "CallbackSecrets",
    "Resolver",
    "deliver",
    "refusal",
    "resolve_host",
    "sign",
    "verify",
]

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network
# (host, port) -> its addresses; raises OSError (socket.gaierror) or TimeoutError
Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]

ATTEMPTS = 8
NO_RESPONSE_STATUS = 503  # X-Function-Status when the function never answered (OpenFaaS's)
RESOLVE_TIMEOUT_SEC = 5.0
SECRET_NAME = "sless-callbacks"  # <secrets-dir>/sless-callbacks/<env>
USER_AGENT = "gitops-sless-callbacks"

_RFC1918_ULA = tuple(
    ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)
_CGNAT = ip_network("100.64.0.0/10")


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, in the resolver's order of preference.

    getaddrinfo blocks, so it runs in the loop's executor; the wait is bounded so a slow
    DNS server cannot hold a request handler (the thread finishes on its own)."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_SEC
    )
    return list(dict.fromkeys(ip_address(info[4][0]) for info in infos))


class _Refused(Exception):
    """The URL may never be called (permanent)."""


class _Unresolved(Exception):
    """The host did not resolve now (transient at delivery)."""


@dataclass(frozen=True)
class _Target:
    url: httpx.URL
    host_header: str  # the name (and port) as the URL gave it
    sni: str | None  # the name for TLS; None for an IP literal
    addresses: tuple[IPAddress, ...]  # checked, in the order to try


async def refusal(
    url: str,
    allowed: Sequence[IPNetwork],
    own: Sequence[IPNetwork] = (),
    *,
    resolve: Resolver = resolve_host,
) -> str | None:
    """Why ``url`` may not be a callback URL (one line), or None if it may."""
    try:
        await _check(url, allowed, own, resolve)
    except (_Refused, _Unresolved) as exc:
        return str(exc)
    return None


async def _check(
    url: str, allowed: Sequence[IPNetwork], own: Sequence[IPNetwork], resolve: Resolver
) -> _Target:
    parsed = _parse(url)
    host = parsed.raw_host.decode("ascii")  # IDNA-encoded, as DNS wants it
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    literal = _literal(parsed.host)
    addresses = [literal] if literal else await _resolve(host, port, resolve)
    for address in addresses:
        why = _forbidden(address, allowed, own)
        if why is None:
            continue
        where = f"host {host} is" if literal else f"host {host} resolves to {address},"
        allow = f"--callback-allow {address}/{address.max_prefixlen}"
        raise _Refused(f"callback URL {where} {why}: refused (allow it with {allow})")
    netloc = f"[{host}]" if ":" in host else host
    return _Target(
        url=parsed,
        host_header=netloc if parsed.port is None else f"{netloc}:{parsed.port}",
        sni=None if literal else host,
        addresses=tuple(_unwrapped(a) for a in addresses),
    )


def _parse(url: str) -> httpx.URL:
    # parsed by the same code that sends the request, so the host checked is the
    # host called (no parser differential as between urllib and a client)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise _Refused(f"callback URL is not a valid URL: {_line(exc)}") from None
    if parsed.scheme not in ("http", "https"):
        raise _Refused(f"callback URL scheme {parsed.scheme or '(none)'!r} is not http or https")
    if not parsed.host:
        raise _Refused("callback URL has no host")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise _Refused(f"callback URL port {parsed.port} is out of range")
    return parsed


def _literal(host: str) -> IPAddress | None:
    try:
        return ip_address(host)
    except ValueError:
        return None


async def _resolve(host: str, port: int, resolve: Resolver) -> list[IPAddress]:
    try:
        addresses = list(await resolve(host, port))
    except TimeoutError:
        raise _Unresolved(f"callback URL host {host} did not resolve in time") from None
    except (OSError, UnicodeError) as exc:
        raise _Unresolved(f"callback URL host {host} does not resolve: {_line(exc)}") from None
    if not addresses:
        raise _Unresolved(f"callback URL host {host} has no address")
    return addresses


def _unwrapped(address: IPAddress) -> IPAddress:
    """The address to connect to: an IPv4-mapped one is its IPv4 (the same host by
    either name); a 6to4 one stays IPv6 (its IPv4 is a relay's, not the host's)."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _embedded(address: IPAddress) -> tuple[IPAddress, str]:
    """The IPv4 address that judges ``address``, and how it is carried in IPv6."""
    if isinstance(address, IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped, "IPv4-mapped "
        if address.sixtofour is not None:
            return address.sixtofour, "6to4 "
    return address, ""


def _forbidden(
    address: IPAddress, allowed: Sequence[IPNetwork], own: Sequence[IPNetwork]
) -> str | None:
    """Why a callback may not go to ``address`` (a noun phrase), or None."""
    inner, carried = _embedded(address)
    if any(a in net for net in allowed for a in (address, inner)):
        return None  # the operator's word overrides every rule below
    if any(a in net for net in own for a in (address, inner)):
        return "one of this server's own addresses"
    kind = _kind(inner)
    if kind is None:
        return None
    kind = carried + kind
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind} address"


def _kind(address: IPAddress) -> str | None:
    # most specific first: ipaddress counts loopback and link-local as private too
    checks = (
        (address.is_unspecified, "unspecified"),
        (address.is_loopback, "loopback"),
        (address.is_link_local, "link-local"),
        (address.is_multicast, "multicast"),
        (address in _CGNAT, "carrier-grade NAT (100.64.0.0/10)"),
        (any(address in net for net in _RFC1918_ULA), "private"),
        (isinstance(address, IPv6Address) and address.is_site_local, "site-local"),
        (address.is_reserved, "reserved"),
        (not address.is_global, "special-purpose (not globally reachable)"),
    )
    return next((kind for matched, kind in checks if matched), None)


def sign(body: bytes, secret: bytes) -> str:
    """The ``X-Signature`` value for ``body``: ``sha256=`` and the HMAC's hex digest."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(body: bytes, header: str, secret: bytes) -> bool:
    """Whether ``header`` (an ``X-Signature`` value) signs ``body`` with ``secret``.

    What a receiver writes: the HMAC of the raw body bytes as received (before any JSON
    parsing), compared in constant time."""
    algorithm, sep, digest = header.strip().partition("=")
    if not sep or algorithm.lower() != "sha256":
        return False
    try:
        given = bytes.fromhex(digest)
    except ValueError:
        return False
    return hmac.compare_digest(given, hmac.new(secret, body, hashlib.sha256).digest())


async def deliver(
    invocation: Invocation,
    *,
    secret: bytes,
    allowed: Sequence[IPNetwork],
    own: Sequence[IPNetwork],
    client: httpx.AsyncClient | None = None,
    timeout: float = 10.0,
    resolve: Resolver = resolve_host,
    clock: Callable[[], float] = time.time,
) -> Callback:
    """One delivery of an ended invocation's callback; its Callback as it now stands.

    ``delivered`` on a 2xx; else ``pending`` with ``next_at`` set for the next try, or
    ``failed`` after the :data:`ATTEMPTS`-th try or when the URL is refused now.

    A ``client`` given should not use HTTP/2 (``Connection: close`` is what keeps one
    https connection, verified for one host name, from carrying another name's
    callback to the same address); without one, a direct client is made for the call.
    """
    callback = invocation.callback
    if callback is None or invocation.status not in ENDED:
        raise ValueError(f"invocation {invocation.id} has no callback to deliver now")
    try:
        target = await _check(callback.url, allowed, own, resolve)
    except _Refused as exc:
        return replace(
            callback, state="failed", attempts=callback.attempts + 1, next_at=0.0, error=str(exc)
        )
    except _Unresolved as exc:
        return _attempt_failed(callback, str(exc), clock())
    body = invocation.response.body if invocation.response else b""
    headers = _headers(invocation, body, secret) | {"Host": target.host_header}
    if client is None:
        async with _client() as own_client:
            error = await _post(own_client, target, body, headers, timeout)
    else:
        error = await _post(client, target, body, headers, timeout)
    if error is not None:
        return _attempt_failed(callback, error, clock())
    return replace(
        callback, state="delivered", attempts=callback.attempts + 1, next_at=0.0, error=None
    )


def _attempt_failed(callback: Callback, error: str, now: float) -> Callback:
    attempts = callback.attempts + 1
    if attempts >= ATTEMPTS:
        return replace(callback, state="failed", attempts=attempts, next_at=0.0, error=error)
    return replace(
        callback,
        state="pending",
        attempts=attempts,
        next_at=now + backoff.delay(attempts),
        error=error,
    )


def _headers(invocation: Invocation, body: bytes, secret: bytes) -> dict[str, str]:
    response = invocation.response
    headers = {
        "User-Agent": USER_AGENT,
        "Connection": "close",
        "X-Call-Id": invocation.id,
        "X-Function-Name": invocation.function,
        "X-Function-Env": invocation.env,
        "X-Function-Status": str(response.status_code if response else NO_RESPONSE_STATUS),
        "X-Duration-Seconds": f"{_duration(invocation):f}",
        "X-Invocation-Id": invocation.id,
        "X-Invocation-Status": invocation.status,
        "X-Signature": sign(body, secret),
    }
    if response is not None:
        content_type = next((v for k, v in response.headers if k.lower() == "content-type"), None)
        if content_type:
            headers["Content-Type"] = content_type
        if response.truncated:
            headers["X-Response-Truncated"] = "true"
    return headers


def _duration(invocation: Invocation) -> float:
    last = invocation.attempts[-1] if invocation.attempts else None
    if last is None or last.ended is None:
        return 0.0
    return max(0.0, last.ended - last.started)


def _client() -> httpx.AsyncClient:
    # trust_env=False: no proxy from the environment, so the connection goes to the
    # checked address itself; no pooled connection outlives one delivery
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        limits=httpx.Limits(max_keepalive_connections=0),
    )


async def _post(
    client: httpx.AsyncClient,
    target: _Target,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
) -> str | None:
    """POST to the checked addresses in turn until one connects; None, or why it failed."""
    extensions = {"sni_hostname": target.sni} if target.sni else {}
    error = "no address to connect to"
    try:
        async with asyncio.timeout(timeout):  # the whole delivery, however a server trickles
            for address in target.addresses:
                url = target.url.copy_with(host=str(address), fragment=None)
                try:
                    return await _send(client, url, body, headers, extensions, timeout)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    error = f"could not connect to {target.host_header} at {address}: {_line(exc)}"
    except (TimeoutError, httpx.TimeoutException):
        return f"callback timed out after {timeout:g} s"
    except httpx.HTTPError as exc:
        return f"callback to {target.host_header} failed: {_line(exc)}"
    return error


async def _send(
    client: httpx.AsyncClient,
    url: httpx.URL,
    body: bytes,
    headers: dict[str, str],
    extensions: dict[str, str],
    timeout: float,
) -> str | None:
    # streamed and never read: a receiver's answer body is not ours to hold in memory
    async with client.stream(
        "POST",
        url,
        content=body,
        headers=headers,
        extensions=extensions,
        follow_redirects=False,
        timeout=timeout,
    ) as response:
        status = response.status_code
        if 200 <= status < 300:
            return None
        if 300 <= status < 400:
            return f"callback answered {status}, a redirect: not followed"
        return f"callback answered {status} {response.reason_phrase}".rstrip()


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class CallbackSecrets:
    """The key that signs each environment's callbacks (see the module's docstring)."""

    def __init__(
        self, secrets_dir: Path | None, preview_secrets_dir: Path | None, state_dir: Path
    ) -> None:
        self.secrets_dir = secrets_dir
        self.preview_secrets_dir = preview_secrets_dir
        self.state_dir = state_dir

    def secret(self, env: str) -> bytes:
        """The operator's secret for ``env`` if there is one, else the generated one."""
        configured = self._configured(env)
        if configured is not None:
            try:
                value = configured.read_bytes().removesuffix(b"\n")
            except FileNotFoundError:
                pass
            else:
                if not value:  # an empty key would sign with nothing anyone must know
                    raise ValueError(f"callback secret {configured} is empty")
                return _registered(value)
        return _registered(self._generated(env))

    def where(self, env: str) -> Path:
        """The file that holds the secret in use for ``env`` (generated: maybe not yet)."""
        configured = self._configured(env)
        if configured is not None and configured.is_file():
            return configured
        return self._generated_path(env)

    def _configured(self, env: str) -> Path | None:
        _check_env(env)
        # a preview runs a pull request's code: production's secret is never its key
        root = self.preview_secrets_dir if is_preview(env) else self.secrets_dir
        return None if root is None else root / SECRET_NAME / env

    def _generated_path(self, env: str) -> Path:
        _check_env(env)
        return self.state_dir / "callback-secrets" / env

    def _generated(self, env: str) -> bytes:
        path = self._generated_path(env)
        try:
            return path.read_bytes().removesuffix(b"\n")
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # written whole under a temporary name, then linked into place: a reader never
        # sees half a key, and link (unlike rename) never replaces a key that another
        # process or replica linked first, so every one of them signs with the same key
        tmp = path.with_name(f".{env}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(secrets.token_bytes(32).hex().encode("ascii") + b"\n")
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(FileExistsError):  # another writer won: its key is the key
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path.read_bytes().removesuffix(b"\n")


def _check_env(env: str) -> None:
    # the name becomes a file name: one plain path component, nothing else
    if not env or env in (".", "..") or "/" in env or "\0" in env or env.startswith("."):
        raise ValueError(f"environment name {env!r} cannot name a callback secret")


def _registered(value: bytes) -> bytes:
    logs.register_secret(value.decode("utf-8", "replace"))  # never printed in a log
    return value
