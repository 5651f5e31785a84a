"""One-shot runs of a function: a job or a cron run, through the runtime's runner.

The runner reads the event from ``SLESS_EVENT`` and prints its JSON result.
What it prints is read as it comes and only bounded parts are kept: the
result up to ``MAX_RESULT_BYTES`` (a larger one fails the run, naming its
size) and the last ``LOG_TAIL_BYTES`` of its stderr, for the cause of a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .. import failure
from ..plan.backend import JobFailed
from . import logfiles
from .units import ProcessSpec

if TYPE_CHECKING:
    from .processes import Supervisor

__all__ = ["LOG_TAIL_BYTES", "MAX_RESULT_BYTES", "run_once"]

LOG_TAIL_BYTES = 64_000  # enough for the traceback that ends a failed run
MAX_RESULT_BYTES = 1 << 20  # a job's result (its runner's stdout): larger fails the job
OUTPUT_WAIT_SEC = 2.0  # for what a process printed last, still in its pipes


def run_once(
    supervisor: Supervisor,
    spec: ProcessSpec,
    event: Mapping[str, object],
    timeout_sec: float,
    trace: Mapping[str, str] | None = None,
) -> str:
    """Run the runtime's runner once with ``event``; its stdout (JSON) is the result.
    ``trace``: the run's ``SLESS_TRACEPARENT`` and ``SLESS_REQUEST_ID``, if given."""
    name = spec.function
    child = supervisor.start_process(
        spec,
        spec.command("runner"),
        JobFailed(f"{name}: not run: the local backend is shutting down"),
        env=spec.environ({"SLESS_EVENT": json.dumps(dict(event), sort_keys=True), **(trace or {})}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # read as it comes, and only so much kept: a job printing gigabytes costs no memory
    result, errors = logfiles.Head(MAX_RESULT_BYTES), logfiles.Tail(LOG_TAIL_BYTES)
    process = child.process
    assert process.stdout is not None and process.stderr is not None
    try:
        sinks = {process.stdout: result.add, process.stderr: errors.add}
        timed_out = not logfiles.read_pipes(process, sinks, timeout_sec + 5, linger=OUTPUT_WAIT_SEC)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # whatever the runner left behind
        process.stdout.close()
        process.stderr.close()
        process.wait()
        reason = supervisor.reap(child)
    out, err = result.value(), errors.value()
    code = child.process.returncode
    if code != 0 and supervisor.closing:
        raise JobFailed(f"{name}: interrupted by shutdown")
    if reason.startswith(("OOMKilled", "ProcessLimit")):
        raise JobFailed(f"{name}: {reason}")
    if timed_out:
        raise JobFailed(f"{name}: timed out after {timeout_sec:g}s")
    if code != 0:
        why = failure.cause(err.decode("utf-8", "replace"), supervisor.function_dir(spec))
        said = why or "no output on stderr"
        raise JobFailed(f"{name}: {reason}: {said}", f"{name}: {reason}")
    if not result.complete:
        raise JobFailed(
            f"{name}: the result is {result.size} bytes; at most {MAX_RESULT_BYTES} are kept"
        )
    text = out.decode("utf-8", "replace").strip()
    try:
        json.loads(text)
    except ValueError as exc:
        raise JobFailed(
            f"{name}: the result is not JSON: {text[:200]!r}",
            f"{name}: the result is not JSON",
        ) from exc
    return text
