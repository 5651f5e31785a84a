"""gitops-sless Python runtime: serves one handler function over HTTP/1.1.

Standard library only. Configuration comes from the environment:

    SLESS_ENTRYPOINT     <path>.<function>, e.g. ``handler.main`` or ``api/v1-users.get`` (required)
    SLESS_FUNCTION_DIR   the function folder (default: the current directory)
    SLESS_FUNCTION_NAME  SLESS_ENV   passed to the handler in its ``context``
    SLESS_TIMEOUT_SEC    seconds a call may run before it is answered with 504 (default 30);
                         for a streamed response, the seconds to its first chunk
    SLESS_STREAM_IDLE_SEC  SLESS_STREAM_MAX_SEC
                         a streamed response ends (unfinished) after this long without a
                         chunk from the handler (default 30), or this long in all (900)
    SLESS_STREAM_HEARTBEAT_SEC
                         a quiet ``text/event-stream`` response gets a comment line this
                         often, so idle intermediaries keep it (default 15)
    SLESS_STREAM_REQUEST 1: the handler reads the request body as it comes, from
                         ``event["_stream"]`` (a binary file-like object), instead of
                         ``event`` holding it parsed; no size limit here (the proxy's)
    SLESS_STREAM_DRAIN_SEC
                         at SIGTERM, how long open streams and WebSockets may go on before
                         they are cut, or closed with 1001 (default 30)
    SLESS_WEBSOCKET      1: an ``Upgrade: websocket`` request opens a WebSocket (README.md);
                         with it SLESS_WS_ON_CONNECT, SLESS_WS_ON_DISCONNECT (functions of
                         the entrypoint's module) and SLESS_WS_MAX_MESSAGE_BYTES (1048576)
    SLESS_ERROR_DETAIL   1: a handler's exception is the 500's body; 0: the body is a generic
                         error with the request id, the exception only in the log (default:
                         1 in a preview environment, ``pr-*``, else 0)
    PORT  SLESS_HOST     where to listen (default 0.0.0.0:8080)
    SLESS_READY_FD       an inherited pipe: once listening, one JSON line goes there, e.g.
                         {"port":8080,"t":{"start":..,"runtime":..,"handler":..,"listening":..}}
                         (time.monotonic() at each phase of the start), then it is closed;
                         a failed start closes it without a line

``GET /health`` answers ``{"status":"ok","inflight":..,"requests":..,"busySeconds":..}``:
the calls running now, the calls answered since the start and the integral of the
calls running over time (the average concurrency between two reads is Δbusy/Δt).

Design, for speed: one thread per connection parses requests by hand and runs
the handler inline; a watchdog thread answers a call that runs past the
timeout with 504 and hands the connection to a fresh thread, abandoning the
stuck one (a Python thread cannot be stopped). The hot path therefore costs
no thread hand-off at all.

``server.py``, the script that is started, imports this module (so that it is loaded
from its cached bytecode, not compiled at every start) and calls ``main``;
``runner.py`` imports it for the shared loading and calling code.
"""

# ruff: noqa: E402, SIM105 (imports after _STARTED; try/except, as contextlib is not imported)
import time

_STARTED = time.monotonic()  # when this module began (server.py passes its own start)

# A start imports only what the ready line and the first call need, and of the standard
# modules that import enum or re (socket, signal, json: 5-10 ms together) or load OpenSSL
# (hmac) only the C modules under them. What only some calls need (json's decoder,
# asyncio, traceback, inspect, uuid, urllib.parse) is imported where it is used.
# threading (2 ms, with functools and collections) is here: imported once the ready line
# is out, it delays the first call by more than that.
import _signal
import _socket
import os
import select
import sys
import threading
from _operator import _compare_digest
from collections.abc import Callable, Mapping

try:  # the import system's own functions: importlib.util would import contextlib and more
    from _frozen_importlib import module_from_spec
    from _frozen_importlib_external import spec_from_file_location
except ImportError:  # pragma: no cover - not CPython
    from importlib.util import module_from_spec, spec_from_file_location

RUNTIME = "python3.11"
DEFAULT_TIMEOUT_SEC = 30.0
MAX_HEADER_BYTES = 64 * 1024
REPLICA_KEY_HEADER = "x-sless-replica"  # the proxy's proof, on the local backend
MAX_BODY_BYTES = 32 * 1024 * 1024
IDLE_TIMEOUT_SEC = 75.0  # longer than the usual proxy keep-alive (60 s)
DEFAULT_STREAM_IDLE_SEC = 30.0
DEFAULT_STREAM_MAX_SEC = 900.0
DEFAULT_STREAM_DRAIN_SEC = 30.0
HEARTBEAT_SEC = 15.0  # a quiet event stream's comment line, so intermediaries keep it
RECV_SIZE = 65536

_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))
_monotonic = time.monotonic


class StartupError(Exception):
    """A configuration or loading problem: reported on stderr, exit 1."""


# --------------------------------------------------------------------------- configuration


def parse_timeout(
    raw: str | None, default: float = DEFAULT_TIMEOUT_SEC, name: str = "SLESS_TIMEOUT_SEC"
) -> float:
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise StartupError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise StartupError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def format_seconds(value: float) -> str:
    return f"{value:g}"


def load_handler(entrypoint: str | None, function_dir: str) -> Callable:
    """Import ``<path>.<function>`` from ``function_dir`` and return the function."""
    return load_entrypoint(entrypoint, function_dir)[0]


def load_entrypoint(entrypoint: str | None, function_dir: str) -> tuple[Callable, object]:
    """Import ``<path>.<function>`` from ``function_dir``: the function and its module
    (where the WebSocket hooks are looked up)."""
    if not entrypoint:
        raise StartupError(
            "SLESS_ENTRYPOINT is not set (expected '<path>.<function>', e.g. 'handler.main')"
        )
    rel_path, dot, func_name = entrypoint.rpartition(".")
    if not dot or not rel_path or not func_name:
        raise StartupError(
            f"SLESS_ENTRYPOINT={entrypoint!r} is invalid: expected '<path>.<function>', "
            "e.g. 'handler.main'"
        )
    function_dir = os.path.abspath(function_dir)
    if not os.path.isdir(function_dir):
        raise StartupError(f"function folder {function_dir} does not exist")
    file_path = os.path.normpath(os.path.join(function_dir, rel_path + ".py"))
    if not os.path.isfile(file_path):
        raise StartupError(
            f"cannot load SLESS_ENTRYPOINT={entrypoint!r}: {file_path} does not exist"
        )

    # The handler imports its sibling modules from the function folder, then its
    # dependencies (`pip install --target .sless-deps`); never this runtime's own files.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _RUNTIME_DIR]
    deps_dir = os.path.join(function_dir, ".sless-deps")
    for path in ([deps_dir] if os.path.isdir(deps_dir) else []) + [function_dir]:
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)

    parts = rel_path.replace(os.sep, "/").split("/")
    if all(part.isidentifier() for part in parts) and ".".join(parts) not in sys.modules:
        module_name = ".".join(parts)  # so that `import handler` elsewhere finds this module
    else:
        module_name = "_sless_handler_module"
    spec = spec_from_file_location(module_name, file_path)
    if spec is None or spec.loader is None:
        raise StartupError(f"cannot load SLESS_ENTRYPOINT={entrypoint!r} from {file_path}")
    module = module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        import traceback

        detail = "".join(traceback.format_exception(exc)).rstrip()
        raise StartupError(
            f"cannot load SLESS_ENTRYPOINT={entrypoint!r}: importing {file_path} failed:\n{detail}"
        ) from None
    func = getattr(module, func_name, None)
    if func is None:
        raise StartupError(
            f"cannot load SLESS_ENTRYPOINT={entrypoint!r}: {file_path} has no function "
            f"{func_name!r}"
        )
    if not callable(func):
        raise StartupError(
            f"cannot load SLESS_ENTRYPOINT={entrypoint!r}: {func_name!r} in {file_path} is "
            f"not callable"
        )
    return func, module


# --------------------------------------------------------------------------- calling


class Context:
    """The second argument of a handler that takes two."""

    __slots__ = (
        "_deadline",
        "_request_id",
        "_span_id",
        "_traceparent",
        "_tracestate",
        "environment",
        "function_name",
    )

    def __init__(
        self,
        function_name: str,
        environment: str,
        request_id: str | None,
        deadline: float,
        traceparent: str | None = None,
        tracestate: str | None = None,
        span_id: str | None = None,
    ):
        self.function_name = function_name
        self.environment = environment
        self._request_id = request_id
        self._deadline = deadline
        self._traceparent = traceparent
        self._tracestate = tracestate
        self._span_id = span_id  # the call's own span, where spans are exported

    @property
    def traceparent(self) -> str:
        """The call's W3C ``traceparent`` (the proxy sends one; else a new trace, made on
        first use)."""
        value = self._traceparent
        if not value or not _valid_traceparent(value):
            trace, span = _random_bits(128) | 1, _random_bits(64) | 1
            value = self._traceparent = f"00-{trace:032x}-{span:016x}-01"
            self._tracestate = None  # it belonged to the traceparent that was not valid
        return value

    @property
    def trace_id(self) -> str:
        """The id of the trace the call belongs to (32 hex digits)."""
        return self.traceparent[3:35]

    def trace_headers(self) -> dict:
        """Headers that carry the call's trace on to a call it makes (its own span's id
        as the parent): ``urllib.request.Request(url, headers=context.trace_headers())``,
        ``requests.get(url, headers=context.trace_headers())``. Where spans are exported
        (SLESS_OTLP_ENDPOINT), the parent is the span exported for this call."""
        parent = self.traceparent
        span = self._span_id or f"{_random_bits(64) | 1:016x}"
        headers = {"traceparent": f"00-{parent[3:35]}-{span}-{parent[53:55]}"}
        if self._tracestate:
            headers["tracestate"] = self._tracestate
        return headers

    @property
    def request_id(self) -> str:
        """The X-Request-Id of the call, else a generated id (made on first use)."""
        if not self._request_id:
            self._request_id = _new_request_id()
        return self._request_id

    def remaining_time_ms(self) -> int:
        """Milliseconds left before the call is answered with a timeout."""
        return max(0, int((self._deadline - _monotonic()) * 1000))

    get_remaining_time_in_millis = remaining_time_ms  # the AWS Lambda spelling

    @staticmethod
    def sse(data=None, event=None, id=None, retry=None) -> str:
        """One server-sent event, to yield from a ``text/event-stream`` response:
        ``event:``, ``id:``, ``retry:`` and a ``data:`` line per line of ``data`` (a str
        as it is, anything else as JSON)."""
        return stream_module().sse(data, event, id, retry)

    def __repr__(self) -> str:
        return (
            f"Context(function_name={self.function_name!r}, environment={self.environment!r}, "
            f"request_id={self.request_id!r}, trace_id={self.trace_id!r})"
        )


def _valid_traceparent(value: str) -> bool:
    """A W3C traceparent this runtime can carry on: its version 00 fields (a later
    version's first four), lower-case hex, trace and parent ids not all zeros."""
    if len(value) < 55 or value[:2] == "ff" or (value[:2] == "00" and len(value) != 55):
        return False
    dashes = value[2] + value[35] + value[52] + (value[55] if len(value) > 55 else "-")
    if dashes != "----":
        return False
    fields = (value[:2], value[3:35], value[36:52], value[53:55])
    if any(f.strip("0123456789abcdef") for f in fields):
        return False
    return fields[1] != "0" * 32 and fields[2] != "0" * 16


def _random_bits(bits: int) -> int:
    import random

    return random.getrandbits(bits)


# --------------------------------------------------------------------------- log tags

# A call being served: a list, the cheapest thing to make per request,
# [headers, context, tag, stdout's partial line, stderr's, start (ns), method]. A thread
# finds it in ``_local.serving.call``: its connection's (set once per connection, so a
# call only sets and clears a slot) or, in the runner, a _Serving's. A partial line is
# None (none yet) or a list: its length in characters, then its pieces.
_HEADERS, _CONTEXT, _TAG, _OUT, _ERR, _START, _METHOD = range(7)
MAX_PARTIAL = 64 * 1024  # a partial line this long is written out as a line of its own
_local = threading.local()


def new_call(headers: dict, context: Context | None, method: str) -> list:
    return [headers, context, None, None, None, 0, method]


class _Serving:
    __slots__ = ("call",)

    def __init__(self, call: list | None = None):
        self.call = call


def _current_call() -> list | None:
    serving = getattr(_local, "serving", None)
    return None if serving is None else serving.call


def _call_context(call: list) -> Context:
    """The call's context; made here for a handler that takes none (the tag needs one)."""
    context = call[_CONTEXT]
    if context is None:
        headers = call[_HEADERS]
        context = call[_CONTEXT] = Context(
            "", "", headers.get("x-request-id"), 0.0, headers.get("traceparent")
        )
    return context


def _tag(call: list) -> str:
    """``[request_id=<id> trace_id=<32 hex>] ``: the ids the call's context shows."""
    tag = call[_TAG]
    if tag is None:
        context = _call_context(call)
        tag = call[_TAG] = f"[request_id={context.request_id} trace_id={context.trace_id}] "
    return tag


class _TaggedStream:
    """``sys.stdout`` or ``sys.stderr``: each line a thread writes while it serves a call
    starts with the call's tag. A partial line waits for its newline, a flush(), the end
    of the call or its 64 Ki characters, each of which ends it; what other threads write
    passes as it is. Each write costs what its own text costs: a partial line is kept as
    its pieces, joined once, and only the new text is searched for a newline."""

    def __init__(self, stream, slot: int):
        self._stream = stream
        self._slot = slot

    def write(self, text):
        call = _current_call()
        if call is None or type(text) is not str:
            return self._stream.write(text)
        slot = self._slot
        cut = text.rfind("\n")
        partial = call[slot]
        if cut < 0:
            if not text:
                return 0
            if partial is None:
                partial = call[slot] = [0]
            partial.append(text)
            partial[0] += len(text)
            if partial[0] >= MAX_PARTIAL:
                call[slot] = None
                self._stream.write(f"{_tag(call)}{''.join(partial[1:])}\n")
            return len(text)
        tag = _tag(call)
        head = text[:cut]
        if partial is not None:
            partial[0] = ""
            partial.append(head)
            head = "".join(partial)
        if "\n" in head:
            head = head.replace("\n", "\n" + tag)
        out = f"{tag}{head}\n"
        rest = text[cut + 1 :]
        if len(rest) >= MAX_PARTIAL:
            out = f"{out}{tag}{rest}\n"
            rest = ""
        call[slot] = [len(rest), rest] if rest else None
        self._stream.write(out)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """The current call's partial line, ended (``print(..., end="", flush=True)``
        shows now), and the stream flushed."""
        call = _current_call()
        if call is not None and call[self._slot] is not None:
            self._end_partial(call)
        self._stream.flush()

    def end_call(self, call: list) -> None:
        """The call's partial line, ended."""
        if call[self._slot] is not None:
            self._end_partial(call)
            self._stream.flush()

    def _end_partial(self, call: list) -> None:
        partial = call[self._slot]
        call[self._slot] = None
        partial[0] = ""
        self._stream.write(f"{_tag(call)}{''.join(partial)}\n")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_tagged_streams: list[_TaggedStream] = []


def install_log_tags() -> None:
    """Wrap sys.stdout and sys.stderr (before the handler loads, so that what it keeps
    of them, a logging handler, writes through the wrappers)."""
    if _tagged_streams:
        return
    if sys.stdout is not None:
        sys.stdout = _TaggedStream(sys.stdout, _OUT)
        _tagged_streams.append(sys.stdout)
    if sys.stderr is not None:
        sys.stderr = _TaggedStream(sys.stderr, _ERR)
        _tagged_streams.append(sys.stderr)


def begin_call(call: list) -> None:
    """``call`` is this thread's (the runner's; the server sets its connection's)."""
    _local.serving = _Serving(call)


def end_call(call: list) -> None:
    """No longer this thread's call; its partial lines are written out."""
    _local.serving = None
    end_partial_lines(call)


def end_partial_lines(call: list | None) -> None:
    if call is not None and (call[_OUT] or call[_ERR]):
        for stream in _tagged_streams:
            stream.end_call(call)


# --------------------------------------------------------------------------- spans

SPAN_BATCH = 256  # sent at once when this many wait, else every SPAN_INTERVAL_SEC
SPAN_INTERVAL_SEC = 1.0
SPAN_QUEUE = 2048  # beyond it the oldest are dropped
SPAN_FLUSH_SEC = 2.0  # what is waiting at SIGTERM is sent for at most this long
SPAN_SCOPE = "gitops-sless-runtime"
DEFAULT_SPAN_SERVICE = "gitops-sless-function"
_exporter: "_SpanExporter | None" = None  # set by main() where SLESS_OTLP_ENDPOINT is


def _attribute(key: str, value) -> dict:
    if type(value) is int:
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": value}}


class _SpanExporter:
    """Each call's span, sent in batches over OTLP/HTTP JSON by one daemon thread. A
    call only appends to a bounded queue: it never waits for the receiver."""

    def __init__(
        self, endpoint: str, token: str, service: str, function_name: str, environment: str
    ):
        from collections import deque
        from urllib.parse import urlsplit

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StartupError(f"SLESS_OTLP_ENDPOINT={endpoint!r} is not an http(s) URL")
        self.url = url
        self.parts = parts
        self.target = parts.path + (f"?{parts.query}" if parts.query else "")
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.name = function_name
        self.environment = environment
        self.resource = {
            "attributes": [
                _attribute("service.name", service),
                _attribute("faas.name", function_name),
            ]
        }
        self.queue: deque = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.dropped = 0
        self.told_dropped = False
        self.closing = False
        self.connection = None
        self.thread = threading.Thread(target=self._run, name="sless-spans", daemon=True)
        self.thread.start()

    def add(self, call: list, status: int, error: str | None) -> None:
        """The span of a call that is answered with ``status``."""
        end = time.time_ns()
        context = call[_CONTEXT]
        traceparent = context.traceparent
        if not int(traceparent[53:55], 16) & 1:
            return  # the caller does not sample this trace
        sent = call[_HEADERS].get("traceparent")
        parent = sent[36:52] if sent and sent == traceparent else None
        span = (traceparent[3:35], context._span_id, parent, call[_START], end,
                context.request_id, call[_METHOD], status, error)  # fmt: skip
        with self.lock:
            if len(self.queue) >= SPAN_QUEUE:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append(span)
            full = len(self.queue) >= SPAN_BATCH
        if full:
            self.wake.set()

    def close(self) -> None:
        """Send what is waiting, for at most SPAN_FLUSH_SEC."""
        self.closing = True
        self.wake.set()
        self.thread.join(SPAN_FLUSH_SEC)

    def _run(self) -> None:
        while True:
            self.wake.wait(SPAN_INTERVAL_SEC)
            self.wake.clear()
            try:
                self._send_waiting()
            except Exception:  # never let the exporter die
                print_exc()
            if self.closing:
                return

    def _send_waiting(self) -> None:
        if self.dropped and not self.told_dropped:
            self.told_dropped = True
            print(
                f"[sless] span export: more than {SPAN_QUEUE} spans waited; the oldest are "
                f"dropped ({self.dropped} so far)",
                file=sys.stderr,
                flush=True,
            )
        while True:
            with self.lock:
                batch = [self.queue.popleft() for _ in range(min(SPAN_BATCH, len(self.queue)))]
            if not batch:
                return
            self._post(_json_encode(self._body(batch)).encode(), len(batch))

    def _body(self, batch: list) -> dict:
        return {
            "resourceSpans": [
                {
                    "resource": self.resource,
                    "scopeSpans": [
                        {"scope": {"name": SPAN_SCOPE}, "spans": [self._span(s) for s in batch]}
                    ],
                }
            ]
        }

    def _span(self, span: tuple) -> dict:
        trace_id, span_id, parent, start, end, request_id, method, status, error = span
        encoded = {
            "traceId": trace_id,
            "spanId": span_id,
            "name": self.name,
            "kind": 2,  # SERVER
            "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(end),
            "attributes": [
                _attribute("faas.invocation_id", request_id),
                _attribute("faas.name", self.name),
                _attribute("sless.environment", self.environment),
                _attribute("http.request.method", method),
                _attribute("http.response.status_code", status),
            ],
        }
        if parent:
            encoded["parentSpanId"] = parent
        if error is not None:
            encoded["status"] = {"code": 2, "message": error}  # ERROR
        return encoded

    def _post(self, body: bytes, count: int) -> None:
        """One POST, tried twice; a batch that fails both is dropped with one line."""
        import http.client

        problem = ""
        for _ in range(2):
            try:
                connection = self.connection or self._connect()
                connection.request("POST", self.target, body, self.headers)
                response = connection.getresponse()
                response.read()
                if 200 <= response.status < 300:
                    return
                problem = f"HTTP {response.status}"
            except (OSError, http.client.HTTPException) as exc:
                problem = describe_exception(exc)
                if self.connection is not None:
                    self.connection.close()
                self.connection = None
        print(
            f"[sless] span export to {self.url} failed ({problem}): {count} spans dropped",
            file=sys.stderr,
            flush=True,
        )

    def _connect(self):
        import http.client

        parts = self.parts
        if parts.scheme == "https":
            make = http.client.HTTPSConnection
        else:
            make = http.client.HTTPConnection
        self.connection = make(parts.hostname, parts.port, timeout=5)
        return self.connection


def start_span_export(function_name: str, environment: str) -> "_SpanExporter | None":
    """SLESS_OTLP_ENDPOINT, _TOKEN and _SERVICE, taken out of the environment (not the
    handler's to see); the exporter where an endpoint is set."""
    global _exporter
    endpoint = os.environ.pop("SLESS_OTLP_ENDPOINT", "").strip()
    token = os.environ.pop("SLESS_OTLP_TOKEN", "")
    service = os.environ.pop("SLESS_OTLP_SERVICE", "") or DEFAULT_SPAN_SERVICE
    if endpoint:
        _exporter = _SpanExporter(endpoint, token, service, function_name, environment)
    return _exporter


_CO_VARARGS = 0x04  # inspect.CO_VARARGS
_FunctionType = type(lambda: None)  # types.FunctionType and CoroutineType, without types


async def _coroutine() -> None:
    pass


_coroutine = _coroutine()
_CoroutineType = type(_coroutine)
_coroutine.close()
del _coroutine


def wants_context(func: Callable) -> bool | None:
    """True: call with (event, context); False: (event); None: no arguments."""
    if type(func) is _FunctionType and not (
        hasattr(func, "__wrapped__") or hasattr(func, "__signature__")
    ):
        # what inspect.signature reads from a plain function, without importing inspect
        code = func.__code__
        if code.co_flags & _CO_VARARGS:
            return True
        positional = code.co_argcount
    else:
        positional = _positional_parameters(func)
        if positional is None:
            return True
    if positional == 0:
        return None
    return positional >= 2


def _positional_parameters(func: Callable) -> int | None:
    """How many positional parameters ``func`` takes; None for ``*args``."""
    import inspect

    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return 1  # unknown: called with the event alone
    positional = 0
    for param in sig.parameters.values():
        if param.kind == param.VAR_POSITIONAL:
            return None
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional


def _run_coroutine(coroutine):
    """``asyncio.run``, except that a result that streams asynchronously keeps the loop it
    was made on, for its stream (``_local.runner``, taken by the stream's ``Values``)."""
    import asyncio  # 20-40 ms to import: only for async handlers

    runner = asyncio.Runner()
    try:
        result = runner.run(coroutine)
    except BaseException:
        runner.close()
        raise
    form = stream_of(result)
    if form is not None and hasattr(form["body"], "__anext__"):
        _local.runner = runner
    else:
        runner.close()
    return result


def make_caller(func: Callable) -> tuple[Callable, bool]:
    """``(call(event, context), needs_context)`` for the handler's signature."""
    mode = wants_context(func)
    coroutine_type = _CoroutineType

    if mode is True:

        def call(event, context):
            result = func(event, context)
            if type(result) is coroutine_type:
                result = _run_coroutine(result)
            return result

    elif mode is False:

        def call(event, context):
            result = func(event)
            if type(result) is coroutine_type:
                result = _run_coroutine(result)
            return result

    else:

        def call(event, context):
            result = func()
            if type(result) is coroutine_type:
                result = _run_coroutine(result)
            return result

    return call, mode is True


def print_handler_exception(exc: BaseException, heading: str) -> None:
    """``heading`` and the traceback on stderr, without this runtime's own frames."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _RUNTIME_DIR:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    end_partial_lines(_current_call())  # the heading starts a line of its own
    sys.stderr.write(f"{heading}\n{text}")
    sys.stderr.flush()


def print_exc() -> None:
    """The exception being handled, with its traceback, on stderr (a bug of the runtime)."""
    import traceback

    traceback.print_exc()


GENERIC_ERROR = "the function failed; its log has the details"


def _new_request_id() -> str:
    import uuid

    return uuid.uuid4().hex


def shows_error_detail(setting: str | None, environment: str) -> bool:
    """SLESS_ERROR_DETAIL as given, else whether ``environment`` is a preview."""
    if setting in ("1", "true"):
        return True
    if setting in ("0", "false"):
        return False
    return environment.startswith("pr-")


def describe_exception(exc: BaseException) -> str:
    name = type(exc).__name__
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable>"
    return f"{name}: {message}" if message else name


def _make_json_encode() -> Callable:
    """``json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode``
    without importing json (which imports re): the C encoder that it calls, called the same
    way, with a fresh encoder per value as it makes one (its record of the containers being
    encoded, against cycles, is not for two threads, nor kept after an error). json itself
    where that encoder is missing or does not answer as json does."""
    try:
        from _json import encode_basestring, make_encoder

        def default(value):
            raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")

        def encode(value) -> str:
            if isinstance(value, str):
                return encode_basestring(value)
            encoder = make_encoder(
                {}, default, encode_basestring, None, ":", ",", False, False, False
            )
            return "".join(encoder(value, 0))

        if encode({"a": [1, 2.5, None, True, "é\n"]}) == '{"a":[1,2.5,null,true,"é\\n"]}':
            return encode
    except Exception:  # pragma: no cover - another Python
        pass
    import json  # pragma: no cover

    return json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


_json_encode = _make_json_encode()


def _json_decode(body: bytes):
    import json  # with re, 3-5 ms: only once a call has a body

    return json.loads(body)


def to_json(value) -> str:
    return _json_encode(value)


# --------------------------------------------------------------------------- HTTP


# http.HTTPStatus's phrases (Python 3.11), without importing http and enum
_REASONS = {
    100: "Continue",
    101: "Switching Protocols",
    102: "Processing",
    103: "Early Hints",
    200: "OK",
    201: "Created",
    202: "Accepted",
    203: "Non-Authoritative Information",
    204: "No Content",
    205: "Reset Content",
    206: "Partial Content",
    207: "Multi-Status",
    208: "Already Reported",
    226: "IM Used",
    300: "Multiple Choices",
    301: "Moved Permanently",
    302: "Found",
    303: "See Other",
    304: "Not Modified",
    305: "Use Proxy",
    307: "Temporary Redirect",
    308: "Permanent Redirect",
    400: "Bad Request",
    401: "Unauthorized",
    402: "Payment Required",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    407: "Proxy Authentication Required",
    408: "Request Timeout",
    409: "Conflict",
    410: "Gone",
    411: "Length Required",
    412: "Precondition Failed",
    413: "Request Entity Too Large",
    414: "Request-URI Too Long",
    415: "Unsupported Media Type",
    416: "Requested Range Not Satisfiable",
    417: "Expectation Failed",
    418: "I'm a Teapot",
    421: "Misdirected Request",
    422: "Unprocessable Entity",
    423: "Locked",
    424: "Failed Dependency",
    425: "Too Early",
    426: "Upgrade Required",
    428: "Precondition Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    451: "Unavailable For Legal Reasons",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
    506: "Variant Also Negotiates",
    507: "Insufficient Storage",
    508: "Loop Detected",
    510: "Not Extended",
    511: "Network Authentication Required",
}
_STATUS_LINES = {
    code: f"HTTP/1.1 {code} {phrase}\r\n".encode("latin-1") for code, phrase in _REASONS.items()
}
_SKIPPED_RESPONSE_HEADERS = frozenset(
    ("content-length", "transfer-encoding", "connection", "date", "keep-alive")
)
_JSON_200 = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
_CLOSE = b"Connection: close\r\n"
_date_cache = [0, b""]
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _date_line() -> bytes:
    now = int(time.time())
    cache = _date_cache
    if cache[0] != now:
        cache[1] = f"Date: {http_date(now)}\r\n".encode("latin-1")
        cache[0] = now
    return cache[1]


def http_date(now: float) -> str:
    """``email.utils.formatdate(now, usegmt=True)``, without importing the email package."""
    t = time.gmtime(now)
    return (
        f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year:04d} "
        f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"
    )


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} Unknown\r\n".encode("latin-1")
    return line


def _build(
    status: int,
    content_type: str | None,
    body: bytes,
    keep: bool,
    is_head: bool,
    extra: bytes = b"",
) -> bytes:
    parts = [_status_line(status)]
    if content_type:
        parts.append(f"Content-Type: {content_type}\r\n".encode("latin-1"))
    if status != 204 and status != 304:
        parts.append(b"Content-Length: %d\r\n" % len(body))
    parts.append(_date_line())
    if extra:
        parts.append(extra)
    if not keep:
        parts.append(_CLOSE)
    parts.append(b"\r\n")
    if not is_head and status != 204 and status != 304:
        parts.append(body)
    return b"".join(parts)


def _json_error(status: int, message: str, keep: bool, is_head: bool) -> bytes:
    body = to_json({"error": message}).encode()
    return _build(status, "application/json", body, keep, is_head)


def render_result(result, keep: bool, is_head: bool) -> bytes:
    """The HTTP response for a handler's return value."""
    if result is None:
        return _build(204, None, b"", keep, is_head)
    if type(result) is dict or isinstance(result, Mapping):
        if "statusCode" in result:
            return _render_status_form(result, keep, is_head)
        if type(result) is not dict:
            result = dict(result)
    try:
        body = _json_encode(result).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        return _json_error(
            500,
            f"handler result is not JSON serialisable: {describe_exception(exc)}",
            keep,
            is_head,
        )
    if keep and not is_head:
        return b"".join((_JSON_200, b"%d\r\n" % len(body), _date_line(), b"\r\n", body))
    return _build(200, "application/json", body, keep, is_head)


class _BadResult(Exception):
    """A handler's result that cannot be an HTTP response (its 500 says why)."""


def status_head(result: Mapping) -> tuple[int, str | None, list[str]]:
    """The status, Content-Type and other header lines of a status form's response."""
    status = result["statusCode"]
    if type(status) is not int or not 200 <= status <= 599:
        raise _BadResult(f"handler returned an invalid statusCode {status!r} (expected 200-599)")
    headers = result.get("headers") or {}
    if not isinstance(headers, Mapping):
        raise _BadResult("handler returned 'headers' that is not a mapping")
    content_type = None
    extra = []
    for name, value in headers.items():
        name = str(name)
        value = value if isinstance(value, str) else str(value)
        if (
            not name
            or any(c in name for c in "\r\n: \t")
            or "\r" in value
            or "\n" in value
            or not (name.isascii() and value.isascii())
        ):
            raise _BadResult(f"handler returned an invalid response header {name!r}")
        lower = name.lower()
        if lower == "content-type":
            content_type = value
        elif lower not in _SKIPPED_RESPONSE_HEADERS:
            extra.append(f"{name}: {value}\r\n")
    return status, content_type, extra


def _render_status_form(result: Mapping, keep: bool, is_head: bool) -> bytes:
    try:
        status, content_type, extra = status_head(result)
    except _BadResult as exc:
        return _json_error(500, str(exc), keep, is_head)
    body = result.get("body")
    if body is None:
        payload = b""
    elif isinstance(body, str):
        payload = body.encode()
        content_type = content_type or "text/plain; charset=utf-8"
    elif isinstance(body, (bytes, bytearray, memoryview)):
        payload = bytes(body)
        content_type = content_type or "application/octet-stream"
    else:
        try:
            payload = _json_encode(body).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            return _json_error(
                500,
                f"handler body is not JSON serialisable: {describe_exception(exc)}",
                keep,
                is_head,
            )
        content_type = content_type or "application/json"
    return _build(status, content_type, payload, keep, is_head, "".join(extra).encode("ascii"))


_stream_module = []


def stream_module():
    """``_sless_stream`` beside this file, loaded on the first stream (the handler's folder,
    not this one, is on ``sys.path``)."""
    if not _stream_module:
        spec = spec_from_file_location(
            "_sless_stream", os.path.join(_RUNTIME_DIR, "_sless_stream.py")
        )
        module = module_from_spec(spec)
        spec.loader.exec_module(module)
        _stream_module.append(module)
    return _stream_module[0]


def websocket_module():
    """``_sless_ws`` beside this file, loaded at the start of a function that serves
    WebSockets (SLESS_WEBSOCKET=1) and by no other."""
    spec = spec_from_file_location("_sless_ws", os.path.join(_RUNTIME_DIR, "_sless_ws.py"))
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close_quietly(values) -> None:
    """End a stream's iteration; what the handler raises then is in the log."""
    if values is None:
        return
    try:
        values.close()
    except BaseException as exc:
        print_handler_exception(exc, "[sless] the handler raised as its stream was closed:")


def _is_stream(value) -> bool:
    return hasattr(value, "__next__") or hasattr(value, "__anext__")


def stream_of(result) -> Mapping | None:
    """The status form (``statusCode``, ``headers``, ``body``) of a result that streams,
    or None: a generator or async generator, alone or as a status form's body."""
    if type(result) is dict or isinstance(result, Mapping):
        body = result.get("body") if "statusCode" in result else None
        return result if body is not None and _is_stream(body) else None
    if result is None or type(result) in (str, bytes, list):
        return None
    return {"statusCode": 200, "body": result} if _is_stream(result) else None


class _Stream:
    """What the watchdog needs of a response being streamed."""

    __slots__ = ("chunked", "end", "events", "gone", "over", "status", "write_lock", "written")

    def __init__(self, status: int, end: float, events: bool):
        self.status = status
        self.chunked = True  # HTTP/1.1; HTTP/1.0's body ends with the connection
        self.end = end  # its maxSec
        self.events = events  # text/event-stream: heartbeats while the handler is quiet
        self.gone = False  # the client went away
        self.over = False  # its last chunk went out, or it ended: nothing more is written
        self.written = float("inf")  # no heartbeat before the head is out
        self.write_lock = threading.Lock()  # the serving thread's and the heartbeat's


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Connection:
    """One client connection. ``deadline`` is non-zero while a handler runs."""

    __slots__ = (
        "abandoned",
        "buf",
        "call",
        "deadline",
        "is_head",
        "keep",
        "lock",
        "sock",
        "stream",
    )

    def __init__(self, sock: _socket.socket, buf: bytes = b""):
        self.sock = sock
        self.call: list | None = None  # the call being served (see new_call)
        self.buf = buf
        self.deadline = 0.0
        self.abandoned = False
        self.keep = True
        self.is_head = False
        self.lock = threading.Lock()
        self.stream: _Stream | None = None  # while a streamed response goes out


class Load:
    """What /health reports of the calls: running now, answered, and busy seconds.

    Busy seconds are the integral of the calls running over time, so a scraper reads
    the average concurrency between two reads as Δbusy/Δt (as Knative's queue-proxy).
    A call counts from just before the handler runs until its answer is decided (a
    call past its timeout ends with its 504, though its abandoned thread runs on).
    """

    __slots__ = ("busy", "inflight", "lock", "requests", "since")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight = 0
        self.requests = 0
        self.busy = 0.0
        self.since = _monotonic()

    def begin(self) -> None:
        with self.lock:
            now = _monotonic()
            self.busy += self.inflight * (now - self.since)
            self.since = now
            self.inflight += 1

    def end(self) -> None:
        with self.lock:
            now = _monotonic()
            self.busy += self.inflight * (now - self.since)
            self.since = now
            self.inflight -= 1
            self.requests += 1

    def report(self) -> bytes:
        """The /health body."""
        with self.lock:
            busy = self.busy + self.inflight * (_monotonic() - self.since)
            inflight, requests = self.inflight, self.requests
        report = {"status": "ok", "inflight": inflight, "requests": requests, "busySeconds": busy}
        return _json_encode(report).encode()


class Server:
    def __init__(
        self,
        handler: Callable,
        host: str,
        port: int,
        timeout: float,
        function_name: str = "",
        environment: str = "",
        entrypoint: str = "",
        replica_key: str | None = None,
        error_detail: bool = False,
        stream_idle: float = DEFAULT_STREAM_IDLE_SEC,
        stream_max: float = DEFAULT_STREAM_MAX_SEC,
        heartbeat: float = HEARTBEAT_SEC,
        stream_drain: float = DEFAULT_STREAM_DRAIN_SEC,
        websocket=None,
        request_stream: bool = False,
    ):
        self.call, self.needs_context = make_caller(handler)
        self.stream_idle = stream_idle
        self.stream_max = stream_max
        self.heartbeat = heartbeat
        self.stream_drain = stream_drain
        self.request_stream = request_stream  # bodies are read by the handler, as they come
        # _sless_ws.WebSockets where SLESS_WEBSOCKET is on, and the sockets open now
        self.websocket = websocket
        self.sockets: set = set()
        self.error_detail = error_detail
        # set where others share the network (the local backend): a call without it did
        # not come through the proxy, and skipped its limits and its record
        self.replica_key = replica_key.encode("latin-1") if replica_key else None
        self.host = host
        self.port = port
        self.timeout = timeout
        self.function_name = function_name
        self.environment = environment
        self.entrypoint = entrypoint
        self.connections: set[_Connection] = set()
        self.load = Load()
        self.stopping = False
        self.timeout_text = f"function timed out after {format_seconds(timeout)}s"
        self.listener: _socket.socket | None = None

    # -- lifecycle

    def bind(self) -> None:
        host = self.host or None
        if host is not None and host.isascii():
            host = host.encode()  # as str, getaddrinfo imports the idna codec first
        infos = _socket.getaddrinfo(
            host, self.port, type=_socket.SOCK_STREAM, flags=_socket.AI_PASSIVE
        )
        family, socktype, proto, _, address = infos[0]
        listener = _socket.socket(family, socktype, proto)
        listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
        self.listener = listener
        self.port = listener.getsockname()[1]

    def serve_forever(self) -> None:
        """Accept connections until SIGTERM or SIGINT raises _Stop; in the main thread."""
        listener = self.listener
        assert listener is not None
        family, kind, proto = listener.family, listener.type, listener.proto
        # The kernel hands a signal to any thread, and one taken by another thread does not
        # interrupt a blocking accept() here, which would then wait for a connection before
        # the handler could stop it. Python's C handler writes to the wakeup fd wherever it
        # runs: this thread waits on that fd and on the listener, and runs the Python
        # handler as soon as the wait returns.
        wake, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        _signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        listener.setblocking(False)
        waits = select.poll()
        waits.register(listener, select.POLLIN)
        waits.register(wake, select.POLLIN)
        listening = listener.fileno()
        threading.Thread(target=self._watchdog, name="sless-watchdog", daemon=True).start()
        while not self.stopping:
            events = waits.poll()
            if any(fd == wake for fd, _ in events):
                os.read(wake, 512)
            if not any(fd == listening for fd, _ in events):
                continue
            try:
                fd, _ = listener._accept()
            except BlockingIOError:  # taken back by the client meanwhile
                continue
            except OSError:
                if self.stopping:
                    break
                time.sleep(0.01)  # e.g. EMFILE: back off instead of spinning
                continue
            self._start(_Connection(_socket.socket(family, kind, proto, fd)))

    def _start(self, conn: _Connection, first: bytes | None = None, more: bool = True) -> None:
        self.connections.add(conn)
        thread = threading.Thread(target=self._serve, args=(conn, first, more), daemon=True)
        try:
            thread.start()
        except RuntimeError:  # cannot start a new thread
            self.connections.discard(conn)
            conn.sock.close()

    def drain(self, grace: float, stream_grace: float | None = None) -> None:
        """Wait until no handler runs (abandoned ones aside), at most ``grace`` seconds,
        and no stream or WebSocket is open, at most ``stream_grace`` (they are long by
        nature: a call's grace would cut them); the WebSockets still open then are closed
        with 1001 and get the close handshake and their onDisconnect."""
        start = _monotonic()
        calls_end = start + grace
        streams_end = start + (grace if stream_grace is None else stream_grace)
        sockets_end = None
        while True:
            now = _monotonic()
            conns = list(self.connections)
            calls = now < calls_end and any(
                c.deadline and not c.abandoned and c.stream is None for c in conns
            )
            streams = now < streams_end and any(
                c.stream is not None and not c.abandoned for c in conns
            )
            sockets = False
            if self.sockets:
                if sockets_end is None and now >= streams_end:
                    # each peer has the close handshake's 5 s, its onDisconnect the timeout
                    sockets_end = now + 5.0 + self.timeout + 1
                    for socket in list(self.sockets):
                        socket.going_away()
                sockets = sockets_end is None or now < sockets_end
            if not (calls or streams or sockets):
                break
            time.sleep(0.02)

    # -- the watchdog

    def _watchdog(self) -> None:
        tick = min(0.05, self.timeout / 4)
        looked = 0.0
        while True:
            time.sleep(tick)
            try:
                now = _monotonic()
                streams = []
                for conn in list(self.connections):
                    deadline = conn.deadline
                    if deadline and now >= deadline:
                        self._expire(conn)
                    elif conn.stream is not None:
                        streams.append(conn)
                if streams and now - looked >= 0.25:
                    looked = now
                    self._look_after(streams, now)
                if self.sockets:
                    for socket in list(self.sockets):
                        socket.look_after(now)
            except Exception:  # never let the watchdog die
                print_exc()

    def _look_after(self, conns: list, now: float) -> None:
        """Streams: mark those whose client went away (the handler's iteration is closed
        at its next value), and send an event stream quiet for HEARTBEAT_SEC a comment."""
        waits = select.poll()
        by_fd = {}
        for conn in conns:
            try:
                fd = conn.sock.fileno()
            except OSError:
                continue
            if fd >= 0:
                by_fd[fd] = conn
                waits.register(fd, select.POLLRDHUP)
        for fd, _ in waits.poll(0):  # RDHUP, HUP or ERR: the peer closed its side
            stream = by_fd[fd].stream
            if stream is not None:
                stream.gone = True
        beat = b": heartbeat\n\n"
        for conn in conns:
            stream = conn.stream
            if stream is None or not stream.events or now - stream.written < self.heartbeat:
                continue
            if not stream.write_lock.acquire(blocking=False):  # a chunk is going out
                continue
            try:  # looked at again under the lock: the last chunk may have gone meanwhile
                if stream.over or stream.gone or now - stream.written < self.heartbeat:
                    continue
                out = b"d\r\n%b\r\n" % beat if stream.chunked else beat
                # os.write: the socket has a timeout, so it is non-blocking, and the
                # watchdog must never wait on a client that does not read
                sent = os.write(conn.sock.fileno(), out)
                if sent == len(out):
                    stream.written = _monotonic()
                else:  # half a heartbeat breaks the framing: the stream is cut
                    stream.gone = True
                    conn.sock.shutdown(_socket.SHUT_RDWR)
            except BlockingIOError:
                pass  # its buffer is full: not idle where it matters
            except OSError:
                stream.gone = True
            finally:
                stream.write_lock.release()

    def _expire(self, conn: _Connection) -> None:
        with conn.lock:
            # looked at again: a stream's deadline moves on with each of its values
            if not conn.deadline or conn.abandoned or _monotonic() < conn.deadline:
                return
            conn.abandoned = True
            call = conn.call  # before its thread, which sees it abandoned, clears it
        self.load.end()
        self.connections.discard(conn)
        tag = "" if call is None else _tag(call)
        stream = conn.stream
        if stream is not None:  # its head is out: it can only end, unfinished
            idle = _monotonic() < stream.end
            why = (
                f"sent nothing for {format_seconds(self.stream_idle)}s (stream.idleSec)"
                if idle
                else f"ran for {format_seconds(self.stream_max)}s (stream.maxSec)"
            )
            print(f"{tag}[sless] the stream {why}; it is ended", file=sys.stderr, flush=True)
            if _exporter is not None and call is not None:
                _exporter.add(call, stream.status, f"stream {why}")
            try:  # cut now; its thread closes the socket once the handler lets it go
                conn.sock.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass
            return
        print(
            f"{tag}[sless] {self.timeout_text}; the call is abandoned", file=sys.stderr, flush=True
        )
        if _exporter is not None and call is not None:
            _exporter.add(call, 504, self.timeout_text)
        keep = conn.keep and not self.stopping
        reply = _json_error(504, self.timeout_text, keep, conn.is_head)
        # A fresh thread answers 504 and, on a keep-alive connection, goes on serving it.
        self._start(_Connection(conn.sock, conn.buf), reply, keep)

    # -- one connection

    def _serve(self, conn: _Connection, first: bytes | None, more: bool) -> None:
        sock = conn.sock
        _local.serving = conn  # where this thread's writes find the call it serves
        try:
            if first is not None:
                sock.sendall(first)
            if not more:
                return
            try:
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            except OSError:
                pass
            sock.settimeout(IDLE_TIMEOUT_SEC)
            while self._one_request(conn, sock):
                pass
        except (OSError, _ClientGone):
            pass
        except Exception:
            print_exc()
        finally:
            if not conn.abandoned:
                self.connections.discard(conn)
                _close(sock)

    def _one_request(self, conn: _Connection, sock: _socket.socket) -> bool:
        """Read, run and answer one request; False when the connection is done."""
        buf = conn.buf
        while buf[:2] == b"\r\n":  # tolerated before a request line
            buf = buf[2:]
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            if len(buf) > MAX_HEADER_BYTES:
                sock.sendall(_json_error(431, "request header too large", False, False))
                return False
            data = sock.recv(RECV_SIZE)
            if not data:
                return False
            start = max(0, len(buf) - 3)
            buf += data
            while buf[:2] == b"\r\n":
                buf = buf[2:]
            end = buf.find(b"\r\n\r\n", start if start < len(buf) else 0)
        if end > MAX_HEADER_BYTES:
            sock.sendall(_json_error(431, "request header too large", False, False))
            return False
        head = buf[:end].decode("latin-1")
        conn.buf = buf[end + 4 :]
        try:
            method, target, version, headers, keep, is_head = _parse_head(head)
            if self.request_stream:  # the handler reads the body (stream: {request: true})
                reader, body = self._body_reader(conn, sock, headers, version), b""
            else:
                reader, body = None, self._read_body(conn, sock, headers, version)
            if "transfer-encoding" in headers and "content-length" in headers:
                keep = False
        except _BadRequest as exc:
            sock.sendall(_json_error(exc.status, str(exc), False, False))
            return False
        if self.stopping:
            keep = False

        path, _, query = target.partition("?")
        if path == "/health" and (method == "GET" or is_head):
            # the load figures only to the proxy where others share the network (the local
            # backend's key): they would tell a neighbour's function how this one is used
            key = self.replica_key
            shown = key is None or _compare_digest(
                headers.get(REPLICA_KEY_HEADER, "").encode("latin-1", "replace"), key
            )
            report = self.load.report() if shown else b'{"status":"ok"}'
            sock.sendall(_build(200, "application/json", report, keep, is_head))
            return keep
        if self.replica_key is not None:
            given = headers.pop(REPLICA_KEY_HEADER, "").encode("latin-1", "replace")
            if not _compare_digest(given, self.replica_key):  # hmac.compare_digest
                sock.sendall(_json_error(403, "call functions through the proxy", keep, is_head))
                return keep
        if (  # the only cost to a call: with SLESS_WEBSOCKET off, None is all it looks at
            self.websocket is not None
            and "upgrade" in headers
            and headers["upgrade"].strip().lower() == "websocket"
        ):
            return self.websocket.upgrade(
                self, conn, sock, method, path, query, version, headers, keep
            )

        if body:
            try:
                event = _json_decode(body)
            except (ValueError, RecursionError):
                event = None
            if type(event) is not dict:
                event = {"_body": body.decode("utf-8", "replace")}
        else:
            event = {}
        if "%" in path:
            from urllib.parse import unquote

            path = unquote(path)
        event["_path"] = path or "/"
        event["_query"] = _parse_query(query) if query else {}
        event["_method"] = method
        event["_headers"] = headers
        if reader is not None:
            event["_stream"] = reader

        conn.keep = keep
        conn.is_head = is_head
        deadline = _monotonic() + self.timeout
        exporter = _exporter
        if self.needs_context or exporter is not None:
            context = Context(
                self.function_name,
                self.environment,
                headers.get("x-request-id"),
                deadline,
                headers.get("traceparent"),
                headers.get("tracestate"),
                None if exporter is None else f"{_random_bits(64) | 1:016x}",
            )
        else:
            context = None
        call = conn.call = [headers, context, None, None, None, 0, method]  # see new_call
        try:
            if exporter is not None:
                call[_START] = time.time_ns()
            self.load.begin()
            conn.deadline = deadline
            raised: BaseException | None = None
            try:
                result = self.call(event, context)
            except BaseException as exc:
                raised = exc
            if reader is not None and not reader.done:  # what is left of it is not read
                keep = False
            if raised is None and (type(result) is not dict or "statusCode" in result):
                form = stream_of(result)
                if form is not None:
                    return self._stream(conn, sock, call, form, keep, version, method, path)
            with conn.lock:
                if conn.abandoned:  # the timeout answered for it
                    return False
                conn.deadline = 0.0
            self.load.end()
            if self.stopping:
                keep = False
            error = None
            if raised is None:
                try:
                    reply = render_result(result, keep, is_head)
                except Exception as exc:
                    raised = exc
            if raised is not None:
                reply = self._handler_failed(raised, call, method, path, keep, is_head)
                error = describe_exception(raised)
            if exporter is not None:
                exporter.add(call, int(reply[9:12]), error)
        finally:
            conn.call = None
            if call[_OUT] or call[_ERR]:
                end_partial_lines(call)
        sock.sendall(reply)
        return keep

    def _stream(
        self,
        conn: _Connection,
        sock: _socket.socket,
        call: list,
        form: Mapping,
        keep: bool,
        version: str,
        method: str,
        path: str,
    ) -> bool:
        """Send a streamed response, each value the handler yields as a chunk once it is
        produced. The first comes within the call's timeout (else the 504 of any call);
        then the stream ends, unfinished (no last chunk: the client sees it), after
        ``stream_idle`` seconds without a value or ``stream_max`` in all, after an
        exception, or once the client went away (the handler's iteration is closed)."""
        runner = getattr(_local, "runner", None)  # an async handler's loop, kept for it
        _local.runner = None
        is_head = conn.is_head
        first = raised = values = None
        empty = False
        try:
            streams = stream_module()
            values = streams.Values(form["body"], runner)
            runner = None
            while not conn.abandoned:  # an empty value sends nothing: wait for one that does
                first = values.next_value()
                if not streams.is_empty(first):
                    break
        except StopIteration:
            empty = True
        except BaseException as exc:
            raised = exc
        if runner is not None:  # Values was not made: the loop is not needed
            runner.close()
        head = b""
        if raised is None:
            try:
                status, content_type, extra = status_head(form)
                content_type = content_type or streams.content_type_of(first)
                encode = streams.encoder(content_type, _json_encode)
                data = b"" if empty else encode(first)
            except Exception as exc:  # a bad status form, or a first value not JSON
                raised = exc
        no_body = empty or is_head or raised is not None or status in (204, 304)
        with conn.lock:
            if conn.abandoned:  # the timeout answered for it
                _close_quietly(values)
                return False
            if no_body:
                conn.deadline = 0.0
            else:
                now = _monotonic()
                events = content_type.lower().startswith(streams.EVENT_STREAM)
                stream = conn.stream = _Stream(status, now + self.stream_max, events)
                conn.deadline = min(now + self.stream_idle, stream.end)
        if self.stopping:
            keep = False
        exporter = _exporter
        if raised is not None:
            self.load.end()
            _close_quietly(values)
            if isinstance(raised, _BadResult):
                reply = _json_error(500, str(raised), keep, is_head)
            else:
                reply = self._handler_failed(raised, call, method, path, keep, is_head)
            if exporter is not None:
                exporter.add(call, 500, describe_exception(raised))
            sock.sendall(reply)
            return keep
        chunked = version == "HTTP/1.1" and not no_body
        lines = [f"Content-Type: {content_type}\r\n", *extra]
        named = {line.partition(":")[0].lower() for line in extra}
        if content_type.lower().startswith(streams.EVENT_STREAM) and "cache-control" not in named:
            lines.append("Cache-Control: no-cache\r\n")
        if "x-accel-buffering" not in named:
            lines.append("X-Accel-Buffering: no\r\n")  # nginx in front: pass each chunk on
        if chunked:
            lines.append("Transfer-Encoding: chunked\r\n")
        elif not no_body:
            keep = False  # HTTP/1.0: the body ends with the connection
        if empty and status not in (204, 304):  # HEAD of a stream: no length, as node
            lines.append("Content-Length: 0\r\n")
        if not keep:
            lines.append("Connection: close\r\n")
        head = b"".join(
            (_status_line(status), "".join(lines).encode("latin-1"), _date_line(), b"\r\n")
        )
        if no_body:
            self.load.end()
            _close_quietly(values)
            if exporter is not None:
                exporter.add(call, status, None)
            sock.sendall(head)
            return keep
        return self._stream_body(conn, sock, call, values, encode, head, data, chunked, keep)

    def _stream_body(
        self,
        conn: _Connection,
        sock: _socket.socket,
        call: list,
        values,
        encode: Callable,
        head: bytes,
        data: bytes,
        chunked: bool,
        keep: bool,
    ) -> bool:
        stream = conn.stream
        assert stream is not None
        stream.chunked = chunked
        error = None
        finished = False

        def send(out: bytes, last: bool = False) -> bool:
            with stream.write_lock:
                if last:
                    stream.over = True  # no heartbeat after the last chunk
                try:
                    sock.sendall(out)
                except OSError:
                    stream.gone = True
                    return False
                stream.written = _monotonic()
                return True

        frame = (lambda d: b"%x\r\n%b\r\n" % (len(d), d)) if chunked else (lambda d: d)
        try:
            if send(head + frame(data)):
                while True:
                    try:
                        value = values.next_value()
                    except StopIteration:
                        finished = True
                        break
                    with conn.lock:
                        if conn.abandoned:  # past idleSec or maxSec: said and cut
                            break
                        conn.deadline = min(_monotonic() + self.stream_idle, stream.end)
                    if stream.gone:
                        break
                    data = encode(value)
                    if data and not send(frame(data)):
                        break
        except BaseException as exc:  # the handler's, mid-stream: the response ends unfinished
            request_id = _call_context(call).request_id
            print_handler_exception(
                exc,
                f"[sless] the handler raised mid-stream (request {request_id}); "
                "the response ends unfinished:",
            )
            error = describe_exception(exc)
            finished = None
        # ends its iteration where it did not end (nobody reads: nothing is produced for
        # nobody), and frees the loop of an async one
        _close_quietly(values)
        with conn.lock:
            if conn.abandoned:  # past a limit: cut, and the socket is this thread's to close
                _close(sock)
                return False
            conn.deadline = 0.0  # no limit fires from here on
        if finished and chunked:
            finished = send(b"0\r\n\r\n", last=True)
        with stream.write_lock:
            stream.over = True
        with conn.lock:
            conn.stream = None
        self.load.end()
        if _exporter is not None:
            if error is None and not finished:
                error = "the client went away mid-stream"
            _exporter.add(call, stream.status, error)
        return keep and bool(finished)

    def _handler_failed(
        self, exc: BaseException, call: list, method: str, path: str, keep: bool, is_head: bool
    ) -> bytes:
        """The 500 for a handler's exception, which is always in the log. Its text can
        hold what the caller sent or what the function knows, so the caller reads it only
        where details are shown; elsewhere, the request id that finds it in the log."""
        request_id = _call_context(call).request_id  # the log tag's and the context's
        print_handler_exception(
            exc, f"[sless] the handler raised on {method} {path} (request {request_id}):"
        )
        if self.error_detail:
            return _json_error(500, describe_exception(exc), keep, is_head)
        body = to_json({"error": GENERIC_ERROR, "requestId": request_id}).encode()
        return _build(500, "application/json", body, keep, is_head)

    def _read_body(self, conn: _Connection, sock: _socket.socket, headers: dict, version: str):
        te = headers.get("transfer-encoding")
        if te is not None:
            codings = [c.strip().lower() for c in te.split(",")]
            if codings[-1] != "chunked":
                raise _BadRequest(501, f"unsupported Transfer-Encoding {te!r}")
            if any(c not in ("chunked", "identity") for c in codings):
                raise _BadRequest(501, f"unsupported Transfer-Encoding {te!r}")
            self._continue(sock, headers, version)
            return self._read_chunked(conn, sock)
        length = headers.get("content-length")
        if length is None:
            return b""
        if not (length.isascii() and length.isdigit()):
            raise _BadRequest(400, f"invalid Content-Length {length!r}")
        size = int(length)
        if size > MAX_BODY_BYTES:
            raise _BadRequest(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        buf = conn.buf
        if len(buf) >= size:
            conn.buf = buf[size:]
            return buf[:size]
        self._continue(sock, headers, version)
        chunks = [buf]
        have = len(buf)
        while have < size:
            data = sock.recv(max(RECV_SIZE, size - have))
            if not data:
                raise _ClientGone
            chunks.append(data)
            have += len(data)
        data = b"".join(chunks)
        conn.buf = data[size:]
        return data[:size]

    def _body_reader(self, conn: _Connection, sock: _socket.socket, headers: dict, version: str):
        """The body as a file-like object the handler reads (``_sless_stream.RequestBody``),
        with no size limit of its own: the proxy's maxBodyBytes bounds it on the way."""
        te = headers.get("transfer-encoding")
        if te is not None:
            codings = [c.strip().lower() for c in te.split(",")]
            if codings[-1] != "chunked" or any(c not in ("chunked", "identity") for c in codings):
                raise _BadRequest(501, f"unsupported Transfer-Encoding {te!r}")
            length = 0
        else:
            text = headers.get("content-length", "0")
            if not (text.isascii() and text.isdigit()):
                raise _BadRequest(400, f"invalid Content-Length {text!r}")
            length = int(text)
        if te is not None or length:
            self._continue(sock, headers, version)
        return stream_module().RequestBody(conn, sock, te is not None, length)

    @staticmethod
    def _continue(sock: _socket.socket, headers: dict, version: str) -> None:
        if version == "HTTP/1.1" and headers.get("expect", "").lower() == "100-continue":
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")

    @staticmethod
    def _read_chunked(conn: _Connection, sock: _socket.socket) -> bytes:
        buf = conn.buf
        chunks = []
        total = 0

        def need_line(buf):
            while b"\r\n" not in buf:
                if len(buf) > MAX_HEADER_BYTES:
                    raise _BadRequest(400, "invalid chunked body")
                data = sock.recv(RECV_SIZE)
                if not data:
                    raise _ClientGone
                buf += data
            return buf

        while True:
            buf = need_line(buf)
            line, _, buf = buf.partition(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadRequest(400, "invalid chunk size in chunked body") from None
            if size < 0:
                raise _BadRequest(400, "invalid chunk size in chunked body")
            if size == 0:
                while True:  # trailer fields, up to the empty line
                    buf = need_line(buf)
                    line, _, buf = buf.partition(b"\r\n")
                    if not line:
                        conn.buf = buf
                        return b"".join(chunks)
            total += size
            if total > MAX_BODY_BYTES:
                raise _BadRequest(413, f"request body larger than {MAX_BODY_BYTES} bytes")
            while len(buf) < size + 2:
                data = sock.recv(max(RECV_SIZE, size + 2 - len(buf)))
                if not data:
                    raise _ClientGone
                buf += data
            if buf[size : size + 2] != b"\r\n":
                raise _BadRequest(400, "invalid chunked body")
            chunks.append(buf[:size])
            buf = buf[size + 2 :]


class _ClientGone(Exception):
    pass


def _parse_query(query: str) -> dict[str, str]:
    from urllib.parse import parse_qsl  # only for calls with a query string

    return dict(parse_qsl(query, keep_blank_values=True))


def _parse_head(head: str):
    lines = head.split("\r\n")
    request_line = lines[0].split(" ")
    if len(request_line) != 3:
        raise _BadRequest(400, "malformed request line")
    method, target, version = request_line
    if version != "HTTP/1.1" and version != "HTTP/1.0":
        if not version.startswith("HTTP/1."):
            raise _BadRequest(505, f"unsupported protocol version {version!r}")
        version = "HTTP/1.1"
    if not target.startswith("/"):
        scheme, sep, rest = target.partition("://")
        if sep and scheme.lower() in ("http", "https"):  # absolute-form
            target = "/" + rest.partition("/")[2]
        elif target != "*":
            raise _BadRequest(400, "malformed request target")
    headers: dict[str, str] = {}
    last = None
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):  # obsolete line folding
            if last is None:
                raise _BadRequest(400, "malformed header line")
            headers[last] = (headers[last] + " " + line.strip(" \t")).strip(" ")
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name[-1] in " \t":
            raise _BadRequest(400, "malformed header line")
        name = name.lower()
        value = value.strip(" \t")
        if name in headers:
            headers[name] = headers[name] + ", " + value
        else:
            headers[name] = value
        last = name
    connection = headers.get("connection")
    if version == "HTTP/1.1":
        keep = connection is None or "close" not in connection.lower()
    else:
        keep = connection is not None and "keep-alive" in connection.lower()
    return method, target, version, headers, keep, method == "HEAD"


def _close(sock: _socket.socket) -> None:
    try:
        sock.shutdown(_socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


# --------------------------------------------------------------------------- main


class _Stop(Exception):
    pass


def _on_signal(signum, frame):
    raise _Stop


def take_ready_fd() -> int | None:
    """The pipe named by SLESS_READY_FD, taken out of the environment: not the handler's."""
    raw = os.environ.pop("SLESS_READY_FD", "")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise StartupError(f"SLESS_READY_FD={raw!r} is not a file descriptor number")
    fd = int(raw)
    try:
        os.set_inheritable(fd, False)  # nor the processes the handler starts
    except OSError as exc:
        raise StartupError(
            f"SLESS_READY_FD={raw!r} is not an open file descriptor: {exc.strerror}"
        ) from None
    return fd


def announce_ready(fd: int, port: int, phases: dict[str, float]) -> None:
    """Write the ready line to ``fd`` and close it."""
    line = _json_encode({"port": port, "t": phases}).encode() + b"\n"
    try:
        while line:
            line = line[os.write(fd, line) :]
    except OSError as exc:
        print(
            f"[sless] cannot write the ready line to SLESS_READY_FD={fd}: {exc.strerror}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        _close_fd(fd)


def _close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def main(started: float | None = None) -> int:
    """Serve until SIGTERM or SIGINT; ``started``: when the start began (server.py's first line)."""
    sys.dont_write_bytecode = True  # leave no __pycache__ in the function folder
    phases = {"start": _STARTED if started is None else started, "runtime": _monotonic()}
    entrypoint = os.environ.get("SLESS_ENTRYPOINT", "")
    host = os.environ.get("SLESS_HOST", "0.0.0.0")
    ready_fd = None
    try:
        ready_fd = take_ready_fd()
        port_text = os.environ.get("PORT", "8080") or "8080"
        try:
            port = int(port_text)
        except ValueError:
            raise StartupError(f"PORT={port_text!r} is not a port number") from None
        if not 0 <= port <= 65535:
            raise StartupError(f"PORT={port_text!r} is not a port number")
        timeout = parse_timeout(os.environ.get("SLESS_TIMEOUT_SEC"))
        idle, most = "SLESS_STREAM_IDLE_SEC", "SLESS_STREAM_MAX_SEC"
        stream_idle = parse_timeout(os.environ.get(idle), DEFAULT_STREAM_IDLE_SEC, idle)
        stream_max = parse_timeout(os.environ.get(most), DEFAULT_STREAM_MAX_SEC, most)
        beat = "SLESS_STREAM_HEARTBEAT_SEC"
        heartbeat = parse_timeout(os.environ.get(beat), HEARTBEAT_SEC, beat)
        drain = "SLESS_STREAM_DRAIN_SEC"
        stream_drain = parse_timeout(os.environ.get(drain), DEFAULT_STREAM_DRAIN_SEC, drain)
        function_dir = os.environ.get("SLESS_FUNCTION_DIR") or os.getcwd()
        replica_key = os.environ.pop("SLESS_REPLICA_KEY", None)  # not the handler's to see
        function_name = os.environ.get("SLESS_FUNCTION_NAME", "")
        exporter = start_span_export(function_name or entrypoint, os.environ.get("SLESS_ENV", ""))
        install_log_tags()
        handler, module = load_entrypoint(entrypoint, function_dir)
        websocket = None
        if os.environ.get("SLESS_WEBSOCKET", "").strip().lower() in ("1", "true"):
            websocket = websocket_module().configure(
                sys.modules[__name__], module, entrypoint, os.environ
            )
        phases["handler"] = _monotonic()
        server = Server(
            handler,
            host,
            port,
            timeout,
            function_name=function_name,
            environment=os.environ.get("SLESS_ENV", ""),
            entrypoint=entrypoint,
            replica_key=replica_key,
            stream_idle=stream_idle,
            stream_max=stream_max,
            heartbeat=heartbeat,
            stream_drain=stream_drain,
            websocket=websocket,
            request_stream=os.environ.get("SLESS_STREAM_REQUEST", "") in ("1", "true"),
            error_detail=shows_error_detail(
                os.environ.get("SLESS_ERROR_DETAIL"), os.environ.get("SLESS_ENV", "")
            ),
        )
        try:
            server.bind()
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: {exc}") from None
        phases["listening"] = _monotonic()
    except StartupError as exc:
        print(f"{RUNTIME} runtime: error: {exc}", file=sys.stderr, flush=True)
        _close_fd(ready_fd)  # no line: the parent reads EOF
        return 1

    try:
        _signal.signal(_signal.SIGTERM, _on_signal)
        _signal.signal(_signal.SIGINT, _on_signal)
        if ready_fd is not None:
            announce_ready(ready_fd, server.port, phases)
        print(
            f"{RUNTIME} serving {entrypoint} on {host}:{server.port}", file=sys.stderr, flush=True
        )
        server.serve_forever()
    except _Stop:
        pass
    _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    server.stopping = True
    if server.listener is not None:
        server.listener.close()
    server.drain(grace=server.timeout + 1, stream_grace=server.stream_drain)
    if exporter is not None:
        exporter.close()
    print(f"{RUNTIME} stopped", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
