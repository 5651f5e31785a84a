"""A request's log lines carry its ids, in both runtimes, as real processes.

While a handler serves a call, each line it writes (print, logging, console.*, the
streams' own write) starts with ``[request_id=<id> trace_id=<32 hex>] ``: the call's
``X-Request-Id`` and its trace, the ids its context shows. Lines written outside a call
are as written. The handlers are written here, one per language, alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .test_runtimes import (  # noqa: F401 (fixtures)
    PARENT,
    Runtime,
    Server,
    _python,
    function_dirs,
    log_dir,
    run_runner,
    runtime,
)

TRACE = PARENT[3:35]

PYTHON_HANDLER = """\
import logging
import os
import sys
import threading
import traceback

logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
log = logging.getLogger("fn")
print("module loaded", flush=True)
PAIR = threading.Barrier(2, timeout=20)


def main(event, context):
    path = event["_path"]
    if path == "/lines":
        print("from print", flush=True)
        log.info("from logging")
        sys.stderr.write("a line in ")
        sys.stderr.write("two writes\\n")
        sys.stderr.write("never ended")
        return {"request_id": context.request_id, "trace_id": context.trace_id}
    if path == "/pair":
        print(f"before {context.request_id}", flush=True)
        PAIR.wait()
        print(f"after {context.request_id}", flush=True)
        return {}
    if path == "/boom":
        try:
            raise KeyError("inner")
        except KeyError:
            traceback.print_exc()
        raise TypeError("kaboom")
    if path == "/thread":
        thread = threading.Thread(target=print, args=("from a thread of its own",))
        thread.start()
        thread.join()
        sys.stdout.flush()
        return {}
    if path == "/many":
        for i in range(50_000):
            sys.stdout.write("%099d," % i)
        return {}
    if path == "/flush":
        sys.stdout.flush()
        size = os.fstat(sys.stdout.fileno()).st_size
        print("shown before the call ends", end="", flush=True)
        grew = os.fstat(sys.stdout.fileno()).st_size - size
        sys.stdout.write("text first")
        sys.stdout.flush()
        sys.stdout.buffer.write(b"bytes after\\n")
        sys.stdout.buffer.flush()
        out = sys.stdout
        return {"grew": grew, "isatty": out.isatty(), "encoding": out.encoding}
    if path == "/slow":
        import time

        print("slow started", flush=True)
        time.sleep(4)
    return {}
"""

NODE_HANDLER = """\
'use strict';
console.log('module loaded');
let release = null;

function pair() {
  if (release === null) return new Promise((resolve) => { release = resolve; });
  release();
  release = null;
  return Promise.resolve();
}

exports.main = async (event, context) => {
  switch (event._path) {
    case '/lines':
      console.log('from print');
      console.error('INFO from logging');
      process.stderr.write('a line in ');
      process.stderr.write(Buffer.from('two writes\\n'));
      process.stderr.write('never ended');
      return { request_id: context.requestId, trace_id: context.traceId };
    case '/pair':
      console.log(`before ${context.requestId}`);
      await pair();
      await new Promise((resolve) => setTimeout(resolve, 10));
      process.stdout.write(`after ${context.requestId}\\n`);
      return {};
    case '/boom':
      console.error(new Error('inner'));
      throw new TypeError('kaboom');
    case '/many':
      for (let i = 0; i < 50000; i++) process.stdout.write(`${String(i).padStart(99, '0')},`);
      return {};
    case '/split': {
      const bytes = Buffer.from('caf\\u00e9\\n');
      process.stdout.write(bytes.subarray(0, 4)); // 'caf' and the first byte of the e acute
      process.stdout.write(bytes.subarray(4));
      return {};
    }
    case '/late':
      setTimeout(() => {
        process.stdout.write('late line\\n');
        process.stdout.write('late tail');
      }, 100);
      return {};
    case '/slow':
      console.log('slow started');
      await new Promise((resolve) => setTimeout(resolve, 4000));
      return {};
    default:
      return {};
  }
};
"""

HANDLERS = {"python3.11": ("logs.py", PYTHON_HANDLER), "nodejs20": ("logs.js", NODE_HANDLER)}


def tag(request_id: str, trace_id: str = TRACE) -> str:
    return f"[request_id={request_id} trace_id={trace_id}] "


@pytest.fixture(scope="module")
def logs_runtime(runtime, tmp_path_factory) -> Runtime:  # noqa: F811
    folder = tmp_path_factory.mktemp(f"logs-{runtime.name}")
    name, source = HANDLERS[runtime.name]
    (folder / name).write_text(source)
    return Runtime(runtime.name, runtime.interpreter, runtime.folder, folder)


@pytest.fixture(scope="module")
def logs_server(logs_runtime, log_dir) -> Iterator[Server]:  # noqa: F811
    srv = Server(logs_runtime, log_dir, "logs.main", SLESS_TIMEOUT_SEC="2")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


def stdout_lines(srv: Server) -> list[str]:
    return srv.stdout_path.read_text(errors="replace").splitlines()


def stderr_lines(srv: Server) -> list[str]:
    return srv.stderr.splitlines()


def test_a_requests_lines_carry_its_request_id_and_trace_id(logs_server):
    sent = {"x-request-id": "req-lines-1", "traceparent": PARENT}
    answer = httpx.get(f"{logs_server.url}/lines", headers=sent).json()
    assert answer == {"request_id": "req-lines-1", "trace_id": TRACE}
    prefix = tag("req-lines-1")
    assert f"{prefix}from print" in stdout_lines(logs_server)
    err = stderr_lines(logs_server)
    assert f"{prefix}INFO from logging" in err
    assert f"{prefix}a line in two writes" in err  # one line, tagged once
    assert f"{prefix}never ended" in err  # a partial line ends with its call


def test_a_call_without_a_trace_is_tagged_with_the_trace_its_context_starts(logs_server):
    answer = httpx.get(f"{logs_server.url}/lines").json()  # neither id given: both made
    assert len(answer["request_id"]) == 32 and len(answer["trace_id"]) == 32
    prefix = tag(answer["request_id"], answer["trace_id"])
    assert f"{prefix}from print" in stdout_lines(logs_server)
    assert f"{prefix}INFO from logging" in stderr_lines(logs_server)
    invalid = {"x-request-id": "req-garbage", "traceparent": "garbage"}
    answer = httpx.get(f"{logs_server.url}/lines", headers=invalid).json()
    assert f"{tag('req-garbage', answer['trace_id'])}from print" in stdout_lines(logs_server)


def test_two_concurrent_calls_are_each_tagged_with_their_own_ids(logs_server):
    """Each call prints, waits for the other to have printed, and prints again."""
    calls = {
        "req-pair-a": "00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-00f067aa0ba902b7-01",
        "req-pair-b": "00-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb-00f067aa0ba902b7-01",
    }

    def call(request_id: str) -> int:
        headers = {"x-request-id": request_id, "traceparent": calls[request_id]}
        return httpx.get(f"{logs_server.url}/pair", headers=headers, timeout=30).status_code

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(call, calls)) == [200, 200]
    lines = stdout_lines(logs_server)
    for request_id, traceparent in calls.items():
        prefix = tag(request_id, traceparent[3:35])
        assert f"{prefix}before {request_id}" in lines
        assert f"{prefix}after {request_id}" in lines
    assert [line for line in lines if "pair" in line and not line.startswith("[request_id=")] == []


def test_a_raised_exceptions_lines_are_tagged(logs_server):
    response = httpx.get(f"{logs_server.url}/boom", headers={"x-request-id": "req-boom"})
    assert response.status_code == 500
    err = stderr_lines(logs_server)
    heading = next(line for line in err if "the handler raised on GET /boom" in line)
    prefix = heading[: heading.index("] ") + 2]
    assert prefix.startswith("[request_id=req-boom trace_id=") and len(prefix) == 64
    assert heading == f"{prefix}[sless] the handler raised on GET /boom (request req-boom):"
    block = [line for line in err if line.startswith(prefix)]
    assert any(line.endswith("TypeError: kaboom") for line in block)
    inner = "KeyError: 'inner'" if logs_server.runtime.name == "python3.11" else "Error: inner"
    assert any(line.endswith(inner) for line in block)  # the handler's own traceback
    assert not any(("kaboom" in line or "inner" in line) for line in err if line not in block)


def test_the_timeout_line_is_tagged(logs_server):
    response = httpx.get(
        f"{logs_server.url}/slow", headers={"x-request-id": "req-slow"}, timeout=30
    )
    assert response.status_code == 504
    started = next(line for line in stdout_lines(logs_server) if "slow started" in line)
    prefix = started[: -len("slow started")]
    assert prefix.startswith("[request_id=req-slow trace_id=")
    assert f"{prefix}[sless] function timed out after 2s; the call is abandoned" in stderr_lines(
        logs_server
    )


def test_lines_outside_calls_are_as_written(logs_server):
    assert "module loaded" in stdout_lines(logs_server)  # at import, before any call
    serving = f"{logs_server.runtime.name} serving logs.main on 127.0.0.1:{logs_server.port}"
    assert serving in stderr_lines(logs_server)


def test_python_a_thread_the_handler_starts_is_not_tagged(log_dir, tmp_path):  # noqa: F811
    """A thread-local tag: a thread the handler starts writes as written (README.md)."""
    (tmp_path / "logs.py").write_text(PYTHON_HANDLER)
    srv = Server(_python(tmp_path), log_dir, "logs.main").wait_healthy()
    try:
        assert httpx.get(f"{srv.url}/thread", headers={"x-request-id": "req-t"}).status_code == 200
    finally:
        srv.stop()
    assert "from a thread of its own" in stdout_lines(srv)


def test_the_runner_gives_the_run_its_ids_and_leaves_its_lines_as_written(logs_runtime):
    """A run's output is all that run's (its job's error): its context has the ids the
    reconciler gave, and its lines are not tagged with them."""
    result = run_runner(
        logs_runtime,
        "logs.main",
        json.dumps({"_path": "/lines"}),
        SLESS_REQUEST_ID="nightly-42",
        SLESS_TRACEPARENT=PARENT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"request_id": "nightly-42", "trace_id": TRACE}
    assert "[request_id=" not in result.stderr
    assert "from print" in result.stderr.splitlines()


@pytest.fixture(scope="module")
def roomy_server(logs_runtime, log_dir) -> Iterator[Server]:  # noqa: F811
    """The logs handler with the default timeout (30 s), for calls that write a lot."""
    srv = Server(logs_runtime, log_dir, "logs.main")
    try:
        yield srv.wait_healthy()
    finally:
        srv.stop()


def test_many_small_writes_without_a_newline_arrive_whole_in_64k_lines(roomy_server):
    """50,000 writes of 100 characters, no newline: each write costs its own text, not
    the partial line's (that was quadratic, past the call's timeout), and the partial
    line goes out, tagged, each time it passes 64 Ki characters."""
    response = httpx.get(
        f"{roomy_server.url}/many", headers={"x-request-id": "req-many"}, timeout=60
    )
    assert response.status_code == 200
    lines = [
        line for line in stdout_lines(roomy_server) if line.startswith("[request_id=req-many ")
    ]
    prefix = lines[0][: lines[0].index("] ") + 2]
    assert all(line.startswith(prefix) for line in lines)
    texts = [line[len(prefix) :] for line in lines]
    assert "".join(texts) == "".join(f"{i:099d}," for i in range(50_000))
    assert all(64 * 1024 <= len(text) < 64 * 1024 + 100 for text in texts[:-1])
    assert len(texts) == -(-50_000 // 656)  # a line at each 656th write (65,600 characters)


@pytest.mark.parametrize("runtime", ["python3.11"], indirect=True)  # sys.stdout.flush()
def test_python_flush_writes_the_partial_line_and_keeps_the_streams_attributes(
    logs_runtime, logs_server
):
    response = httpx.get(f"{logs_server.url}/flush", headers={"x-request-id": "req-flush"})
    assert response.status_code == 200
    answer = response.json()
    lines = stdout_lines(logs_server)
    shown = next(line for line in lines if line.endswith("shown before the call ends"))
    prefix = shown[: -len("shown before the call ends")]
    assert prefix.startswith("[request_id=req-flush trace_id=")
    # print(..., end="", flush=True) wrote the tagged line then, before the call ended
    assert answer["grew"] == len(f"{shown}\n".encode())
    assert answer["isatty"] is False and answer["encoding"]  # the stream's own, delegated
    # sys.stdout.flush() before sys.stdout.buffer.write(): the text comes first
    assert lines.index(f"{prefix}text first") < lines.index("bytes after")


@pytest.mark.parametrize("runtime", ["nodejs20"], indirect=True)  # Buffers on process.stdout
def test_node_a_character_split_across_two_writes_stays_whole(logs_runtime, logs_server):
    response = httpx.get(f"{logs_server.url}/split", headers={"x-request-id": "req-split"})
    assert response.status_code == 200
    lines = logs_server.stdout_path.read_text(encoding="utf-8").splitlines()
    assert any(
        line.startswith("[request_id=req-split ") and line.endswith("] caf\u00e9") for line in lines
    )


@pytest.mark.parametrize("runtime", ["nodejs20"], indirect=True)  # async contexts
def test_node_a_timer_left_by_a_call_writes_untagged_after_it(logs_runtime, logs_server):
    """A timer keeps the call's async context after the call ends: its lines are not the
    call's (they went under its request id), and its partial line is not kept (lost)."""
    response = httpx.get(f"{logs_server.url}/late", headers={"x-request-id": "req-late"})
    assert response.status_code == 200
    deadline = time.monotonic() + 20
    while "late tail" not in logs_server.stdout_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "late line" in stdout_lines(logs_server)
    assert "late tail" in logs_server.stdout_path.read_text()
    assert not any("req-late" in line for line in stdout_lines(logs_server))
