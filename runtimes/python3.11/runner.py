"""gitops-sless Python runner: calls the handler once, for jobs and cron.

Reads the event from ``SLESS_EVENT`` (a JSON object, default ``{}``), calls the
handler named by ``SLESS_ENTRYPOINT`` and prints the JSON of its return value
as one line on stdout. Whatever the handler prints goes to stderr, so stdout
holds only the result.

The run's ids are the context's: ``SLESS_REQUEST_ID`` and ``SLESS_TRACEPARENT`` (a
generated id, a new trace where they are not set). Its lines are not tagged with them,
as a server's requests are: all of a run's output is that run's (its job's error).

Exit codes: 0 success, 1 the handler raised / cannot be loaded / returned
something that is not JSON, 2 ``SLESS_EVENT`` is not a JSON object, 124 the
call ran past ``SLESS_TIMEOUT_SEC``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid


def _load_runtime():
    """The server's shared code, ``_sless_server.py`` beside this file (its cached bytecode);
    loading the handler takes this folder off ``sys.path`` again."""
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path[:1] != [here]:  # it is sys.path[0] already, unless -P or PYTHONSAFEPATH
        sys.path.insert(0, here)
    import _sless_server

    return _sless_server


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait for threads the handler left running


def main() -> None:
    sys.dont_write_bytecode = True
    rt = _load_runtime()
    fail = f"{rt.RUNTIME} runner: error:"
    result_out = sys.stdout
    for name in ("SLESS_OTLP_ENDPOINT", "SLESS_OTLP_TOKEN", "SLESS_OTLP_SERVICE"):
        os.environ.pop(name, None)  # a run exports no span of its own; nor the handler's to see
    sys.stdout = sys.stderr  # the handler's own prints, from import time on

    raw_event = os.environ.get("SLESS_EVENT")
    if raw_event is None or raw_event.strip() == "":
        raw_event = "{}"
    try:
        event = json.loads(raw_event)
    except ValueError as exc:
        print(f"{fail} SLESS_EVENT is not valid JSON: {exc}", file=sys.stderr)
        _exit(2)
    if type(event) is not dict:
        print(
            f"{fail} SLESS_EVENT must be a JSON object, not {type(event).__name__}",
            file=sys.stderr,
        )
        _exit(2)

    entrypoint = os.environ.get("SLESS_ENTRYPOINT", "")
    try:
        timeout = rt.parse_timeout(os.environ.get("SLESS_TIMEOUT_SEC"))
        function_dir = os.environ.get("SLESS_FUNCTION_DIR") or os.getcwd()
        handler = rt.load_handler(entrypoint, function_dir)
    except rt.StartupError as exc:
        print(f"{fail} {exc}", file=sys.stderr)
        _exit(1)

    call_handler, _ = rt.make_caller(handler)
    deadline = time.monotonic() + timeout
    context = rt.Context(
        os.environ.get("SLESS_FUNCTION_NAME", ""),
        os.environ.get("SLESS_ENV", ""),
        os.environ.get("SLESS_REQUEST_ID") or uuid.uuid4().hex,
        deadline,
        os.environ.get("SLESS_TRACEPARENT"),  # a run the reconciler traces
    )
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = call_handler(event, context)
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="sless-handler", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        print(f"function timed out after {rt.format_seconds(timeout)}s", file=sys.stderr)
        _exit(124)
    if "error" in outcome:
        exc = outcome["error"]
        rt.print_handler_exception(exc, f"{fail} the handler raised {rt.describe_exception(exc)}")
        _exit(1)
    try:
        text = rt.to_json(outcome.get("result"))
    except (TypeError, ValueError, RecursionError) as exc:
        print(
            f"{fail} the handler's result is not JSON serialisable: {rt.describe_exception(exc)}",
            file=sys.stderr,
        )
        _exit(1)
    result_out.buffer.write(text.encode() + b"\n")
    _exit(0)


if __name__ == "__main__":
    main()
