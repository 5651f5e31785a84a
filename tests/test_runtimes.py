"""The function runtimes (runtimes/python3.11, runtimes/nodejs20), as real processes.

Each runtime's server is started on a free loopback port and called over real
HTTP; the runner is run as a one-shot process. The handlers are in
tests/data/runtime_fns/{python,node}/ and behave the same in both languages.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .paths import DATA, ROOT

RUNTIMES_DIR = ROOT / "runtimes"
FUNCTIONS_DIR = DATA / "runtime_fns"
NODE = shutil.which("node")

RUNTIMES = [
    pytest.param("python3.11", id="python3.11"),
    pytest.param("nodejs20", id="nodejs20"),
]


@dataclass(frozen=True)
class Runtime:
    name: str
    interpreter: str
    folder: Path
    function_dir: Path  # a copy of the handler folder, with a fake dependency added

    def command(self, role: str) -> list[str]:
        spec = json.loads((self.folder / "runtime.json").read_text())
        return [self.interpreter, str(self.folder / spec[role])]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(runtime: Runtime, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_") and k != "PORT"}
    env.update(
        SLESS_FUNCTION_DIR=str(runtime.function_dir),
        SLESS_FUNCTION_NAME="adder",
        SLESS_ENV="staging",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(extra)
    return env


class Server:
    """A runtime server process on a loopback port."""

    def __init__(self, runtime: Runtime, log_dir: Path, entrypoint: str, **env: str) -> None:
        self.runtime = runtime
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.entrypoint = entrypoint
        self.stderr_path = log_dir / f"{runtime.name}-{self.port}.stderr"
        self.stdout_path = log_dir / f"{runtime.name}-{self.port}.stdout"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                runtime.command("server"),
                env=_env(
                    runtime,
                    PORT=str(self.port),
                    SLESS_HOST="127.0.0.1",
                    SLESS_ENTRYPOINT=entrypoint,
                    **env,
                ),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 15.0) -> Server:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.stderr}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server not healthy after {timeout}s:\n{self.stderr}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def function_dirs(tmp_path_factory) -> dict[str, Path]:
    """Copies of the handler folders, each with a fake installed dependency.

    The dependency folders (`.sless-deps`, `node_modules`) are git-ignored, so
    they are made here rather than kept in tests/data.
    """
    root = tmp_path_factory.mktemp("runtime_fns")
    python_dir = root / "python"
    shutil.copytree(FUNCTIONS_DIR / "python", python_dir)
    (python_dir / ".sless-deps" / "fakedep").mkdir(parents=True)
    (python_dir / ".sless-deps" / "fakedep" / "__init__.py").write_text('NAME = "fakedep"\n')
    node_dir = root / "node"
    shutil.copytree(FUNCTIONS_DIR / "node", node_dir)
    (node_dir / "node_modules" / "fakedep").mkdir(parents=True)
    (node_dir / "node_modules" / "fakedep" / "index.js").write_text("exports.NAME = 'fakedep';\n")
    return {"python3.11": python_dir, "nodejs20": node_dir}


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request, function_dirs) -> Runtime:
    name = request.param
    if name == "nodejs20":
        if NODE is None:
            pytest.fail("node is not installed: scripts/setup installs it (the nodejs20 runtime)")
        interpreter = NODE
    else:
        interpreter = sys.executable
    return Runtime(name, interpreter, RUNTIMES_DIR / name, function_dirs[name])


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runtime_logs")


@pytest.fixture(scope="module")
def server(runtime, log_dir) -> Iterator[Server]:
    srv = Server(runtime, log_dir, "handlers.main", SLESS_TIMEOUT_SEC="5")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def slow_server(runtime, log_dir) -> Iterator[Server]:
    """A server whose calls time out after one second; /slow marks ``slow.mark`` when done."""
    mark = log_dir / f"{runtime.name}-slow.mark"
    srv = Server(runtime, log_dir, "handlers.main", SLESS_TIMEOUT_SEC="1", SLOW_MARK=str(mark))
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- server


def test_json_body_is_the_event_with_request_fields(server):
    response = httpx.post(
        f"{server.url}/echo/item?a=1&a=2&msg=hello%20world",
        json={"name": "ada", "_path": "spoofed"},
        headers={"X-Custom-Header": "Yes"},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    event = response.json()
    assert event["name"] == "ada"
    assert event["_path"] == "/echo/item"
    assert event["_query"] == {"a": "2", "msg": "hello world"}
    assert event["_method"] == "POST"
    assert event["_headers"]["x-custom-header"] == "Yes"
    assert "_body" not in event


def test_with_a_replica_key_only_calls_that_carry_it_reach_the_handler(runtime, log_dir):
    """On the local backend every sandbox shares loopback: a call straight to a replica's
    port, past the proxy's limits and records, is refused without the proxy's key."""
    key = "k3y-only-the-proxy-knows"
    srv = Server(runtime, log_dir, "handlers.main", SLESS_REPLICA_KEY=key).wait_healthy()
    try:
        for headers in ({}, {"X-Sless-Replica": "guess"}, {"X-Sless-Replica": key[:-1]}):
            direct = httpx.get(f"{srv.url}/echo", headers=headers)
            assert direct.status_code == 403, headers
            assert direct.json() == {"error": "call functions through the proxy"}
        proxied = httpx.get(f"{srv.url}/echo", headers={"X-Sless-Replica": key})
        assert proxied.status_code == 200
        assert "x-sless-replica" not in proxied.json()["_headers"]
        seen = httpx.get(f"{srv.url}/env-keys", headers={"X-Sless-Replica": key}).json()
        assert "SLESS_REPLICA_KEY" not in seen and "SLESS_ENTRYPOINT" in seen
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
    finally:
        srv.stop()


def test_without_a_replica_key_calls_are_served_as_before(server):
    assert httpx.get(f"{server.url}/echo", headers={"X-Sless-Replica": "x"}).status_code == 200


def test_sub_paths_reach_the_handler(server):
    assert httpx.get(f"{server.url}/").json()["_path"] == "/"
    deep = httpx.delete(f"{server.url}/a/b/c").json()
    assert deep["_path"] == "/a/b/c"
    assert deep["_method"] == "DELETE"
    assert deep["_query"] == {}


def test_handler_imports_a_sibling_module(server):
    response = httpx.post(f"{server.url}/add", json={"a": 2, "b": 40})
    assert response.json() == {"sum": 42}


def test_non_json_body_is_passed_as_text(server):
    response = httpx.post(f"{server.url}/echo", content=b"hello, not json \xff")
    event = response.json()
    assert event["_body"] == "hello, not json \ufffd"
    assert event["_path"] == "/echo"


def test_json_array_body_is_passed_as_text(server):
    event = httpx.post(f"{server.url}/echo", content=b"[1, 2, 3]").json()
    assert event["_body"] == "[1, 2, 3]"


def test_status_code_form_with_text_body(server):
    response = httpx.get(f"{server.url}/text")
    assert response.status_code == 201
    assert response.headers["x-custom"] == "yes"
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.text == "created"
    assert response.headers["content-length"] == "7"


def test_status_code_form_with_json_body(server):
    response = httpx.get(f"{server.url}/json-status")
    assert response.status_code == 202
    assert response.headers["x-kind"] == "json"
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"accepted": True}


def test_none_is_204(server):
    response = httpx.get(f"{server.url}/none")
    assert response.status_code == 204
    assert response.content == b""


def test_other_json_values_are_200_json(server):
    response = httpx.get(f"{server.url}/list")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == [1, 2, 3]


def test_async_handler(server):
    assert httpx.get(f"{server.url}/async").json() == {"async": True}


def test_an_exception_is_a_generic_500_with_the_request_id_and_the_detail_in_the_log(server):
    """Outside previews a caller never reads the exception's text (it can hold what the
    caller sent, or what the function knows): the request id finds it in the log."""
    response = httpx.get(f"{server.url}/boom", headers={"x-request-id": "req-4711"})
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": "the function failed; its log has the details",
        "requestId": "req-4711",
    }
    assert "kaboom" not in response.text
    assert "(request req-4711):" in server.stderr and "kaboom" in server.stderr
    anonymous = httpx.get(f"{server.url}/boom").json()["requestId"]  # no id given: one made
    assert len(anonymous) == 32 and f"(request {anonymous}):" in server.stderr
    assert httpx.get(f"{server.url}/list").status_code == 200  # still serving


@pytest.mark.parametrize(
    ("environment", "setting", "detailed"),
    [("pr-12", None, True), ("pr-12", "0", False), ("prod", "1", True), ("prod", "0", False)],
)
def test_previews_and_sless_error_detail_show_the_exception(
    runtime, log_dir, environment: str, setting: str | None, detailed: bool
):
    env = {"SLESS_ENV": environment} | ({"SLESS_ERROR_DETAIL": setting} if setting else {})
    srv = Server(runtime, log_dir, "handlers.main", **env).wait_healthy()
    try:
        response = httpx.get(f"{srv.url}/boom", headers={"x-request-id": "r1"})
    finally:
        srv.stop()
    assert response.status_code == 500
    expected = {"error": "TypeError: kaboom"} if detailed else {"requestId": "r1"}
    assert expected.items() <= response.json().items()
    assert "kaboom" in srv.stderr


def test_unserialisable_result_is_500(server):
    response = httpx.get(f"{server.url}/unserialisable")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert "not JSON serialisable" in response.json()["error"]


def test_health_does_not_call_the_handler(server):
    before = httpx.get(f"{server.url}/calls").json()["calls"]
    for _ in range(3):
        response = httpx.get(f"{server.url}/health")
        assert response.status_code == 200
        assert response.json()["status"] == "ok"  # and the load: test_runtime_readiness.py
    after = httpx.get(f"{server.url}/calls").json()["calls"]
    assert after == before + 1


def test_context_argument(server):
    response = httpx.get(f"{server.url}/context", headers={"X-Request-Id": "req-123"})
    ctx = response.json()
    assert ctx["function_name"] == "adder"
    assert ctx["environment"] == "staging"
    assert ctx["request_id"] == "req-123"
    assert 0 < ctx["remaining_ms"] <= 5000

    generated = httpx.get(f"{server.url}/context").json()["request_id"]
    assert len(generated) == 32
    int(generated, 16)


PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_handler_is_given_the_calls_trace_and_headers_to_carry_it_on(server):
    sent = {"traceparent": PARENT, "tracestate": "vendor=abc"}
    found = httpx.get(f"{server.url}/trace", headers=sent).json()
    assert found["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert found["traceparent"] == PARENT
    outgoing = found["outgoing"]
    # the same trace, this call's own span as the parent, the sampled flag kept
    version, trace_id, parent, flags = outgoing["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", found["trace_id"], "01")
    assert len(parent) == 16 and parent not in ("00f067aa0ba902b7", "0" * 16)
    assert outgoing["tracestate"] == "vendor=abc"


@pytest.mark.parametrize(
    "traceparent",
    [
        None,
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # an all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # an all-zero parent
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # a forbidden version
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
    ],
)
def test_a_call_without_a_valid_trace_starts_one(server, traceparent):
    sent = {"tracestate": "vendor=abc", **({"traceparent": traceparent} if traceparent else {})}
    found = httpx.get(f"{server.url}/trace", headers=sent).json()
    version, trace_id, parent, flags = found["traceparent"].split("-")
    assert version == "00" and flags == "01" and trace_id == found["trace_id"]
    assert len(trace_id) == 32 and trace_id != "0" * 32 and int(trace_id, 16)
    assert len(parent) == 16 and parent != "0" * 16
    assert trace_id != "4bf92f3577b34da6a3ce929d0e0e4736"
    # its tracestate belonged to the context that was not valid: not carried on
    assert "tracestate" not in found["outgoing"]


def test_keep_alive_serves_two_requests_on_one_connection(server):
    with httpx.Client() as client:
        first = client.post(f"{server.url}/add", json={"a": 1, "b": 1})
        first_addr = first.extensions["network_stream"].get_extra_info("client_addr")
        second = client.get(f"{server.url}/list")
        second_addr = second.extensions["network_stream"].get_extra_info("client_addr")
    assert first.json() == {"sum": 2}
    assert second.json() == [1, 2, 3]
    assert first_addr == second_addr  # the same client socket


def test_chunked_request_body(server):
    def chunks():
        yield b'{"name": '
        yield b'"chunked", "n'
        yield b'": 7}'

    response = httpx.post(f"{server.url}/echo", content=chunks())
    event = response.json()
    assert event["_headers"]["transfer-encoding"] == "chunked"
    assert event["name"] == "chunked"
    assert event["n"] == 7


def test_installed_dependency_is_importable(server):
    assert httpx.get(f"{server.url}/dep").json() == {"dep": "fakedep"}


def test_timeout_is_504_and_the_server_keeps_serving(slow_server, log_dir):
    mark = log_dir / f"{slow_server.runtime.name}-slow.mark"
    mark.unlink(missing_ok=True)
    response = httpx.get(f"{slow_server.url}/slow", timeout=10)
    assert response.status_code == 504
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": "function timed out after 1s"}
    assert not mark.exists()  # answered before the handler (3 s) finished
    after = httpx.post(f"{slow_server.url}/add", json={"a": 1, "b": 2}, timeout=5)
    assert after.json() == {"sum": 3}


def test_nested_entrypoint_startup_line_and_sigterm(runtime, log_dir):
    srv = Server(runtime, log_dir, "sub/dir/my-mod.handler")
    try:
        srv.wait_healthy()
        response = httpx.get(f"{srv.url}/x")
        assert response.json() == {"nested": True, "path": "/x"}
        assert (
            f"{runtime.name} serving sub/dir/my-mod.handler on 127.0.0.1:{srv.port}" in srv.stderr
        )
    finally:
        returncode = srv.stop()
    assert returncode == 0


@pytest.mark.parametrize(
    ("entrypoint", "expected"),
    [
        pytest.param("no_such_file.main", "no_such_file", id="missing-file"),
        pytest.param("handlers.no_such_function", "no_such_function", id="missing-function"),
        pytest.param("", "SLESS_ENTRYPOINT", id="unset"),
    ],
)
def test_bad_entrypoint_exits_with_a_clear_error(runtime, log_dir, entrypoint, expected):
    srv = Server(runtime, log_dir, entrypoint)
    try:
        returncode = srv.proc.wait(timeout=15)
    finally:
        srv.stop()
    assert returncode != 0
    assert expected in srv.stderr
    assert "error" in srv.stderr


# ----------------------------------------------------------------------------- runner


def run_runner(runtime: Runtime, entrypoint: str, event: str | None = None, **env: str):
    extra = {"SLESS_ENTRYPOINT": entrypoint, **env}
    if event is not None:
        extra["SLESS_EVENT"] = event
    return subprocess.run(
        runtime.command("runner"),
        env=_env(runtime, **extra),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_runner_prints_only_the_json_result(runtime):
    result = run_runner(runtime, "handlers.add", json.dumps({"a": 2, "b": 3}))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1
    assert json.loads(result.stdout) == {"sum": 5}


def test_runner_sends_the_handlers_own_output_to_stderr(runtime):
    result = run_runner(runtime, "handlers.add", '{"a": 1, "b": 1}')
    assert result.returncode == 0, result.stderr
    assert "noise from the handler" in result.stderr
    assert "handlers module loaded" in result.stderr
    assert "noise" not in result.stdout
    assert "loaded" not in result.stdout


def test_runner_exception_exits_1(runtime):
    result = run_runner(runtime, "handlers.boom")
    assert result.returncode == 1
    assert "TypeError: kaboom" in result.stderr
    assert result.stdout == ""


def test_runner_timeout_exits_124(runtime, tmp_path):
    mark = tmp_path / "slow.mark"
    result = run_runner(runtime, "handlers.slow", SLESS_TIMEOUT_SEC="1", SLOW_MARK=str(mark))
    assert result.returncode == 124
    assert "function timed out after 1s" in result.stderr
    assert not mark.exists()  # it exited without waiting for the handler to finish
    assert result.stdout == ""


@pytest.mark.parametrize(
    "event",
    [
        pytest.param("not json", id="not-json"),
        pytest.param("[1, 2]", id="array"),
    ],
)
def test_runner_bad_event_exits_2(runtime, event):
    result = run_runner(runtime, "handlers.add", event)
    assert result.returncode == 2
    assert "SLESS_EVENT" in result.stderr


def test_runner_none_prints_null(runtime):
    result = run_runner(runtime, "handlers.nothing")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "null\n"


def test_runner_context_and_default_function_dir(runtime):
    env = _env(runtime, SLESS_ENTRYPOINT="handlers.whoami", SLESS_TIMEOUT_SEC="7")
    del env["SLESS_FUNCTION_DIR"]  # defaults to the working directory
    result = subprocess.run(
        runtime.command("runner"),
        env=env,
        cwd=runtime.function_dir,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    ctx = json.loads(result.stdout)
    assert ctx["function_name"] == "adder"
    assert ctx["environment"] == "staging"
    assert 0 < ctx["remaining_ms"] <= 7000


def test_runner_missing_entrypoint_exits_1(runtime):
    result = run_runner(runtime, "no_such_file.main")
    assert result.returncode == 1
    assert "no_such_file" in result.stderr


# ----------------------------------------------------------------------------- python3.11 only

PYTHON_DIR = RUNTIMES_DIR / "python3.11"


def _python(function_dir: Path, folder: Path = PYTHON_DIR) -> Runtime:
    return Runtime("python3.11", sys.executable, folder, function_dir)


def _load_server_module():
    """runtimes/python3.11/_sless_server.py, imported in this process under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_sless_server_under_test", PYTHON_DIR / "_sless_server.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SERVER_NAMED_HANDLER = """\
import sys


def main(event):
    return {"name": __name__, "file": __file__, "registered": sys.modules["server"].__file__}
"""

IMPORTS_SERVER_HANDLER = """\
def main(event):
    try:
        import server
    except ImportError as exc:
        return {"import": type(exc).__name__}
    return {"import": "found", "file": getattr(server, "__file__", None)}
"""


def test_python_a_handler_named_server_is_the_functions_own(tmp_path, log_dir):
    """server.py, the runtime's script, is never what a handler module called server is."""
    (tmp_path / "server.py").write_text(SERVER_NAMED_HANDLER)
    (tmp_path / "other.py").write_text(IMPORTS_SERVER_HANDLER)
    srv = Server(_python(tmp_path), log_dir, "server.main")
    try:
        srv.wait_healthy()
        own = str(tmp_path / "server.py")
        assert httpx.get(srv.url).json() == {"name": "server", "file": own, "registered": own}
    finally:
        assert srv.stop() == 0
    srv = Server(_python(tmp_path), log_dir, "other.main")
    try:
        srv.wait_healthy()
        assert httpx.get(srv.url).json() == {"import": "found", "file": own}
    finally:
        assert srv.stop() == 0
    (tmp_path / "server.py").unlink()  # no module of that name: not the runtime's either
    srv = Server(_python(tmp_path), log_dir, "other.main")
    try:
        srv.wait_healthy()
        assert httpx.get(srv.url).json() == {"import": "ModuleNotFoundError"}
    finally:
        assert srv.stop() == 0


def test_python_a_stale_bytecode_cache_only_costs_its_compile(tmp_path, log_dir):
    """The server module's __pycache__ is read when it matches the source, never trusted
    when it does not, and never written at run time."""
    import py_compile

    folder = tmp_path / "runtime"
    shutil.copytree(PYTHON_DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    module = folder / "_sless_server.py"
    cached = Path(py_compile.compile(str(module), doraise=True))
    module.write_text(module.read_text() + '\nRUNTIME = "python3.11-edited"\n')
    written = cached.stat().st_mtime_ns
    function_dir = tmp_path / "fn"
    function_dir.mkdir()
    (function_dir / "handler.py").write_text("def main(event):\n    return {'ok': True}\n")
    srv = Server(_python(function_dir, folder), log_dir, "handler.main")
    try:
        srv.wait_healthy()
        assert httpx.get(srv.url).json() == {"ok": True}
        assert f"python3.11-edited serving handler.main on 127.0.0.1:{srv.port}" in srv.stderr
    finally:
        assert srv.stop() == 0
    assert cached.stat().st_mtime_ns == written  # PYTHONDONTWRITEBYTECODE: left as it was
    assert sorted(p.name for p in function_dir.iterdir()) == ["handler.py"]


def test_python_sigterm_taken_by_another_thread_stops_the_server(function_dirs, log_dir):
    """A signal for the process may go to any of its threads: one that the watchdog thread
    takes still ends the main thread's wait for connections, and the server exits."""
    import ctypes
    import signal

    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("no tgkill in this C library")
    srv = Server(_python(function_dirs["python3.11"]), log_dir, "handlers.main")
    try:
        srv.wait_healthy()
        pid = srv.proc.pid
        others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
        assert others, "the watchdog thread"
        assert tgkill(pid, others[0], signal.SIGTERM) == 0, ctypes.get_errno()
        assert srv.proc.wait(timeout=10) == 0
        assert "python3.11 stopped" in srv.stderr
    finally:
        srv.stop()


def test_python_json_is_encoded_as_json_encodes_it():
    """The server encodes with json's C encoder, without importing json: same text, same
    errors, for every kind of value a handler returns."""
    encode = _load_server_module().to_json
    reference = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode

    class Dict(dict):
        pass

    class Int(int):
        pass

    class Float(float):
        pass

    values = [
        "plain",
        'quotes " and \\ and \n \u2028 é \x00 😀',
        {"a": [1, 2.5, None, True, False, "é"], "b": {"c": []}},
        [],
        {},
        Dict(a=1),
        Int(3),
        Float(1.5),
        (1, 2),
        {2: 2, 2.5: 3, None: 4, True: 5, False: 6},
        1e300,
        -0.0,
        10**40,
        [[[[{"deep": "x"}]]]],
    ]
    for value in values:
        assert encode(value) == reference(value), value

    def failure(func, value):
        with pytest.raises(Exception) as info:
            func(value)
        return type(info.value), str(info.value)

    looped: list = []
    looped.append(looped)
    bad = [float("nan"), float("inf"), {1, 2}, looped, {"k": object()}, {(1, 2): 3}, b"bytes"]
    for value in bad:
        assert failure(encode, value) == failure(reference, value), value
    # an error leaves nothing behind: the same list encodes afterwards
    shared = [1]
    with pytest.raises(TypeError):
        encode([shared, {1}])
    assert encode([shared, shared]) == "[[1],[1]]"


def test_python_status_phrases_are_httpstatus_phrases():
    from http import HTTPStatus

    reasons = _load_server_module()._REASONS
    if sys.version_info[:2] == (3, 11):
        assert reasons == {status.value: status.phrase for status in HTTPStatus}
    else:  # other versions renamed a few; the runtime says what 3.11 says
        assert set(reasons) <= {status.value for status in HTTPStatus}


def test_runner_carries_the_trace_it_is_given(runtime):
    result = run_runner(
        runtime, "handlers.main", json.dumps({"_path": "/trace"}), SLESS_TRACEPARENT=PARENT
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["traceparent"] == PARENT
    assert found["outgoing"]["traceparent"][3:35] == "4bf92f3577b34da6a3ce929d0e0e4736"
