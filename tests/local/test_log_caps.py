"""What a function prints cannot fill the state disk or the reconciler's memory.

A replica printed 100 MiB in 1.6 s and its log grew to 107 MB: the 8 MiB cap
was applied by garbage collection once an hour. The cap is now kept as the
log is written (``local/logfiles``): these tests print as an attacker would,
through a real ``serve`` in its sandbox, and watch the files while it prints.
A job printing hundreds of MiB, or a result of megabytes, must not grow the
reconciler by as much: what it keeps of a job's output is bounded too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gitops_sless.local import logfiles
from gitops_sless.local.installers import BuildLog
from gitops_sless.local.logfiles import KEEP_LOG_BYTES, MAX_LOG_BYTES
from gitops_sless.local.oneshot import LOG_TAIL_BYTES, MAX_RESULT_BYTES

from .. import gitserver
from .test_local_memory import served

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["served"]  # the fixture, shared with test_local_memory

MiB = 1 << 20
STAMP = rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "

# ------------------------------------------------------------------------ the rotating file


def test_a_log_never_passes_its_cap_and_keeps_its_newest_whole_lines(tmp_path):
    path = tmp_path / "fn.log"
    sizes = []
    for n in range(20_000):
        logfiles.append(path, f"line {n} {'x' * (n % 97)}\n".encode(), limit=4000, keep=1000)
        sizes.append(path.stat().st_size)
    assert max(sizes) <= 4000
    assert min(sizes[1000:]) > 0 and sizes != sorted(sizes)  # it rotated, many times
    lines = path.read_bytes().splitlines()
    assert lines[-1].startswith(b"line 19999 ")
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers == list(range(numbers[0], 20_000))  # whole lines, none lost since the cut
    assert not (tmp_path / "fn.log.rotating").exists()


def test_one_write_larger_than_the_cap_keeps_its_end(tmp_path):
    path = tmp_path / "fn.log"
    path.write_bytes(b"old\n" * 100)
    logfiles.append(path, b"".join(b"new %d\n" % n for n in range(10_000)), limit=500, keep=100)
    data = path.read_bytes()
    assert len(data) <= 100 and data.endswith(b"new 9999\n") and data.startswith(b"new ")


def test_a_build_log_never_passes_its_cap(tmp_path):
    log = BuildLog(tmp_path / "tag.log", ["hunter2-secret"], limit=4000)
    for n in range(2000):
        log.line(f"step {n} hunter2-secret")
        assert log.path.stat().st_size <= 4000
    text = log.text()
    assert text.endswith(" step 1999 ****\n") and "hunter2" not in text


def test_an_installers_output_keeps_its_end_from_a_line_start(tmp_path):
    log = BuildLog(tmp_path / "tag.log", [])
    output = logfiles.Tail(1000)
    output.add(b"x" * 5000 + b"\nthe end of the line before\nthe last line\n")
    log.output("npm install", output)
    text = log.text()
    assert text.endswith(
        "] npm install: 5001 bytes of its output left out: the log keeps the last 1000 bytes,"
        " from the start of a line\nthe end of the line before\nthe last line\n"
    ), text


# ---------------------------------------------------------------- a job's pipes, read bounded

NOISY = """
import sys
sys.stderr.buffer.write((b"e" * 1023 + b"\\n") * 1024 * 64)  # 64 MiB
sys.stderr.buffer.write(b"the last words\\n")
sys.stdout.buffer.write(b"r" * (3 << 20))
"""


def test_reading_a_childs_pipes_keeps_only_the_bounded_parts():
    process = subprocess.Popen(
        [sys.executable, "-c", NOISY], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    head, tail = logfiles.Head(MAX_RESULT_BYTES), logfiles.Tail(LOG_TAIL_BYTES)
    assert process.stdout and process.stderr
    try:
        sinks = {process.stdout: head.add, process.stderr: tail.add}
        assert logfiles.read_pipes(process, sinks, timeout=120)
    finally:
        process.stdout.close()
        process.stderr.close()
        process.wait()
    assert process.returncode == 0
    assert not head.complete and head.size == 3 << 20
    assert head.value() == b"r" * MAX_RESULT_BYTES
    assert tail.value().endswith(b"the last words\n") and len(tail.value()) == LOG_TAIL_BYTES
    assert tail.dropped == 64 * MiB + len(b"the last words\n") - LOG_TAIL_BYTES


# ---------------------------------------------------------------------------- end to end

FLOOD = """
import sys

def main(event, context=None):
    if event["_path"].strip("/") == "flood":
        block = (b"x" * 1023 + b"\\n") * 1024  # 1 MiB of lines
        for _ in range(100):
            sys.stdout.buffer.write(block)
        sys.stdout.buffer.write(b"the newest line\\n")
        sys.stdout.flush()
    return {"ok": True}
"""


HTTP = "    triggers: [{type: http}]"


def _manifest(name: str, *extra: str) -> str:
    lines = ["functions:", f"  - name: {name}", "    runtime: python3.11"]
    return "\n".join([*lines, "    entrypoint: handler.main", *extra]) + "\n"


class _Sizes:
    """Samples a log's size, and the size of its rotation in progress, until stopped."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.rotating = log.with_name(log.name + logfiles.ROTATING)
        self.largest = self.largest_total = self.rotations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _size(self, path: Path) -> int:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        last = 0
        while not self._stop.is_set():
            size = self._size(self.log)
            total = size + self._size(self.rotating)
            self.rotations += size < last
            self.largest, last = max(self.largest, size), size
            self.largest_total = max(self.largest_total, total)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_replica_printing_100_mib_keeps_its_log_under_the_cap(served):
    server = served({"flood/handler.py": FLOOD, "flood/sless.yaml": _manifest("flood", HTTP)})
    log = server.state_dir / "logs" / "prod" / "flood.log"
    server.wait(lambda: server.call("flood").status_code == 200, "the function to answer")
    sizes = _Sizes(log)
    try:
        assert server.call("flood", "/flood", timeout=300).json() == {"ok": True}
        server.wait(lambda: b"the newest line" in log.read_bytes(), "the last line in the log")
    finally:
        sizes.stop()
    assert sizes.largest <= MAX_LOG_BYTES, sizes.largest
    assert sizes.largest_total <= MAX_LOG_BYTES + KEEP_LOG_BYTES, sizes.largest_total
    # 100 MiB printed: the file was rewritten to its newest lines again and again
    assert sizes.rotations >= 10, sizes.rotations
    data = log.read_bytes()
    assert len(data) <= MAX_LOG_BYTES
    lines = data.splitlines()
    assert all(re.match(STAMP, line) for line in lines)  # whole lines, each with its time
    assert lines[-1].endswith(b" the newest line")
    # the function answers, and the API reads its log as before
    assert server.call("flood").json() == {"ok": True}
    chunk = server.client.get(
        "/api/v1/environments/prod/functions/flood/logs", params={"offset": len(data) - 200}
    )
    assert chunk.status_code == 200 and "the newest line" in json.dumps(chunk.json())


NOISY_JOB = """
import sys

def main(event, context=None):
    if event.get("what") == "stderr":
        block = (b"e" * 1023 + b"\\n") * 1024  # 1 MiB of lines
        for _ in range(300):
            sys.stderr.buffer.write(block)
        sys.stderr.flush()
        raise ValueError("the last words")
    if event.get("what") == "result":
        return {"big": "r" * (2 << 20)}
    return {"ok": True}
"""


def _push(server, files: dict[str, str]) -> None:
    """Commit ``files`` to the repository ``server`` serves, push, and sync."""
    work = gitserver.WorkRepo(server.state_dir.parent / "work")
    work.commit("jobs", files)
    work.push(server.repo)
    server.sync()


def _high_water_mark(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)[1]) << 10  # type: ignore[index]


def _settled_jobs(server) -> dict[str, dict] | None:
    jobs = {job["name"]: job for job in server.jobs()}
    done = all(jobs.get(n, {}).get("phase") in ("Succeeded", "Failed") for n in ("loud", "huge"))
    return jobs if done else None


def test_a_job_printing_300_mib_or_a_huge_result_costs_the_reconciler_no_such_memory(served):
    server = served({"noisy/handler.py": NOISY_JOB, "noisy/sless.yaml": _manifest("noisy", HTTP)})
    server.wait(lambda: server.call("noisy").status_code == 200, "the function to answer")
    assert server.process is not None
    before = _high_water_mark(server.process.pid)
    jobs = (
        "    jobs:\n"
        "      - {name: loud, runId: 1, event: {what: stderr}}\n"
        "      - {name: huge, runId: 1, event: {what: result}}\n"
    )
    files = {"noisy/handler.py": NOISY_JOB, "noisy/sless.yaml": _manifest("noisy", HTTP, jobs)}
    _push(server, files)
    jobs_now = server.wait(lambda: _settled_jobs(server), "both jobs to end", 300)
    grown = _high_water_mark(server.process.pid) - before
    assert grown < 100 * MiB, f"the reconciler grew by {grown >> 20} MiB"
    loud, huge = jobs_now["loud"], jobs_now["huge"]
    assert loud["phase"] == "Failed" and "ValueError: the last words" in loud["error"], loud
    assert huge["phase"] == "Failed", huge
    assert re.search(
        rf"the result is \d+ bytes; at most {MAX_RESULT_BYTES} are kept", huge["error"]
    )
    assert server.call("noisy").json() == {"ok": True}


@pytest.fixture(autouse=True)
def _no_leftover_rotations(tmp_path):
    yield
    assert not list(tmp_path.glob("state/logs/*/*.log" + logfiles.ROTATING))
