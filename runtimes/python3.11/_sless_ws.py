"""WebSocket functions (RFC 6455), loaded by ``_sless_server`` at the start of a function
served with ``SLESS_WEBSOCKET=1`` (an HTTP-only function never imports it).

A ``GET`` with ``Upgrade: websocket`` runs the optional onConnect hook in the
connection's thread, answers ``101`` and then that thread reads frames until the socket
ends: it answers pings, reassembles fragments, checks the protocol and queues each
complete message. A second thread per socket, its worker, runs the entrypoint once per
message, in order, then the onDisconnect hook once the socket has ended: reading never
waits for a handler, so pings, the peer's close and a vanished peer are seen while one
runs. The server's watchdog looks after each socket every tick without ever blocking on
it: the handler's timeout (its worker is abandoned, as an HTTP call's thread is, and a
fresh one takes the queue on), heartbeat pings, idleSec, maxSec and the 5 s a close
handshake may take. Its writes are non-blocking; all writes to a socket hold its
``write_lock``, so one frame never interleaves with another, and its file descriptor is
closed only under that lock (never under a writer).
"""

# ruff: noqa: SIM105 (try/except: contextlib is not imported for it)
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Mapping

try:  # the C SHA-1 (hashlib would load OpenSSL for one digest per handshake)
    from _sha1 import sha1
except ImportError:  # pragma: no cover - a Python built without it
    from hashlib import sha1
from binascii import Error as _Base64Error
from binascii import a2b_base64, b2a_base64
from time import monotonic as _monotonic

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
DEFAULT_MAX_MESSAGE_BYTES = 1048576
CLOSE_WAIT_SEC = 5.0  # how long a close handshake the server started may take
MAX_QUEUED = 16  # complete messages waiting for the handler before reading pauses
RECV_SIZE = 65536

CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_OPCODES = frozenset((CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG))
# codes an endpoint may send in a close frame: the RFC's own and IANA's 1012-1014, and
# 3000-4999 (libraries', applications'); 1004-1006 and 1015 never go on the wire
_SENDABLE = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014))
_DISCONNECT = object()  # the worker's last job


def valid_close_code(code: int) -> bool:
    return code in _SENDABLE or 3000 <= code <= 4999


def frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked frame (a server never masks)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, n))
    elif n < 65536:
        head = bytes((0x80 | opcode, 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big")
    return head + payload


def unmask(data, mask: bytes) -> bytes:
    """XOR with the repeated 4-byte mask, as one big-integer operation (C speed)."""
    n = len(data)
    if not n:
        return b""
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


def accept_key(key: str) -> str:
    digest = sha1(key.strip().encode("latin-1") + GUID).digest()
    return b2a_base64(digest, newline=False).decode()


def _valid_key(key: str | None) -> bool:
    if not key or not key.isascii():
        return False
    try:
        return len(a2b_base64(key.strip(), strict_mode=True)) == 16
    except _Base64Error:
        return False


def _tokens(value: str) -> set[str]:
    return {token.strip().lower() for token in value.split(",")}


def close_payload(code: int, reason: str) -> bytes:
    """A close frame's payload; ValueError for a code or a reason that cannot be sent."""
    if type(code) is not int or not valid_close_code(code):
        raise ValueError(f"{code!r} is not a close code a server may send")
    if not isinstance(reason, str):
        raise ValueError("the close reason must be a str")
    text = reason.encode()
    if len(text) > 123:
        raise ValueError("the close reason is longer than 123 UTF-8 bytes")
    return code.to_bytes(2, "big") + text


class _Fail(Exception):
    """A protocol violation by the peer: the socket is closed with ``code``.
    ``in_sync``: the frames after it can still be read (the whole frame was)."""

    def __init__(self, code: int, reason: str, in_sync: bool = False):
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.in_sync = in_sync


class _Gone(Exception):
    """The peer's side of the TCP connection ended (or was cut)."""


def configure(rt, module, entrypoint: str, environ: Mapping[str, str]) -> WebSockets:
    """The function's WebSocket settings (a StartupError names a bad one)."""
    hooks = {}
    for variable in ("SLESS_WS_ON_CONNECT", "SLESS_WS_ON_DISCONNECT"):
        name = environ.get(variable, "").strip()
        if not name:
            hooks[variable] = None
            continue
        func = getattr(module, name, None) if name.isidentifier() else None
        if func is None or not callable(func):
            raise rt.StartupError(
                f"{variable}={name!r}: the module of SLESS_ENTRYPOINT={entrypoint!r} has no "
                f"function {name!r}"
            )
        hooks[variable] = func
    raw = environ.get("SLESS_WS_MAX_MESSAGE_BYTES", "").strip()
    if not raw:
        limit = DEFAULT_MAX_MESSAGE_BYTES
    elif raw.isascii() and raw.isdigit() and int(raw) > 0:
        limit = int(raw)
    else:
        raise rt.StartupError(
            f"SLESS_WS_MAX_MESSAGE_BYTES={raw!r} must be a positive number of bytes"
        )
    return WebSockets(rt, hooks["SLESS_WS_ON_CONNECT"], hooks["SLESS_WS_ON_DISCONNECT"], limit)


class WebSockets:
    """The upgrade of a function served with SLESS_WEBSOCKET=1: the server calls
    ``upgrade`` for a request with ``Upgrade: websocket``."""

    def __init__(self, rt, on_connect, on_disconnect, max_message: int):
        self.rt = rt
        self.on_connect = None if on_connect is None else rt.make_caller(on_connect)[0]
        self.on_disconnect = None if on_disconnect is None else rt.make_caller(on_disconnect)[0]
        self.max_message = max_message
        self.context_class = make_context_class(rt)

    def upgrade(self, server, conn, sock, method, path, query, version, headers, keep) -> bool:
        """Answer the upgrade and serve the socket to its end in this (the connection's)
        thread; a refused upgrade is an HTTP response. False: the connection is done."""
        rt = self.rt
        problem = None
        if method != "GET":
            problem = "a WebSocket upgrade must be a GET"
        elif version != "HTTP/1.1":
            problem = "a WebSocket upgrade needs HTTP/1.1"
        elif "upgrade" not in _tokens(headers.get("connection", "")):
            problem = "a WebSocket upgrade needs 'Connection: Upgrade'"
        elif headers.get("sec-websocket-version", "").strip() != "13":
            body = rt.to_json({"error": "only WebSocket version 13 is supported"}).encode()
            extra = b"Sec-WebSocket-Version: 13\r\n"
            sock.sendall(rt._build(426, "application/json", body, False, False, extra))
            return False
        elif not _valid_key(headers.get("sec-websocket-key")):
            problem = "Sec-WebSocket-Key is missing or is not 16 bytes in base64"
        elif server.stopping:
            sock.sendall(rt._json_error(503, "the function is stopping", False, False))
            return False
        if problem is not None:
            sock.sendall(rt._json_error(400, problem, False, False))
            return False

        if "%" in path:
            from urllib.parse import unquote

            path = unquote(path)
        event = {
            "_path": path or "/",
            "_query": rt._parse_query(query) if query else {},
            "_method": method,
            "_headers": headers,
        }
        exporter = rt._exporter
        context = self.context_class(
            server.function_name,
            server.environment,
            headers.get("x-request-id"),
            0.0,
            headers.get("traceparent"),
            headers.get("tracestate"),
            None if exporter is None else f"{rt._random_bits(64) | 1:016x}",
        )
        context._socket = None  # until the 101: send and close raise
        call = rt.new_call(headers, context, method)
        if exporter is not None:
            call[rt._START] = rt.time.time_ns()
        server.load.begin()  # in flight from here: refused, it ends with its answer
        protocol = None
        if self.on_connect is not None:
            conn.keep = keep
            conn.is_head = False
            conn.call = call  # the 504's log line carries its tag
            conn.deadline = _monotonic() + server.timeout
            context._deadline = conn.deadline
            raised = result = None
            try:
                result = self.on_connect(event, context)
            except BaseException as exc:
                raised = exc
            with conn.lock:
                if conn.abandoned:  # past the timeout: the watchdog answered 504
                    return False
                conn.deadline = 0.0
            reply = self._refusal(server, call, result, raised, keep, path)  # logs, tagged
            conn.call = None
            rt.end_partial_lines(call)
            if reply is not None:
                server.load.end()
                if exporter is not None:
                    error = None if raised is None else rt.describe_exception(raised)
                    exporter.add(call, int(reply[9:12]), error)
                sock.sendall(reply)
                return keep and not server.stopping
            if isinstance(result, Mapping):
                protocol = self._protocol(call, headers, result.get("protocol"))

        lines = [
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n",
            b"Sec-WebSocket-Accept: %s\r\n" % accept_key(headers["sec-websocket-key"]).encode(),
        ]
        if protocol is not None:
            lines.append(b"Sec-WebSocket-Protocol: %s\r\n" % protocol.encode("latin-1"))
        lines.append(b"\r\n")
        socket = WebSocket(self, server, conn, sock, call, event, context)
        try:
            # under the write lock: a thread onConnect started may send already, and its
            # frame must follow the 101
            with socket.write_lock:
                sock.sendall(b"".join(lines))
        except OSError:
            server.load.end()
            return False
        socket.serve()
        return False

    def _refusal(self, server, call, result, raised, keep, path):
        """The HTTP response refusing the upgrade, or None to accept it."""
        rt = self.rt
        keep = keep and not server.stopping
        if raised is not None:  # as an HTTP handler's exception: the detail where shown
            request_id = call[rt._CONTEXT].request_id
            rt.print_handler_exception(
                raised, f"[sless] onConnect raised on GET {path} (request {request_id}):"
            )
            if server.error_detail:
                return rt._json_error(500, rt.describe_exception(raised), keep, False)
            body = rt.to_json({"error": rt.GENERIC_ERROR, "requestId": request_id}).encode()
            return rt._build(500, "application/json", body, keep, False)
        if result is None or result is True:
            return None
        if result is False:
            return rt._json_error(403, "connection refused", keep, False)
        if isinstance(result, Mapping):
            status = result.get("statusCode")
            if status is None or (type(status) is int and 200 <= status < 300):
                return None
            return rt.render_result(result, keep, False)  # an invalid status: its 500
        return rt._json_error(
            500,
            f"onConnect returned a {type(result).__name__} (expected None, a bool or a mapping)",
            keep,
            False,
        )

    def _protocol(self, call, headers, chosen) -> str | None:
        """The subprotocol to answer: onConnect's choice, if the client offered it."""
        if chosen is None:
            return None
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        if isinstance(chosen, str) and chosen and chosen in offered:
            return chosen
        print(
            f"{self.rt._tag(call)}[sless] onConnect chose the subprotocol {chosen!r}, which the "
            "client did not offer; none is answered",
            file=self.rt.sys.stderr,
            flush=True,
        )
        return None


class WebSocket:
    """One open socket: read by its connection's thread (``serve``), its messages handled
    by its worker thread, looked after by the watchdog (``look_after``)."""

    def __init__(self, sockets: WebSockets, server, conn, sock, call, event, context):
        self.rt = sockets.rt
        self.sockets = sockets
        self.server = server
        self.conn = conn
        self.sock = sock
        self.call = call
        self.event = event
        self.context = context
        context._socket = self
        self.lock = threading.Lock()  # the state below, never held while writing
        self.write_lock = threading.Lock()  # every write, and the closing of the fd
        self.jobs: deque = deque()
        self.queued_bytes = 0  # of the messages in ``jobs``
        self.jobs_ready = threading.Condition(self.lock)
        self.generation = 0  # the worker's: a stuck worker is abandoned by moving it on
        self.deadline = 0.0  # while a handler or onDisconnect runs
        self.job_kind = ""
        self.reading_paused = False  # the queue is full: the peer is not idle
        self.pending_close: bytes | None = None  # the close frame's payload, once decided
        self.close_deadline = 0.0
        self.closing = False  # a close is under way: queued messages are dropped
        self.close_sent = False  # under write_lock
        self.broken = False  # a write failed: nothing more is written
        self.tcp_closed = False  # set under lock, the fd closed under write_lock after
        self.peer_close: tuple[int, str] | None = None
        self.error: str | None = None  # why the server closed it, for its span
        self.finished = False
        now = _monotonic()
        self.received = now
        self.pinged = now
        self.opened = now
        self.end = now + server.stream_max

    # -- the reader (the connection's thread)

    def serve(self) -> None:
        server = self.server
        try:
            self._start_worker(0)
        except RuntimeError:  # cannot start a thread: no socket after all
            server.load.end()
            return
        server.sockets.add(self)
        try:
            self._read()
        except (_Gone, OSError):
            pass
        except Exception:
            self.rt.print_exc()
        self._end_tcp()
        with self.lock:
            self.jobs.append(_DISCONNECT)
            self.jobs_ready.notify_all()

    def _read(self) -> None:
        limit = self.sockets.max_message
        buf = bytearray(self.conn.buf)
        self.conn.buf = b""
        sock = self.sock
        recv = sock.recv

        def need(n: int) -> None:
            while len(buf) < n:
                try:
                    data = recv(max(RECV_SIZE, n - len(buf)))
                except TimeoutError:  # the socket's timeout bounds writes; reads wait on
                    continue
                if not data:
                    raise _Gone
                buf.extend(data)

        opcode = None  # of the message being reassembled
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                need(2)
                b0, b1 = buf[0], buf[1]
                fin, op, length = b0 & 0x80, b0 & 0x0F, b1 & 0x7F
                if b0 & 0x70:
                    raise _Fail(1002, "reserved bits set (no extension was negotiated)")
                if op not in _OPCODES:
                    raise _Fail(1002, f"unknown opcode {op:#x}")
                if not b1 & 0x80:
                    raise _Fail(1002, "a client frame must be masked")
                control = op >= CLOSE
                if control and (not fin or length > 125):
                    raise _Fail(1002, "a control frame must be final and at most 125 bytes")
                at = 2
                if length == 126:
                    need(4)
                    length, at = int.from_bytes(buf[2:4], "big"), 4
                elif length == 127:
                    need(10)
                    length, at = int.from_bytes(buf[2:10], "big"), 10
                    if length >> 63:
                        raise _Fail(1002, "a frame length must not use its highest bit")
                if not control:
                    if op == CONTINUATION and opcode is None:
                        raise _Fail(1002, "a continuation frame without a message started")
                    if op != CONTINUATION and opcode is not None:
                        raise _Fail(1002, "a new message before the last one was finished")
                    # decided from the header: the payload of a frame too big is never read
                    if size + length > limit:
                        raise _Fail(1009, f"a message over {limit} bytes")
                need(at + 4 + length)
                mask = bytes(buf[at : at + 4])
                payload = unmask(buf[at + 4 : at + 4 + length], mask)
                del buf[: at + 4 + length]
                self.received = _monotonic()
                if control:
                    if op == CLOSE:
                        self._on_close(payload)
                        return
                    if op == PING and not self.close_sent:  # once closed, no pong is due
                        try:
                            self._write(frame(PONG, payload), data=False)
                        except ConnectionError:
                            pass  # closing meanwhile, or broken: the next read tells
                    continue  # a pong: activity, nothing more
                if op != CONTINUATION:
                    opcode = op
                parts.append(payload)
                size += length
                if not fin:
                    continue
                message = parts[0] if len(parts) == 1 else b"".join(parts)
                kind, opcode, parts, size = opcode, None, [], 0
                if self.closing:
                    continue  # the close is under way: the RFC has data discarded
                if kind == TEXT:
                    try:
                        message = message.decode("utf-8")
                    except UnicodeDecodeError:
                        raise _Fail(1007, "a text message that is not UTF-8", True) from None
                self._queue(message)
            except _Fail as fail:
                self.request_close(close_payload(fail.code, fail.reason), blocking=True)
                if not fail.in_sync:  # the rest cannot be read as frames: wait for its end
                    self._discard_until_end()
                    return
                opcode, parts, size = None, [], 0

    def _on_close(self, payload: bytes) -> None:
        """The peer's close: answered (echoing its code) unless it answers the server's."""
        code, reason = 1005, ""  # 1005: the peer gave no code
        try:
            if len(payload) == 1:
                raise _Fail(1002, "a close frame with a 1-byte payload")
            if payload:
                code = int.from_bytes(payload[:2], "big")
                if not valid_close_code(code):
                    raise _Fail(1002, f"an invalid close code {code}")
                try:
                    reason = payload[2:].decode("utf-8")
                except UnicodeDecodeError:
                    raise _Fail(1002, "a close reason that is not UTF-8") from None
        except _Fail as fail:
            self.request_close(close_payload(fail.code, fail.reason), blocking=True)
            return
        self.peer_close = (code, reason)
        self.request_close(payload[:2], blocking=True)

    def _discard_until_end(self) -> None:
        """After a failure: the server's side is shut (FIN after the close frame) and what
        the peer still sends is dropped until it closes, or the watchdog ends the wait."""
        with self.lock:
            if not self.tcp_closed:
                try:
                    self.sock.shutdown(self.rt._socket.SHUT_WR)
                except OSError:
                    return
        while True:
            try:
                if not self.sock.recv(RECV_SIZE):
                    return
            except TimeoutError:
                continue

    def _queue(self, message) -> None:
        limit = self.sockets.max_message
        with self.lock:
            # back-pressure: the peer waits on TCP until the handler catches up; what
            # waits is at most MAX_QUEUED messages and, past one, maxMessageBytes in all
            while (
                len(self.jobs) >= MAX_QUEUED
                or (self.jobs and self.queued_bytes + len(message) > limit)
            ) and not self.closing:
                self.reading_paused = True
                self.jobs_ready.wait()
            self.reading_paused = False
            self.received = _monotonic()
            if not self.closing:
                self.jobs.append(message)
                self.queued_bytes += len(message)
                self.jobs_ready.notify_all()

    def _end_tcp(self) -> None:
        rt = self.rt
        with self.lock:
            self.tcp_closed = True
            self.closing = True
            self.jobs_ready.notify_all()  # a paused reader is this thread: nobody else waits
        try:
            self.sock.shutdown(rt._socket.SHUT_RDWR)  # a write under way fails at once
        except OSError:
            pass
        with self.write_lock:
            try:
                self.sock.close()
            except OSError:
                pass

    # -- writing

    def _write(self, out: bytes, data: bool = True) -> None:
        """A frame, sent whole under the write lock (blocking: not for the watchdog).
        ConnectionError once the close is under way (``data``) or sent, or the socket is
        broken."""
        with self.write_lock:
            if self.close_sent or self.broken or self.tcp_closed:
                raise ConnectionError("the WebSocket is closed")
            if data and self.pending_close is not None:
                raise ConnectionError("the WebSocket is closing")
            try:
                self.sock.sendall(out)
            except OSError as exc:
                self._break()
                raise ConnectionError("the WebSocket is closed") from exc

    def _write_now(self, out: bytes) -> bool:
        """A frame written without waiting (the watchdog's): False when it could not go
        now. The caller holds the write lock."""
        try:
            sent = os.write(self.sock.fileno(), out)  # the socket is non-blocking (timeout)
        except BlockingIOError:
            return False
        except OSError:
            self._break()
            return False
        if sent != len(out):  # half a frame breaks the framing: the socket is cut
            self._break()
            return False
        return True

    def _break(self) -> None:
        """A write failed or was cut short: nothing more can be written; the reader sees
        the end (the write lock is held, so the fd is open)."""
        self.broken = True
        try:
            self.sock.shutdown(self.rt._socket.SHUT_RDWR)
        except OSError:
            pass

    def send(self, value) -> None:
        """``context.send``: a frame for ``value``, encoded as a handler's return value."""
        encoded = self._encode(value)
        if encoded is not None:
            self._write(encoded)

    def _encode(self, value) -> bytes | None:
        if value is None:
            return None
        if isinstance(value, str):
            return frame(TEXT, value.encode())
        if isinstance(value, (bytes, bytearray, memoryview)):
            return frame(BINARY, bytes(value))
        return frame(TEXT, self.rt._json_encode(value).encode())

    def close(self, code: int = 1000, reason: str = "") -> None:
        """``context.close``: start the close handshake (a no-op once it started)."""
        self.request_close(close_payload(code, reason), blocking=True)

    def request_close(self, payload: bytes, blocking: bool) -> None:
        """Decide the close (the first decision wins) and send its frame: now, or, when
        ``blocking`` is False and the socket is busy, at one of the watchdog's next
        ticks. The peer has CLOSE_WAIT_SEC to answer before TCP is cut."""
        with self.lock:
            if self.pending_close is None and not self.tcp_closed:
                self.pending_close = payload
                self.close_deadline = _monotonic() + CLOSE_WAIT_SEC
                self.closing = True  # what is still queued is dropped
                self.jobs_ready.notify_all()  # a reader paused on a full queue goes on
        self._send_close(blocking)

    def _send_close(self, blocking: bool) -> None:
        lock = self.write_lock
        if not lock.acquire(blocking):
            return
        try:
            payload = self.pending_close
            if payload is None or self.close_sent or self.broken or self.tcp_closed:
                return
            out = frame(CLOSE, payload)
            if blocking:
                try:
                    self.sock.sendall(out)
                except OSError:
                    self._break()
                    return
            elif not self._write_now(out):
                return
            self.close_sent = True
        finally:
            lock.release()

    # -- the worker

    def _start_worker(self, generation: int) -> None:
        threading.Thread(
            target=self._work, args=(generation,), name="sless-websocket", daemon=True
        ).start()

    def _work(self, generation: int) -> None:
        rt = self.rt
        call = rt.new_call(self.call[rt._HEADERS], self.context, self.call[rt._METHOD])
        rt._local.serving = rt._Serving(call)  # its lines carry the upgrade's tag
        while True:
            with self.lock:
                while not self.jobs:
                    self.jobs_ready.wait()
                if generation != self.generation:
                    return
                job = self.jobs.popleft()
                if job is not _DISCONNECT:
                    self.queued_bytes -= len(job)
                self.jobs_ready.notify_all()  # room in the queue for a paused reader
                if job is not _DISCONNECT and self.closing:
                    continue
                self.job_kind = "disconnect" if job is _DISCONNECT else "message"
                self.deadline = self.context._deadline = _monotonic() + self.server.timeout
            if job is _DISCONNECT:
                self._disconnect(generation)
                rt.end_partial_lines(call)
                return
            if not self._handle(job, generation):
                return
            rt.end_partial_lines(call)

    def _handle(self, message, generation: int) -> bool:
        """Run the handler for one message and send its result; False once abandoned."""
        rt = self.rt
        raised = out = None
        try:
            out = self._encode(self.server.call(message, self.context))
        except BaseException as exc:  # the handler's, or a result that is not JSON
            raised = exc
        with self.lock:
            if generation != self.generation:  # past the timeout: said, and closed
                return False
            self.deadline = 0.0
        if raised is not None:
            rt.print_handler_exception(
                raised,
                f"[sless] the message handler raised (request {self.context.request_id}); "
                "the socket is closed with 1011:",
            )
            self.error = rt.describe_exception(raised)
            self.request_close(close_payload(1011, ""), blocking=True)
        elif out is not None:
            try:
                self._write(out)
            except ConnectionError:
                pass  # the socket closed while the handler ran: nobody to answer
        return True

    def _disconnect(self, generation: int) -> None:
        rt = self.rt
        hook = self.sockets.on_disconnect
        if hook is not None:
            code, reason = self.peer_close or (1006, "")  # 1006: no close frame received
            event = {
                "code": code,
                "reason": reason,
                "_path": self.event["_path"],
                "_query": self.event["_query"],
                "_headers": self.event["_headers"],
            }
            try:
                hook(event, self.context)
            except BaseException as exc:
                rt.print_handler_exception(
                    exc, f"[sless] onDisconnect raised (request {self.context.request_id}):"
                )
        with self.lock:
            if generation != self.generation:
                return  # past the timeout: the watchdog finished the socket
            self.deadline = 0.0
        self._finish()

    def _finish(self) -> None:
        """The socket and its hooks are done: no longer in flight (exactly once)."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
        server = self.server
        server.load.end()
        server.sockets.discard(self)
        exporter = self.rt._exporter
        if exporter is not None:
            exporter.add(self.call, 101, self.error)

    # -- the watchdog's (never blocks on the socket)

    def look_after(self, now: float) -> None:
        rt = self.rt
        server = self.server
        deadline = self.deadline
        if deadline and now >= deadline:
            self._expire(now)
        if self.tcp_closed or self.finished:
            return
        if self.pending_close is None:
            if now >= self.end:
                self._log(
                    f"the socket was open for {rt.format_seconds(server.stream_max)}s "
                    "(stream.maxSec); it is closed"
                )
                self.request_close(close_payload(1001, "maxSec"), blocking=False)
            elif not self.reading_paused and now - self.received >= server.stream_idle:
                self._log(
                    f"the socket received nothing for {rt.format_seconds(server.stream_idle)}s "
                    "(stream.idleSec); it is closed"
                )
                self.request_close(close_payload(1001, "idle"), blocking=False)
            elif now - max(self.received, self.pinged) >= server.heartbeat:
                self._ping(now)
            return
        if not self.close_sent:
            self._send_close(blocking=False)
        if now >= self.close_deadline:  # the peer did not answer the close: TCP is cut
            with self.lock:
                if not self.tcp_closed:
                    try:
                        self.sock.shutdown(rt._socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _ping(self, now: float) -> None:
        if not self.write_lock.acquire(blocking=False):  # a frame is going out
            return
        try:
            if self.close_sent or self.broken or self.tcp_closed or self.pending_close:
                return
            if self._write_now(frame(PING, b"")):
                self.pinged = now
        finally:
            self.write_lock.release()

    def _expire(self, now: float) -> None:
        """A handler (or onDisconnect) past the timeout: its worker is abandoned, as an
        HTTP call's thread is, and a fresh one takes the rest of the queue."""
        with self.lock:
            if not self.deadline or now < self.deadline:
                return
            self.deadline = 0.0
            self.generation += 1
            generation = self.generation
            kind = self.job_kind
        seconds = self.rt.format_seconds(self.server.timeout)
        if kind == "disconnect":
            self._log(f"onDisconnect ran past timeoutSec ({seconds}s); it is abandoned")
            self._finish()
            return
        self._log(f"the message handler ran past timeoutSec ({seconds}s); the socket is closed")
        self.error = f"the message handler ran past timeoutSec ({seconds}s)"
        self.request_close(close_payload(1011, ""), blocking=False)
        self._start_worker(generation)

    def _log(self, text: str) -> None:
        rt = self.rt
        print(f"{rt._tag(self.call)}[sless] {text}", file=rt.sys.stderr, flush=True)

    def going_away(self) -> None:
        """SIGTERM, once the drain time is over (the main thread's: never blocks)."""
        self.request_close(close_payload(1001, "going away"), blocking=False)


def make_context_class(rt):
    """The WebSocket handlers' context: the runtime's Context, plus the socket."""

    class WebSocketContext(rt.Context):
        __slots__ = ("_socket",)

        @property
        def connection_id(self) -> str:
            """The upgrade's X-Request-Id, else a generated id: the request id."""
            return self.request_id

        def send(self, data) -> None:
            """Send ``data`` now: str as a text frame, bytes as binary, anything else as
            JSON text. Thread-safe; ConnectionError once the socket is closed."""
            if self._socket is None:
                raise ConnectionError("the WebSocket is not open yet (onConnect runs before)")
            self._socket.send(data)

        def close(self, code: int = 1000, reason: str = "") -> None:
            """Start the close handshake with ``code`` (1000, 3000-4999 or a code the RFC
            lets a server send; else ValueError) and ``reason`` (<= 123 UTF-8 bytes)."""
            if self._socket is None:
                close_payload(code, reason)  # a bad code is a ValueError here too
                raise ConnectionError("the WebSocket is not open yet (onConnect runs before)")
            self._socket.close(code, reason)

    return WebSocketContext
