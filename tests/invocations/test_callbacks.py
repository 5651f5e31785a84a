"""Callbacks: what a receiver gets, how failures are retried, and where a callback may
never go (SSRF, DNS rebinding), with real HTTP servers on loopback."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from gitops_sless.invocations.callbacks import (
    ATTEMPTS,
    CallbackSecrets,
    deliver,
    refusal,
    resolve_host,
    sign,
    verify,
)
from gitops_sless.invocations.model import Attempt, Callback, Invocation, Response

SECRET = b"s3cret-callback-key"
LOOPBACK = [ip_network("127.0.0.0/8")]
PUBLIC = "93.184.215.14"  # a globally routable address no test ever connects to
NOW = 1_000_000.0
ANSWER = Response(
    200, (("Content-Type", "application/json"), ("Set-Cookie", "a=b")), b'{"total": 42}'
)


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lowercase names
    body: bytes


class Receiver:
    """A real HTTP server on 127.0.0.1 that records each request and answers the next
    of ``answers`` (status, headers), then 200."""

    def __init__(
        self,
        answers: Sequence[tuple[int, dict[str, str]]] = (),
        *,
        tls: ssl.SSLContext | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        self.requests: list[Received] = []
        self.answers = list(answers)
        self.hold = hold
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests.append(
                    Received(
                        self.command,
                        self.path,
                        {k.lower(): v for k, v in self.headers.items()},
                        body,
                    )
                )
                if receiver.hold is not None:
                    receiver.hold.wait(10)
                status, headers = receiver.answers.pop(0) if receiver.answers else (200, {})
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        # a short poll: shutdown() waits for serve_forever to look again
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    """Receivers a test starts (``receivers.append(Receiver(...))``), all stopped after."""
    started: list[Receiver] = []
    yield started
    for one in started:
        one.close()


def start(receivers: list[Receiver], *args: object, **kwargs: object) -> Receiver:
    receivers.append(Receiver(*args, **kwargs))  # type: ignore[arg-type]
    return receivers[-1]


class FakeDNS:
    """A resolver to inject: names to addresses, changeable mid-test; records the asks."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list:
        self.asked.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ip_address(a) for a in self.table[host]]


def ended(
    url: str,
    *,
    status: str = "succeeded",
    response: Response | None = ANSWER,
    attempts: int = 0,
) -> Invocation:
    return Invocation(
        id="01hx0000000000000000000000",
        env="prod",
        function="orders",
        method="POST",
        path="/",
        headers=(),
        body=b"{}",
        created=NOW - 10,
        status=status,
        attempts=(Attempt(1, NOW - 5, NOW - 3.5, response.status_code if response else None),),
        response=response,
        ended=NOW - 3.5,
        callback=Callback(url, state="pending", attempts=attempts),
    )


def run_deliver(
    invocation: Invocation, *, client: Callable[[], httpx.AsyncClient] | None = None, **kwargs: Any
) -> Callback:
    """One delivery, through a client that ``client()`` makes (default: deliver's own)."""
    options = {"secret": SECRET, "allowed": LOOPBACK, "own": (), "clock": lambda: NOW} | kwargs

    async def go() -> Callback:
        if client is None:
            return await deliver(invocation, **options)
        async with client() as made:
            return await deliver(invocation, client=made, **options)

    return asyncio.run(go())


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- what a receiver gets -------------------------------------------------------------


def test_the_callback_arrives_with_the_body_and_every_header(receivers: list[Receiver]) -> None:
    receiver = start(receivers)
    callback = run_deliver(ended(receiver.url("/hook?order=7")))

    assert callback == Callback(receiver.url("/hook?order=7"), "delivered", 1, 0.0, None)
    [got] = receiver.requests
    assert (got.method, got.path, got.body) == ("POST", "/hook?order=7", b'{"total": 42}')
    assert got.headers["host"] == f"127.0.0.1:{receiver.port}"
    assert (
        got.headers["x-call-id"] == got.headers["x-invocation-id"] == "01hx0000000000000000000000"
    )
    assert got.headers["x-function-name"] == "orders"
    assert got.headers["x-function-env"] == "prod"
    assert got.headers["x-function-status"] == "200"
    assert got.headers["x-invocation-status"] == "succeeded"
    assert got.headers["x-duration-seconds"] == "1.500000"
    assert got.headers["content-type"] == "application/json"
    assert "set-cookie" not in got.headers  # only the function's Content-Type is passed on
    assert "x-response-truncated" not in got.headers
    assert got.headers["x-signature"] == sign(got.body, SECRET)
    assert got.headers["x-signature"].startswith("sha256=")
    assert verify(got.body, got.headers["x-signature"], SECRET)
    assert not verify(got.body, got.headers["x-signature"], b"another secret")
    assert not verify(got.body + b" ", got.headers["x-signature"], SECRET)


def test_a_dead_invocation_that_never_got_an_answer_reports_503_and_an_empty_body(
    receivers: list[Receiver],
) -> None:
    receiver = start(receivers)
    callback = run_deliver(ended(receiver.url(), status="dead", response=None))

    assert callback.state == "delivered"
    [got] = receiver.requests
    assert got.body == b""
    assert got.headers["x-function-status"] == "503"  # as OpenFaaS's queue-worker sends
    assert got.headers["x-invocation-status"] == "dead"
    assert "content-type" not in got.headers
    assert verify(b"", got.headers["x-signature"], SECRET)


def test_a_truncated_body_says_so(receivers: list[Receiver]) -> None:
    receiver = start(receivers)
    response = Response(500, (), b"x" * 10, truncated=True)
    run_deliver(ended(receiver.url(), status="failed", response=response))

    [got] = receiver.requests
    assert (got.headers["x-response-truncated"], got.headers["x-function-status"]) == (
        "true",
        "500",
    )


@pytest.mark.parametrize(
    "header",
    [
        pytest.param("", id="empty"),
        pytest.param("sha1=00", id="other-algorithm"),
        pytest.param("sha256=zz", id="not-hex"),
        pytest.param("sha256=", id="no-digest"),
        pytest.param(sign(b"body", SECRET).removeprefix("sha256="), id="no-prefix"),
    ],
)
def test_verify_refuses_a_malformed_signature(header: str) -> None:
    assert not verify(b"body", header, SECRET)


def test_verify_takes_flux_style_uppercase_hex() -> None:
    assert verify(b"body", "sha256=" + sign(b"body", SECRET)[7:].upper(), SECRET)


# --- retries ----------------------------------------------------------------------------


def test_a_receiver_answering_500_then_200_gets_it_on_the_second_try(
    receivers: list[Receiver],
) -> None:
    receiver = start(receivers, [(500, {})])
    invocation = ended(receiver.url())

    first = run_deliver(invocation)
    assert (first.state, first.attempts, first.next_at) == ("pending", 1, NOW + 10)
    assert first.error == "callback answered 500 Internal Server Error"

    second = run_deliver(invocation.evolve(callback=first), clock=lambda: NOW + 10)
    assert (second.state, second.attempts, second.error) == ("delivered", 2, None)
    assert len(receiver.requests) == 2


@pytest.mark.parametrize(
    ("before", "delay"),
    [(0, 10), (1, 20), (2, 40), (3, 80), (4, 160), (5, 300), (6, 300)],
)
def test_failed_deliveries_back_off_from_10_s_doubling_to_5_minutes(
    before: int, delay: int
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/"
    callback = run_deliver(ended(url, attempts=before))

    assert (callback.state, callback.attempts, callback.next_at) == (
        "pending",
        before + 1,
        NOW + delay,
    )
    assert callback.error is not None and callback.error.startswith(
        "could not connect to 127.0.0.1"
    )
    assert "\n" not in callback.error


def test_the_last_attempt_fails_for_good(receivers: list[Receiver]) -> None:
    receiver = start(receivers, [(503, {})])
    callback = run_deliver(ended(receiver.url(), attempts=ATTEMPTS - 1))

    assert (callback.state, callback.attempts, callback.next_at) == ("failed", ATTEMPTS, 0.0)
    assert callback.error == "callback answered 503 Service Unavailable"


def test_a_redirect_is_not_followed_and_counts_as_a_failure(receivers: list[Receiver]) -> None:
    target = start(receivers)
    redirecting = start(receivers, [(302, {"Location": target.url("/stolen")})])
    callback = run_deliver(ended(redirecting.url()))

    assert (callback.state, callback.attempts) == ("pending", 1)
    assert callback.error == "callback answered 302, a redirect: not followed"
    assert len(redirecting.requests) == 1
    assert target.requests == []


def test_a_receiver_that_does_not_answer_in_time_is_retried(receivers: list[Receiver]) -> None:
    receiver = start(receivers, hold=threading.Event())
    callback = run_deliver(ended(receiver.url()), timeout=0.2)

    assert (callback.state, callback.error) == ("pending", "callback timed out after 0.2 s")


def test_a_name_that_does_not_resolve_at_delivery_is_retried() -> None:
    dns = FakeDNS({})
    callback = run_deliver(ended("http://gone.test/hook"), resolve=dns)

    assert (callback.state, callback.next_at) == ("pending", NOW + 10)
    assert (
        callback.error
        == "callback URL host gone.test does not resolve: [Errno -2] Name or service not known"
    )


# --- the address connected to is the address checked ----------------------------------


def test_a_name_is_resolved_once_and_its_checked_address_is_the_one_connected(
    receivers: list[Receiver],
) -> None:
    receiver = start(receivers)
    dns = FakeDNS({"receiver.test": ["127.0.0.1"]})  # not in any real DNS
    url = f"http://receiver.test:{receiver.port}/hook"
    callback = run_deliver(ended(url), resolve=dns)

    assert callback.state == "delivered"
    assert dns.asked == ["receiver.test"]
    [got] = receiver.requests
    assert got.headers["host"] == f"receiver.test:{receiver.port}"


@pytest.mark.parametrize(
    ("certified", "delivered"),
    [
        pytest.param("receiver.test", True, id="right-name"),
        pytest.param("elsewhere.test", False, id="wrong-name"),
    ],
)
def test_https_checks_the_certificate_against_the_name_not_the_address(
    receivers: list[Receiver], certified: str, delivered: bool
) -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(certified).configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    receiver = start(receivers, tls=server_tls)
    url = f"https://receiver.test:{receiver.port}/hook"

    callback = run_deliver(
        ended(url),
        client=lambda: httpx.AsyncClient(verify=client_tls, trust_env=False),
        resolve=FakeDNS({"receiver.test": ["127.0.0.1"]}),
    )
    if delivered:
        assert callback.state == "delivered"
        assert receiver.requests[0].headers["host"] == f"receiver.test:{receiver.port}"
    else:
        assert callback.state == "pending"
        assert "CERTIFICATE_VERIFY_FAILED" in (callback.error or "")
        assert receiver.requests == []


def test_dns_rebinding_after_submission_delivers_nothing(receivers: list[Receiver]) -> None:
    victim = start(receivers)  # a loopback service the attacker wants to reach
    dns = FakeDNS({"rebind.test": [PUBLIC]})
    url = f"http://rebind.test:{victim.port}/admin"
    assert asyncio.run(refusal(url, [], (), resolve=dns)) is None  # accepted at submission

    dns.table["rebind.test"] = ["127.0.0.1"]
    callback = run_deliver(ended(url), allowed=[], resolve=dns)

    assert callback.state == "failed"  # refused now: retrying cannot make it safe
    assert callback.error == (
        "callback URL host rebind.test resolves to 127.0.0.1, a loopback address: "
        "refused (allow it with --callback-allow 127.0.0.1/32)"
    )
    assert victim.requests == []


@pytest.mark.parametrize(
    ("url", "table"),
    [
        pytest.param("http://169.254.169.254/latest/meta-data/", {}, id="metadata-literal"),
        pytest.param(
            "http://metadata.test/latest/meta-data/",
            {"metadata.test": ["169.254.169.254"]},
            id="metadata-name",
        ),
        pytest.param("http://[::ffff:169.254.169.254]/", {}, id="metadata-mapped"),
    ],
)
def test_the_metadata_service_receives_nothing(url: str, table: dict[str, list[str]]) -> None:
    sent: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(200))

    callback = run_deliver(
        ended(url), client=lambda: httpx.AsyncClient(transport=transport), resolve=FakeDNS(table)
    )
    assert callback.state == "failed"
    assert "link-local address: refused" in (callback.error or "")
    assert sent == []


@pytest.mark.parametrize(
    "host",
    [
        pytest.param("127.0.0.1", id="literal"),
        pytest.param("localhost", id="localhost"),
        pytest.param("2130706433", id="decimal-form"),
        pytest.param("0x7f.1", id="hex-form"),
    ],
)
def test_a_loopback_service_receives_nothing_unless_allowed(
    receivers: list[Receiver], host: str
) -> None:
    victim = start(receivers)
    callback = run_deliver(ended(f"http://{host}:{victim.port}/"), allowed=[])  # the real resolver

    assert callback.state == "failed"
    assert "a loopback address: refused" in (callback.error or "")
    assert victim.requests == []


# --- refusal at submission ---------------------------------------------------------------


REFUSED = {  # id: (url, what the reason says)
    "loopback": ("http://127.0.0.1/", "host 127.0.0.1 is a loopback address"),
    "localhost": ("http://localhost:8080/", "host localhost resolves to "),
    "ipv6-loopback": ("http://[::1]:8080/", "host ::1 is a loopback address"),
    "metadata": ("http://169.254.169.254/latest/", "is a link-local address"),
    "ipv6-link-local": ("http://[fe80::1]/", "is a link-local address"),
    "rfc1918-10": ("http://10.1.2.3/", "is a private address"),
    "rfc1918-172": ("http://172.16.0.1/", "is a private address"),
    "rfc1918-192": ("http://192.168.1.1/", "is a private address"),
    "ula": ("http://[fd00::1]/", "is a private address"),
    "cgnat": ("http://100.64.0.1/", "is a carrier-grade NAT (100.64.0.0/10) address"),
    "unspecified": ("http://0.0.0.0:8080/", "is an unspecified address"),
    "ipv6-unspecified": ("http://[::]/", "is an unspecified address"),
    "multicast": ("http://224.0.0.1/", "is a multicast address"),
    "reserved": ("http://240.0.0.1/", "is a reserved address"),
    "doc-net": ("http://192.0.2.1/", "a special-purpose (not globally reachable) address"),
    "mapped": ("http://[::ffff:127.0.0.1]/", "is an IPv4-mapped loopback address"),
    "mapped-private": ("http://[::ffff:10.0.0.1]/", "is an IPv4-mapped private address"),
    "6to4-private": ("http://[2002:a00:1::]/", "is a 6to4 private address"),
    "decimal-ip": ("http://2130706433/", "resolves to 127.0.0.1, a loopback address"),
    "name-to-loopback": ("http://evil.test/", "evil.test resolves to 127.0.0.1, a loopback"),
    "any-address": ("http://mixed.test/", "mixed.test resolves to 10.0.0.5, a private address"),
    "unresolvable": ("http://nowhere.test/", "host nowhere.test does not resolve"),
    "ftp": ("ftp://example.com/", "scheme 'ftp' is not http or https"),
    "file": ("file:///etc/passwd", "scheme 'file' is not http or https"),
    "gopher": ("gopher://127.0.0.1:6379/", "scheme 'gopher' is not http or https"),
    "relative": ("/relative/path", "scheme '(none)' is not http or https"),
    "no-host": ("http:///path", "has no host"),
}


@pytest.mark.parametrize(("url", "reason"), REFUSED.values(), ids=REFUSED.keys())
def test_a_callback_url_is_refused(url: str, reason: str) -> None:
    dns = FakeDNS({"evil.test": ["127.0.0.1"], "mixed.test": [PUBLIC, "10.0.0.5"]})

    async def resolve(host: str, port: int) -> list:  # the real resolver but for *.test
        return await (dns if host.endswith(".test") else resolve_host)(host, port)

    why = asyncio.run(refusal(url, [], (), resolve=resolve))
    assert why is not None and why.startswith("callback URL ")
    assert reason in why
    assert "\n" not in why


def test_the_reason_says_how_to_allow_the_address() -> None:
    why = asyncio.run(refusal("http://127.0.0.1/", []))
    assert why == (
        "callback URL host 127.0.0.1 is a loopback address: refused "
        "(allow it with --callback-allow 127.0.0.1/32)"
    )


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        pytest.param("http://127.0.0.1:9/", ["127.0.0.0/8"], id="loopback"),
        pytest.param("http://[::1]/", ["::1/128"], id="ipv6-loopback"),
        pytest.param("http://[::ffff:127.0.0.1]/", ["127.0.0.0/8"], id="mapped-by-its-ipv4"),
        pytest.param("http://10.1.2.3/", ["10.1.0.0/16"], id="private"),
        pytest.param("http://intranet.test/", ["10.1.0.0/16"], id="name-to-private"),
        pytest.param("http://public.test/", [], id="public-name"),
        pytest.param(f"https://{PUBLIC}/hook", [], id="public-literal"),
        pytest.param("https://[2606:4700::1111]/", [], id="public-ipv6"),
    ],
)
def test_a_callback_url_is_accepted(url: str, allowed: list[str]) -> None:
    dns = FakeDNS({"intranet.test": ["10.1.2.3"], "public.test": [PUBLIC]})
    networks = [ip_network(a) for a in allowed]
    assert asyncio.run(refusal(url, networks, (), resolve=dns)) is None


def test_the_servers_own_addresses_are_refused_unless_allowed() -> None:
    own = [ip_network(f"{PUBLIC}/32")]
    dns = FakeDNS({"self.test": [PUBLIC]})
    why = asyncio.run(refusal("http://self.test/", [], own, resolve=dns))

    assert why is not None and f"resolves to {PUBLIC}, one of this server's own addresses" in why
    assert asyncio.run(refusal("http://self.test/", own, own, resolve=dns)) is None


# --- the per-environment secret ----------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_production_reads_its_secret_and_a_preview_never_reads_productions(tmp_path: Path) -> None:
    prod = write(tmp_path / "secrets/sless-callbacks/prod", "prod-key\n")
    write(tmp_path / "secrets/sless-callbacks/pr-1", "production's, not for previews\n")
    (tmp_path / "preview-secrets").mkdir()
    store = CallbackSecrets(tmp_path / "secrets", tmp_path / "preview-secrets", tmp_path / "state")

    assert (store.secret("prod"), store.where("prod")) == (b"prod-key", prod)

    generated = tmp_path / "state/callback-secrets/pr-1"
    assert store.where("pr-1") == generated
    key = store.secret("pr-1")
    assert len(key) == 64 and bytes.fromhex(key.decode())  # 32 random bytes, hex
    assert stat.S_IMODE(generated.stat().st_mode) == 0o600

    preview = write(tmp_path / "preview-secrets/sless-callbacks/pr-1", "preview-key\n")
    assert (store.secret("pr-1"), store.where("pr-1")) == (b"preview-key", preview)


def test_a_preview_without_a_preview_secrets_dir_gets_its_own_generated_secret(
    tmp_path: Path,
) -> None:
    write(tmp_path / "secrets/sless-callbacks/pr-2", "production's\n")
    store = CallbackSecrets(tmp_path / "secrets", None, tmp_path / "state")

    assert store.secret("pr-2") == (tmp_path / "state/callback-secrets/pr-2").read_bytes().strip()
    assert store.secret("pr-2") != b"production's"


def test_a_generated_secret_is_reused_by_every_later_instance(tmp_path: Path) -> None:
    first = CallbackSecrets(None, None, tmp_path / "state").secret("staging")
    again = CallbackSecrets(None, None, tmp_path / "state").secret("staging")
    other = CallbackSecrets(None, None, tmp_path / "state").secret("prod")

    assert first == again != other
    # and no temporary file is left behind
    assert sorted(os.listdir(tmp_path / "state/callback-secrets")) == ["prod", "staging"]


def test_writers_racing_to_generate_agree_on_one_secret(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        keys = set(
            pool.map(lambda _: CallbackSecrets(None, None, tmp_path).secret("prod"), range(16))
        )
    assert len(keys) == 1


def test_an_empty_secret_file_is_an_error_not_an_empty_key(tmp_path: Path) -> None:
    write(tmp_path / "secrets/sless-callbacks/prod", "\n")
    with pytest.raises(ValueError, match="is empty"):
        CallbackSecrets(tmp_path / "secrets", None, tmp_path / "state").secret("prod")


@pytest.mark.parametrize("env", ["", "..", "../prod", "a/b", ".hidden"])
def test_an_environment_name_cannot_leave_the_secrets_folder(tmp_path: Path, env: str) -> None:
    with pytest.raises(ValueError, match="cannot name a callback secret"):
        CallbackSecrets(tmp_path, tmp_path, tmp_path).secret(env)
