"""Benchmark streamed responses and WebSockets through the /fn/ proxy (issue 30, item 7).

    python bench/stream.py [--rounds 5] [--ttfb-requests 500] [--sse-events 100000]
                           [--sse-streams 1] [--duration 5] [--connections 16]
                           [--idle 1000] [--hold 5] [--smoke]

Starts, all on 127.0.0.1 and stopped on exit (SIGTERM and SIGHUP included):

- the python3.11 runtime server (``runtimes/python3.11/server.py``) with a streaming
  handler: ``/first`` returns a generator that yields one chunk (``x``) at once and
  ends; ``/sse?n=N`` answers ``text/event-stream`` with N copies of one small event
  (``event: tick`` and ``data:`` 16 bytes, made once by ``context.sse``), yielded as
  fast as the generator runs: each is one chunk;
- a second python3.11 runtime server with ``SLESS_WEBSOCKET=1`` whose handler returns
  each message (an echo; ``SLESS_STREAM_IDLE_SEC`` raised so that idle sockets stay);
- nginx (1 worker, keep-alive upstream pool, no access log) in front of the streaming
  runtime, with ``proxy_buffering off; proxy_http_version 1.1;
  chunked_transfer_encoding on;`` and the forwarding headers the proxy sets;
- the proxy in a process of its own: ``gitops_sless.proxy.ProxyApp`` in uvicorn with
  ``proxy.config()`` as shipped (uvloop, httptools, the ``/fn/`` fast path, the default
  limits), routing ``/fn/prod/stream/`` to the first runtime and ``/fn/prod/echo/``
  (``Route(..., websocket=True)``) to the second. Neither runtime has a replica key.

Then four measurements. Direct (the client to the runtime itself) and nginx are the
baselines, measured in the same rounds; within a round the targets run one after the
other, each round in the other order, so that load from elsewhere hits both alike.

1. **Time to first byte of a stream**: a raw-socket client on one keep-alive
   connection per target and round (opened, then one request not counted) sends
   ``GET /first`` ``--ttfb-requests`` times, one after the other; the time from the
   request's send to the arrival of the first byte of the first chunk's data (the
   response head and the chunk-size line come before it), then it reads to the
   terminating chunk. p50/p99 over every round, direct against /fn/: the added p50.
2. **SSE events per second**: ``--sse-streams`` clients at once, each one request
   ``GET /sse?n=--sse-events`` on its own connection, counting events (``\\n\\n``) until
   the terminating chunk; events/s is all events over the wall time of the slowest
   stream. Direct, nginx and /fn/ per round; ÷ nginx is the median of the rounds'
   ratios. CPU µs/event: user + system time of the proxy process, or nginx's worker,
   over the run, divided by the events (from ``/proc/PID/stat``); the runtime's and the
   client's CPU in cores beside, to tell which process limits the rate. Direct, the
   client gets about one event per read (nothing in between coalesces the runtime's
   writes), so it and the runtime wake each other per event: not the baseline.
3. **WebSocket echo**: ``--connections`` sockets, each sending a 16-byte text message
   and waiting for its echo before sending the next, for ``--duration`` seconds (after
   0.5 s of warm-up on the same sockets). The client is one asyncio (uvloop) loop in this
   process speaking RFC 6455 itself: the masked frame is built once per socket, a reply
   is a 2-byte header and its payload, checked against what was sent. Direct against
   /fn/; messages/s, the median of the rounds' ratios, the proxy's CPU per message (over
   every echo of the run, the warm-up's included); the client's CPU in cores is printed,
   with a note when it is near one core (then it may be what limits the rate).
4. **Idle WebSockets**: ``--idle`` sockets opened through /fn/ (50 handshakes at a
   time), held ``--hold`` seconds without traffic, then a ping on each: held are those
   whose pong came back. The proxy's RSS (``VmRSS``) just before opening and after the
   pongs, the difference over the count: KB per connection; the runtime's the same way,
   for reference (the python runtime runs two threads per socket). The proxy's
   ``max_connections`` (1,000 by default, ``SLESS_PROXY_MAX_CONNECTIONS``, which the
   proxy process inherits) counts each socket: every other connection is closed by
   then, and a socket past it (503) is counted as refused and reported.

Each round's figure goes to stderr as it is measured; the report to stdout. Targets
(printed PASS/MISS, never asserted): added TTFB p50 <= 1 ms; SSE /fn/ >= 0.8x
nginx; WebSocket echo /fn/ >= 0.7x direct; all idle sockets held, <= 50 KB each in the
proxy.

``--smoke`` runs every part in seconds (20 requests, 1,000 events, 1 s rounds, 10 idle
sockets held 1 s, one round), for tests/test_bench.py: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_SERVER = ROOT / "runtimes" / "python3.11" / "server.py"
HOST = "127.0.0.1"

TTFB_TARGET_MS = 1.0
SSE_TARGET = 0.8
WS_TARGET = 0.7
IDLE_TARGET_KB = 50.0
CLIENT_BUSY = 0.85  # cores of the client over which a note says it may be the limit

STREAM_HANDLER = """\
def main(event, context):
    path = event["_path"]
    if path == "/first":
        def first():
            yield "x"
        return first()
    if path == "/sse":
        count = int(event["_query"].get("n", "1000"))
        tick = context.sse("0123456789abcdef", event="tick")

        def events():
            for _ in range(count):
                yield tick
        return {"statusCode": 200, "headers": {"Content-Type": "text/event-stream"},
                "body": events()}
    return {"ok": True}
"""
ECHO_HANDLER = "def main(message, context):\n    return message\n"

NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream runtime {{
        server 127.0.0.1:{upstream};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=2048;
        location / {{
            proxy_pass http://runtime;
            proxy_buffering off;
            proxy_http_version 1.1;
            chunked_transfer_encoding on;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $http_host;
            proxy_set_header X-Forwarded-Prefix /fn/prod/stream;
            proxy_set_header X-Request-Id $request_id;
        }}
    }}
}}
"""


# --------------------------------------------------------------------------- the proxy


def serve(port: int, stream_port: int, ws_port: int) -> None:
    """The /fn/ proxy as shipped, routing prod/stream and prod/echo, until terminated."""
    sys.path.insert(0, str(ROOT))
    import uvicorn

    from gitops_sless.proxy import ProxyApp, config
    from gitops_sless.state.routes import Route, RouteTable

    routes = RouteTable()
    routes.set(Route("prod", "stream", 60.0, ((HOST, stream_port),)))
    routes.set(Route("prod", "echo", 60.0, ((HOST, ws_port),), websocket=True))
    records: deque = deque(maxlen=10000)  # stands in for the buffer flushed to SQLite
    uvicorn.Server(config(ProxyApp(routes, records.append), HOST, port)).run()


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(started):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _spawn(cmd: list, tmp: str, name: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``tmp/name.log`` (shown if it fails to start)."""
    path = Path(tmp, f"{name}.log")
    with open(path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log_path = path  # type: ignore[attr-defined]
    return proc


def _log_tail(proc: subprocess.Popen) -> str:
    with contextlib.suppress(OSError, AttributeError):
        return "\n".join(proc.log_path.read_text(errors="replace").splitlines()[-20:])
    return ""


def _wait_http(port: int, path: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{_log_tail(proc)}")
        try:
            with socket.create_connection((HOST, port), timeout=2) as sock:
                request = f"GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
                sock.sendall(request.encode())
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{what} did not answer 200 on :{port}{path}:\n{_log_tail(proc)}")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SystemExit(f"no VmRSS for {pid}")


def _nginx_worker(master: int) -> int | None:
    for task in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == master:
                return int(task.name)
    return None


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/local/sbin")


class Targets:
    """Ports and process ids of what was started."""

    def __init__(self, procs: list[subprocess.Popen], tmp: str) -> None:
        nginx_bin = _which("nginx")
        if nginx_bin is None:
            raise SystemExit("missing: nginx. Install it with bench/setup.")
        base = {**os.environ, "SLESS_HOST": HOST, "SLESS_STREAM_DRAIN_SEC": "1"}
        base.pop("SLESS_REPLICA_KEY", None)

        stream_dir, ws_dir = Path(tmp, "stream"), Path(tmp, "echo")
        stream_dir.mkdir()
        ws_dir.mkdir()
        (stream_dir / "streams.py").write_text(STREAM_HANDLER)
        (ws_dir / "echo.py").write_text(ECHO_HANDLER)

        self.stream = _free_port()
        env = {**base, "PORT": str(self.stream), "SLESS_ENTRYPOINT": "streams.main"}
        env["SLESS_FUNCTION_DIR"] = str(stream_dir)
        runtime = _spawn([sys.executable, str(RUNTIME_SERVER)], tmp, "runtime-stream", env)
        procs.append(runtime)
        self.stream_pid = runtime.pid

        self.ws = _free_port()
        env = {**base, "PORT": str(self.ws), "SLESS_ENTRYPOINT": "echo.main"}
        env |= {"SLESS_FUNCTION_DIR": str(ws_dir), "SLESS_WEBSOCKET": "1"}
        env |= {"SLESS_STREAM_IDLE_SEC": "3600", "SLESS_STREAM_MAX_SEC": "7200"}
        ws_runtime = _spawn([sys.executable, str(RUNTIME_SERVER)], tmp, "runtime-echo", env)
        procs.append(ws_runtime)
        self.ws_pid = ws_runtime.pid
        _wait_http(self.stream, "/health", runtime, "the streaming runtime")
        _wait_http(self.ws, "/health", ws_runtime, "the websocket runtime")

        self.nginx = _free_port()
        conf = NGINX_CONF.format(tmp=tmp, upstream=self.stream, port=self.nginx)
        Path(tmp, "nginx.conf").write_text(conf)
        nginx_cmd = [nginx_bin, "-p", tmp, "-c", f"{tmp}/nginx.conf", "-e", f"{tmp}/nginx.log"]
        nginx = _spawn(nginx_cmd, tmp, "nginx")
        procs.append(nginx)
        _wait_http(self.nginx, "/", nginx, "nginx")
        worker = _nginx_worker(nginx.pid)
        if worker is None:
            raise SystemExit("no nginx worker process found")
        self.nginx_pid = worker

        self.proxy = _free_port()
        cmd = [sys.executable, __file__, "--serve", str(self.proxy)]
        cmd += ["--stream-upstream", str(self.stream), "--ws-upstream", str(self.ws)]
        proxy = _spawn(cmd, tmp, "proxy")
        procs.append(proxy)
        _wait_http(self.proxy, "/fn/prod/stream/", proxy, "the proxy")
        self.proxy_pid = proxy.pid


# --------------------------------------------------------------------------- HTTP clients


def _request(path: str, port: int) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAccept: */*\r\n\r\n".encode()


def _check_head(head: bytes, what: str) -> None:
    if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
        raise SystemExit(f"{what}: not a 200 chunked stream:\n{head.decode(errors='replace')}")


def _first_byte_times(port: int, path: str, count: int) -> list[float]:
    """Send ``GET path`` ``count`` times on one keep-alive connection (after one not
    counted); per request, ms from its send to the first byte of its first chunk's data."""
    request = _request(path, port)
    samples = []
    with socket.create_connection((HOST, port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for n in range(count + 1):
            buf = b""
            first = None
            start = time.perf_counter()
            sock.sendall(request)
            while True:
                data = sock.recv(65536)
                if not data:
                    raise SystemExit(f":{port}{path}: the connection closed mid-response")
                buf += data
                if first is None:
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    size_end = buf.find(b"\r\n", end + 4)
                    if size_end < 0 or len(buf) <= size_end + 2:
                        continue  # the chunk-size line, but none of its data yet
                    first = time.perf_counter()
                    _check_head(buf[:end], f":{port}{path}")
                if buf.endswith(b"\r\n0\r\n\r\n"):
                    break
            if n:  # the first one opened the upstream side's connections
                samples.append((first - start) * 1000)
    return samples


def _sse_stream(port: int, path: str, events: int, out: list) -> None:
    """One ``GET path`` of an event stream, read to its terminating chunk; appends
    (events counted, seconds from send to the end) to ``out``."""
    counted = 0
    last = b""
    tail = b""
    with socket.create_connection((HOST, port), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        start = time.perf_counter()
        sock.sendall(_request(path, port))
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(65536)
            if not data:
                raise SystemExit(f":{port}{path}: closed before the head")
            head += data
        head, _, rest = head.partition(b"\r\n\r\n")
        _check_head(head, f":{port}{path}")
        data = rest
        while True:
            if data:
                counted += data.count(b"\n\n") + (last == b"\n" and data[:1] == b"\n")
                last = data[-1:]
                tail = (tail + data)[-7:]
                if tail.endswith(b"\r\n0\r\n\r\n"):
                    break
            data = sock.recv(1 << 18)
            if not data:
                raise SystemExit(f":{port}{path}: the stream ended unfinished")
        seconds = time.perf_counter() - start
    if counted != events:
        raise SystemExit(f":{port}{path}: {counted} events counted, {events} sent")
    out.append((counted, seconds))


def sse_run(port: int, prefix: str, events: int, streams: int) -> tuple[int, float]:
    """(events, wall seconds) of ``streams`` event streams at once."""
    out: list = []
    path = f"{prefix}sse?n={events}"
    threads = [
        threading.Thread(target=_sse_stream, args=(port, path, events, out), daemon=True)
        for _ in range(streams)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if len(out) != streams:
        raise SystemExit(f":{port}{path}: a stream failed (see above)")
    return sum(n for n, _ in out), seconds


# --------------------------------------------------------------------------- WebSocket client

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA


def _frame(opcode: int, payload: bytes) -> bytes:
    """A client frame (final, masked), payload below 126 bytes."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes((0x80 | opcode, 0x80 | len(payload))) + mask + masked


class WsClient(asyncio.Protocol):
    """One WebSocket: the handshake, then echoes (``echoing``), pings and a close."""

    def __init__(self, path: str, port: int) -> None:
        key = base64.b64encode(os.urandom(16))
        self.accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest())
        self.request = (
            (
                f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            ).encode()
            + b"Sec-WebSocket-Key: "
            + key
            + b"\r\n\r\n"
        )
        self.payload = os.urandom(8).hex().encode()  # 16 bytes of text
        self.message = _frame(TEXT, self.payload)
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()
        self.pong: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.switched = False
        self.echoing = False
        self.echoes = 0
        self.wrong = 0  # echoes that were not what was sent

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(self.request)

    def connection_lost(self, exc) -> None:
        if not self.opened.done():
            self.opened.set_exception(ConnectionError(f"closed before the upgrade: {exc}"))
        if not self.closed.done():
            self.closed.set_result(None)
        if self.pong is not None and not self.pong.done():
            self.pong.set_exception(ConnectionError("closed"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.switched:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end])
            del buf[: end + 4]
            if not head.startswith(b"HTTP/1.1 101") or self.accept not in head:
                self.opened.set_exception(ConnectionError(head.decode(errors="replace")))
                self.transport.close()
                return
            self.switched = True
            self.opened.set_result(None)
        while len(buf) >= 2:
            length, start = buf[1] & 0x7F, 2
            if length == 126:
                if len(buf) < 4:
                    return
                length, start = int.from_bytes(buf[2:4], "big"), 4
            elif length == 127:
                if len(buf) < 10:
                    return
                length, start = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) < start + length:
                return
            opcode = buf[0] & 0x0F
            payload = bytes(buf[start : start + length])
            del buf[: start + length]
            if opcode == TEXT:
                self.echoes += 1
                if payload != self.payload:
                    self.wrong += 1
                if self.echoing:
                    self.transport.write(self.message)
            elif opcode == PONG:
                if self.pong is not None and not self.pong.done():
                    self.pong.set_result(None)
            elif opcode == PING:
                self.transport.write(_frame(PONG, payload))
            elif opcode == CLOSE:
                self.transport.close()

    def start_echoing(self) -> None:
        self.echoing = True
        self.transport.write(self.message)

    async def ping(self) -> None:
        self.pong = asyncio.get_running_loop().create_future()
        self.transport.write(_frame(PING, b"bench"))
        await self.pong

    async def close(self) -> None:
        self.echoing = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_frame(CLOSE, (1000).to_bytes(2, "big")))
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), 5)
        except TimeoutError:
            self.transport.abort()


async def _open(
    port: int, path: str, count: int, batch: int = 50
) -> tuple[list[WsClient], list[BaseException]]:
    """``count`` WebSockets, ``batch`` handshakes at a time: (those opened, the errors)."""
    loop = asyncio.get_running_loop()
    clients: list[WsClient] = []
    errors: list[BaseException] = []
    for first in range(0, count, batch):

        async def one() -> WsClient:
            _, client = await loop.create_connection(lambda: WsClient(path, port), HOST, port)
            await asyncio.wait_for(client.opened, 30)
            return client

        done = await asyncio.gather(
            *(one() for _ in range(min(batch, count - first))), return_exceptions=True
        )
        clients += [c for c in done if isinstance(c, WsClient)]
        errors += [e for e in done if isinstance(e, BaseException)]
    return clients, errors


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


async def _close(clients: list[WsClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def ws_echo(
    port: int, path: str, connections: int, duration: float
) -> tuple[float, int, int]:
    """(messages/s over ``duration``, wrong echoes, all echoes) of ``connections`` echo
    loops."""
    clients, errors = await _open(port, path, connections)
    try:
        if errors:
            raise SystemExit(f":{port}{path}: {len(errors)} refused: {_first_line(errors[0])}")
        for client in clients:
            client.start_echoing()
        await asyncio.sleep(0.5)  # warm-up
        before = sum(c.echoes for c in clients)
        start = time.perf_counter()
        await asyncio.sleep(duration)
        count = sum(c.echoes for c in clients) - before
        seconds = time.perf_counter() - start
        if any(c.transport.is_closing() for c in clients):
            raise SystemExit(f":{port}{path}: a socket closed during the echo loop")
        for client in clients:
            client.echoing = False
        await asyncio.sleep(0.1)  # the messages under way come back
        return count / seconds, sum(c.wrong for c in clients), sum(c.echoes for c in clients)
    finally:
        await _close(clients)


async def ws_idle(targets: Targets, count: int, hold: float) -> dict:
    proxy_before, runtime_before = _rss_kb(targets.proxy_pid), _rss_kb(targets.ws_pid)
    start = time.perf_counter()
    clients, errors = await _open(targets.proxy, "/fn/prod/echo/", count)
    opened_sec = time.perf_counter() - start
    try:
        await asyncio.sleep(hold)
        answers = await asyncio.gather(
            *(asyncio.wait_for(c.ping(), 15) for c in clients), return_exceptions=True
        )
        held = sum(1 for a in answers if a is None)
        proxy_after, runtime_after = _rss_kb(targets.proxy_pid), _rss_kb(targets.ws_pid)
    finally:
        await _close(clients)
    return {
        "opened": len(clients),
        "refused": len(errors),
        "error": _first_line(errors[0]) if errors else "",
        "opened_sec": opened_sec,
        "held": held,
        "proxy_before": proxy_before,
        "proxy_after": proxy_after,
        "runtime_before": runtime_before,
        "runtime_after": runtime_after,
    }


SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _unwind_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like an error, so that every process started is stopped."""
    for sig in SIGNALS:
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))


def _run(loop: asyncio.AbstractEventLoop, coro):
    """Run ``coro`` on ``loop``; a signal cancels it (its sockets are closed), then exits.
    (Raised from a signal handler, SystemExit would land in a protocol callback instead.)"""
    task = loop.create_task(coro)
    received: list[int] = []

    def stop(signum: int) -> None:
        received.append(signum)
        task.cancel()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        if received:
            sys.exit(128 + received[0])
        raise
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        _unwind_on_signals()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# --------------------------------------------------------------------------- the measurements


def _order(targets: list, round_: int) -> list:
    return targets if round_ % 2 == 0 else targets[::-1]


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _progress(part: str, round_: int, name: str, text: str) -> None:
    print(f"{part} round {round_ + 1} {name:<7} {text}", file=sys.stderr)


def measure_ttfb(t: Targets, args: argparse.Namespace) -> dict[str, list[float]]:
    paths = [("direct", t.stream, "/first"), ("/fn/", t.proxy, "/fn/prod/stream/first")]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in paths}
    for round_ in range(args.rounds):
        for name, port, path in _order(paths, round_):
            times = _first_byte_times(port, path, args.ttfb_requests)
            samples[name] += times
            _progress("ttfb", round_, name, f"p50 {_p(times, 0.5):.3f} ms")
    return samples


def measure_sse(t: Targets, args: argparse.Namespace) -> dict[str, list[dict]]:
    paths = [
        ("direct", t.stream, "/", None),
        ("nginx", t.nginx, "/", t.nginx_pid),
        ("/fn/", t.proxy, "/fn/prod/stream/", t.proxy_pid),
    ]
    runs: dict[str, list[dict]] = {name: [] for name, *_ in paths}
    for round_ in range(args.rounds):
        for name, port, prefix, pid in _order(paths, round_):
            cpu = _cpu_seconds(pid) if pid else 0.0
            runtime_cpu, own = _cpu_seconds(t.stream_pid), _own_cpu()
            events, seconds = sse_run(port, prefix, args.sse_events, args.sse_streams)
            runs[name].append(
                {
                    "rate": events / seconds,
                    "cpu_us": (_cpu_seconds(pid) - cpu) * 1e6 / events if pid else None,
                    "runtime_cores": (_cpu_seconds(t.stream_pid) - runtime_cpu) / seconds,
                    "client_cores": (_own_cpu() - own) / seconds,
                }
            )
            _progress("sse", round_, name, f"{events / seconds:.0f} events/s")
    return runs


def measure_ws(t: Targets, args: argparse.Namespace, loop) -> dict[str, list[dict]]:
    paths = [("direct", t.ws, "/", None), ("/fn/", t.proxy, "/fn/prod/echo/", t.proxy_pid)]
    runs: dict[str, list[dict]] = {name: [] for name, *_ in paths}
    for round_ in range(args.rounds):
        for name, port, path, pid in _order(paths, round_):
            cpu = _cpu_seconds(pid) if pid else 0.0
            runtime_cpu, own = _cpu_seconds(t.ws_pid), _own_cpu()
            start = time.perf_counter()
            rate, wrong, total = _run(loop, ws_echo(port, path, args.connections, args.duration))
            wall = time.perf_counter() - start  # warm-up, handshakes and closes included
            runs[name].append(
                {
                    "rate": rate,
                    "wrong": wrong,
                    # over the whole run: every echo, the warm-up's included
                    "cpu_us": (_cpu_seconds(pid) - cpu) * 1e6 / total if pid else None,
                    "runtime_cores": (_cpu_seconds(t.ws_pid) - runtime_cpu) / wall,
                    "client_cores": (_own_cpu() - own) / wall,
                }
            )
            _progress("ws", round_, name, f"{rate:.0f} messages/s")
    return runs


# --------------------------------------------------------------------------- report


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _ratio(runs: dict[str, list[dict]], name: str, base: str) -> float:
    pairs = zip(runs[name], runs[base], strict=True)
    return statistics.median(a["rate"] / b["rate"] for a, b in pairs)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _client_note(runs: dict[str, list[dict]]) -> None:
    """A note for each target whose client (this process) was near a core's worth of CPU."""
    for name, each in runs.items():
        cores = max(r["client_cores"] for r in each)
        if cores > CLIENT_BUSY:
            print(
                f"\nnote: against {name} the client used up to {cores:.2f} cores "
                "(one thread per stream, one asyncio loop for the sockets): it may be "
                "what limits that rate"
            )


def report(args, ttfb, sse, ws, idle) -> None:
    print(f"## Time to first byte of a stream ({args.ttfb_requests} requests per target")
    print(f"and round, one after the other on a keep-alive connection, {args.rounds} rounds)\n")
    print("| target | requests | p50 ms | p99 ms | added p50 ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    direct_p50 = _p(ttfb["direct"], 0.5)
    for name, samples in ttfb.items():
        p50 = _p(samples, 0.5)
        added = f"{p50 - direct_p50:+.3f}" if name != "direct" else ""
        print(f"| {name} | {len(samples)} | {p50:.3f} | {_p(samples, 0.99):.3f} | {added} |")

    print(f"\n## SSE events per second ({args.sse_events} events per stream,")
    print(f"{args.sse_streams} stream(s) at once, {args.rounds} rounds, medians)\n")
    print("| target | events/s | ÷ nginx | CPU µs/event | runtime cores | client cores |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in sse.items():
        ratio = f"{_ratio(sse, name, 'nginx'):.2f}" if name != "direct" else ""
        print(
            f"| {name} | {_median(runs, 'rate'):.0f} | {ratio} "
            f"| {_fmt(_median(runs, 'cpu_us'), '.2f')} "
            f"| {_median(runs, 'runtime_cores'):.2f} | {_median(runs, 'client_cores'):.2f} |"
        )

    _client_note(sse)

    print(f"\n## WebSocket echo ({args.connections} connections, {args.duration:g} s per")
    print(f"target and round, {args.rounds} rounds, medians)\n")
    print("| target | messages/s | ÷ direct | CPU µs/message | runtime cores | client cores |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in ws.items():
        ratio = f"{_ratio(ws, name, 'direct'):.2f}" if name != "direct" else ""
        print(
            f"| {name} | {_median(runs, 'rate'):.0f} | {ratio} "
            f"| {_fmt(_median(runs, 'cpu_us'), '.1f')} "
            f"| {_median(runs, 'runtime_cores'):.2f} | {_median(runs, 'client_cores'):.2f} |"
        )
    wrong = sum(r["wrong"] for runs in ws.values() for r in runs)
    if wrong:
        print(f"\n{wrong} echoes differed from the message sent")
    _client_note(ws)

    per_conn = (idle["proxy_after"] - idle["proxy_before"]) / max(idle["opened"], 1)
    runtime_per_conn = (idle["runtime_after"] - idle["runtime_before"]) / max(idle["opened"], 1)
    print(f"\n## Idle WebSockets through /fn/ ({args.idle}, held {args.hold:g} s)\n")
    print(
        "| opened | opened in s | ping answered after the hold | proxy RSS before MB "
        "| after MB | KB/connection | runtime KB/connection |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {idle['opened']} | {idle['opened_sec']:.2f} | {idle['held']} "
        f"| {idle['proxy_before'] / 1024:.1f} | {idle['proxy_after'] / 1024:.1f} "
        f"| {per_conn:.1f} | {runtime_per_conn:.1f} |"
    )
    if idle["refused"]:
        print(
            f"\n{idle['refused']} refused: {idle['error']} (the proxy's max_connections, "
            "1,000 unless SLESS_PROXY_MAX_CONNECTIONS says otherwise, counts each socket)"
        )

    added = _p(ttfb["/fn/"], 0.5) - direct_p50
    sse_ratio = _ratio(sse, "/fn/", "nginx")
    ws_ratio = _ratio(ws, "/fn/", "direct")
    fn_cpu, nginx_cpu = _median(sse["/fn/"], "cpu_us"), _median(sse["nginx"], "cpu_us")
    print("\n## Targets\n")
    print(
        f"- TTFB added by /fn/ at p50: {added:+.3f} ms (target <= {TTFB_TARGET_MS:g} ms): "
        f"{_verdict(added <= TTFB_TARGET_MS)}"
    )
    print(
        f"- SSE events/s through /fn/: {sse_ratio:.2f} x nginx (target >= {SSE_TARGET}): "
        f"{_verdict(sse_ratio >= SSE_TARGET)}; CPU per event: proxy "
        f"{_fmt(fn_cpu, '.2f')} µs, nginx {_fmt(nginx_cpu, '.2f')} µs"
    )
    print(
        f"- WebSocket echo through /fn/, {args.connections} connections: {ws_ratio:.2f} x "
        f"direct (target >= {WS_TARGET}): {_verdict(ws_ratio >= WS_TARGET)}"
    )
    print(
        f"- idle WebSockets held: {idle['held']} of {args.idle}: "
        f"{_verdict(idle['held'] == args.idle)}; proxy memory {per_conn:.1f} KB/connection "
        f"(target <= {IDLE_TARGET_KB:g}): {_verdict(per_conn <= IDLE_TARGET_KB)}"
    )


# --------------------------------------------------------------------------- main


def _raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        new = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft < needed:
        print(f"warning: RLIMIT_NOFILE is {soft}, below the {needed} needed", file=sys.stderr)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, targets alternated (5)")
    parser.add_argument(
        "--ttfb-requests", type=int, default=500, help="TTFB requests per target and round (500)"
    )
    parser.add_argument(
        "--sse-events", type=int, default=100_000, help="events per SSE stream (100000)"
    )
    parser.add_argument("--sse-streams", type=int, default=1, help="SSE streams at once (1)")
    parser.add_argument(
        "--duration", type=float, default=5.0, help="seconds of WebSocket echo per round (5)"
    )
    parser.add_argument("--connections", type=int, default=16, help="echo connections (16)")
    parser.add_argument("--idle", type=int, default=1000, help="idle WebSockets (1000)")
    parser.add_argument("--hold", type=float, default=5.0, help="seconds they are held (5)")
    parser.add_argument(
        "--smoke", action="store_true", help="every part in seconds (figures mean nothing)"
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stream-upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ws-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.stream_upstream, args.ws_upstream)
        return 0
    if args.smoke:
        args.rounds, args.ttfb_requests, args.sse_events = 1, 20, 1000
        args.duration, args.idle, args.hold = 1.0, 10, 1.0
    if min(args.rounds, args.ttfb_requests, args.sse_events, args.sse_streams) < 1:
        parser.error("--rounds, --ttfb-requests, --sse-events and --sse-streams must be >= 1")
    if min(args.connections, args.idle) < 1 or args.duration <= 0:
        parser.error("--connections and --idle must be >= 1, --duration > 0")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    _unwind_on_signals()
    # the proxy and the runtime inherit it: two descriptors per idle socket in the proxy
    _raise_nofile(2 * args.idle + 1024)
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)\n")
    loop = _new_loop()
    try:
        with tempfile.TemporaryDirectory(prefix="sless-bench-") as tmp, processes() as procs:
            targets = Targets(procs, tmp)
            ttfb = measure_ttfb(targets, args)
            sse = measure_sse(targets, args)
            ws = measure_ws(targets, args, loop)
            time.sleep(0.5)  # the proxy has seen every earlier connection close
            idle = _run(loop, ws_idle(targets, args.idle, args.hold))
    finally:
        loop.close()
    report(args, ttfb, sse, ws, idle)
    print(f"\nload average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
