"""Asynchronous invocations (issue 28): submissions per second, the end-to-end cost of an
asynchronous call over the same synchronous one, and what a kill -9 loses, on the SQLite
queue and on NATS JetStream.

    .venv/bin/python bench/async.py [--duration 10] [--connections 16] [--rounds 50]
        [--queued 1000] [--sleep 2] [--engines sqlite,nats] [--keep] [--smoke]

For each engine, a real ``gitops-sless serve`` (local backend, ``--sandbox bubblewrap``,
``--callback-allow 127.0.0.1/32``) follows a bare repository on disk with three python3.11
functions, each with an http trigger:

- ``hello``: returns a constant; ``async`` left at its defaults (concurrency 10), so its
  invocations run in the background, in the same process, while the next ones are
  submitted (the realistic case, and the one the targets are read on);
- ``parked``: sleeps 60 s, ``async: {concurrency: 1}``: what is submitted to it waits,
  so nothing runs while it is submitted to (submission alone, for comparison);
- ``sleepy``: writes ``bench-run <X-Invocation-Id> <X-Invocation-Attempt>`` to its log
  (one write(2): the runtime's threads print at once), then sleeps the ``sleep`` of its
  JSON body; ``async: {concurrency: 10}``, ``timeoutSec: 5`` (NATS's AckWait is the
  timeout + 32 s).

SQLite: ``--queue sqlite`` (a file in the state folder). NATS: a ``nats-server -js``
(``.venv/bin/nats-server``, tests/natsserver.py) with its store in a temporary folder,
``--queue nats://127.0.0.1:PORT``.

1. **Submissions.** ``wrk -t2 -c{--connections} -d{--duration}s`` sends ``POST
   /fn/prod/hello/`` with ``Prefer: respond-async`` and a small JSON body on keep-alive
   connections (a 1 s run first, to warm up, and its queue left to drain). wrk rather
   than a Python client: on 2 shared cores a Python client (httpx, threads or asyncio)
   spends more CPU per request than the server, and would measure itself. Printed:
   submissions/s, p50/p99/max latency of the 202, errors and non-2xx answers, how many
   the server counted (``sless_async_submitted_total``), the CPU the serve process used
   per submission and in cores, the time its threads were runnable but waiting for a CPU
   (``/proc/PID/task/*/schedstat``: what the rest of the machine took from it), the CPU
   of nats-server and of wrk, and how long ``hello``'s queue took to drain afterwards
   (the workers' pace; a queue that still has work and ran none of it for 15 s is
   reported as never drained, with how many were left queued). The same once more
   against ``parked``, last (its backlog never runs).
2. **Async over sync, end to end.** ``--rounds`` rounds, one call at a time on one
   keep-alive connection: ``POST /fn/prod/hello/`` synchronously (the baseline), then the
   same with ``Prefer: respond-async`` and ``X-Callback-Url`` pointing to a receiver on
   loopback in this process, which gives the callback's arrival without polling. The
   record is then read for where the time went: the 202, submit to the attempt's start,
   the attempt, submit to ``ended`` (the record's times, in milliseconds, against the
   client's clock before it sent). p50 of each; the overhead is ended - sync and
   ended / sync, and the callback's delay after ``ended`` is shown apart.
3. **Crash safety.** ``--queued`` + 10 invocations of ``sleepy`` (``sleep: --sleep``)
   submitted by 16 threads; once 10 are running, ``kill -9`` of serve, then a new serve on
   the same state folder (and the same NATS server); wait until every accepted
   invocation has ended (or none has ended for 30 s, NATS: AckWait + 50 s). **lost**:
   accepted (202) and not ``succeeded`` at the end (no record, still queued or running,
   failed or dead). **ran more than once**: records with more than one attempt (an
   attempt cut short by the kill is kept with ``counted: false``; one that failed and
   was tried again is counted apart, with its error), and ids that ``sleepy``'s log shows
   starting more than once (read through the logs API): at least once is the contract,
   so the 10 that were running may run again; every duplicate is counted and printed,
   never hidden. With NATS, the same again with a sleep of 0.2 s and the nats-server
   killed (SIGKILL) instead, with invocations queued and running, 3 submissions tried
   while it is down (a 503 is the right answer; a 202 is counted as accepted), then
   started again after 2 s on the same port and store.

Targets (printed PASS/MISS, never asserted): submit p50 <= 5 ms on both engines;
>= 2,000 submissions/s on SQLite, >= 5,000/s on NATS; 0 lost in every crash. Also
printed: the fsync time of the temporary folder's disk, before and after.

``--smoke`` (tests/test_bench.py): 1 s of submissions, 3 rounds, 20 queued, sleeps of
0.5 s; every report line, figures meaningless. It takes about 75 s with NATS: each kill
leaves messages unacknowledged until AckWait (37 s). Exit 0 once everything ran
(whatever the targets say), 1 when something could not run (a tool missing, serve not
starting). Every process started is stopped on exit, SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gitops_sless and tests/ (the git, serve and NATS helpers)

from syncbench.common import load_average, pct, wait_until  # noqa: E402

from gitops_sless.timestamps import epoch  # noqa: E402
from tests.gitserver import WorkRepo, init_bare  # noqa: E402
from tests.natsserver import NatsServer, nats_binary  # noqa: E402
from tests.sless_server import SlessServer  # noqa: E402

SERVE_ARGS = ["--sandbox", "bubblewrap", "--callback-allow", "127.0.0.1/32"]
ENGINES = ("sqlite", "nats")
SUBMIT_P50_TARGET_MS = 5.0
RATE_TARGET = {"sqlite": 2000.0, "nats": 5000.0}
CONCURRENCY = 10  # sleepy's async concurrency: how many run when the reconciler is killed
TIMEOUT_SEC = 5  # sleepy's timeoutSec
ACK_WAIT_SEC = TIMEOUT_SEC + 30 + 2  # NATS: the worker's timeout (+30 s) and a margin (+2 s)
NATS_SLEEP_SEC = 0.2  # sleepy's sleep in the NATS-server restart
OUTAGE_SEC = 2.0  # how long the nats-server stays down
STALL_SEC = 15.0  # a queue that has work and ran none of it for this long is stuck
ENDED = ("succeeded", "failed", "dead")
BODY = b'{"n": 1}'
JSON = {"Content-Type": "application/json"}
ASYNC = {**JSON, "Prefer": "respond-async"}

HELLO = 'def main(event):\n    return {"hello": "async"}\n'
PARKED = 'import time\n\n\ndef main(event):\n    time.sleep(60)\n    return {"parked": 60}\n'
# one write(2) per line: the runtime's threads print at once, and print() writes by pieces
SLEEPY = """\
import os
import time


def main(event):
    headers = event["_headers"]
    run = (headers.get("x-invocation-id"), headers.get("x-invocation-attempt"))
    os.write(1, ("bench-run %s %s\\n" % run).encode())
    time.sleep(float(event.get("sleep", 0)))
    return {"slept": event.get("sleep", 0)}
"""

# wrk: POST with Prefer: respond-async; the figures as one line at the end
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = '{"n": 1}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Prefer"] = "respond-async"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH-WRK requests=%d duration_us=%d p50_us=%f p99_us=%f max_us=%f " ..
    "connect=%d read=%d write=%d status=%d timeout=%d\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def manifest(name: str, *extra: str) -> str:
    lines = [
        "functions:",
        f"  - name: {name}",
        "    runtime: python3.11",
        "    entrypoint: handler.main",
        "    triggers: [{type: http}]",
        *extra,
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- results


@dataclass
class Submits:
    requests: int = 0
    seconds: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # wrk's: connect, read, ..., status
    counted: int = 0  # sless_async_submitted_total, the server's count
    serve_cpu: float = 0.0  # seconds, during the run
    serve_waited: float = 0.0  # seconds its threads were runnable, waiting for a CPU
    serve_kernel: float = 0.0  # of serve_cpu, in the kernel (system time)
    nats_cpu: float = 0.0
    wrk_cpu: float = 0.0
    drained_sec: float | None = None  # after the last submission, until nothing is queued
    stuck: int = 0  # still queued when nothing had run for STALL_SEC (-1: not known)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass
class EndToEnd:
    sync_ms: list[float] = field(default_factory=list)
    accepted_ms: list[float] = field(default_factory=list)  # the 202
    started_ms: list[float] = field(default_factory=list)  # submit to the attempt's start
    attempt_ms: list[float] = field(default_factory=list)  # the attempt, start to end
    ended_ms: list[float] = field(default_factory=list)  # submit to the record's `ended`
    callback_ms: list[float] = field(default_factory=list)  # submit to the callback's arrival


@dataclass
class Crash:
    what: str  # what was killed
    accepted: int = 0
    refused: int = 0  # non-202 answers to the submissions
    at_kill: dict[str, int] = field(default_factory=dict)  # statuses just before the kill
    outage: Counter[int] = field(default_factory=Counter)  # answers while NATS was down
    ended: Counter[str] = field(default_factory=Counter)  # status at the end, per accepted id
    missing: int = 0  # accepted, no record at the end
    unfinished: int = 0  # accepted, still queued or running at the deadline
    multi: int = 0  # records with more than one attempt
    interrupted: int = 0  # of them, with an attempt cut short (counted: false)
    retried: int = 0  # of them, with a failed attempt that counted (tried again)
    errors: Counter[str] = field(default_factory=Counter)  # those failed attempts' errors
    log_runs: int = 0  # bench-run lines of these ids in sleepy's log
    log_multi: int = 0  # ids seen starting more than once in the log
    log_extra: int = 0  # executions beyond the first, from the log
    drain_sec: float = 0.0  # from serve (or NATS) back up to every accepted one ended
    expected_sec: float = 0.0  # the work itself: remaining x sleep / concurrency

    @property
    def lost(self) -> int:
        return (
            self.missing
            + self.unfinished
            + sum(n for status, n in self.ended.items() if status != "succeeded")
        )


@dataclass
class Engine:
    name: str
    submits: Submits = field(default_factory=Submits)
    parked: Submits = field(default_factory=Submits)  # to parked: nothing runs meanwhile
    e2e: EndToEnd = field(default_factory=EndToEnd)
    crashes: list[Crash] = field(default_factory=list)
    failed: str | None = None  # why this engine's run stopped early


# --------------------------------------------------------------------------- helpers


class Stop(Exception):
    """Something one engine's run needs did not happen: its run stops, the next goes on."""


def cpu_seconds(pid: int | None, system: bool = False) -> float:
    """User + system CPU of ``pid`` so far (its threads included, its children not);
    ``system``: the system (kernel) part alone."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[12]) + (0 if system else int(fields[11]))
    return ticks / os.sysconf("SC_CLK_TCK")


def fsync_ms(folder: Path, count: int = 50) -> tuple[float, float]:
    """p50 and p99 of writing 4 KiB and fsync-ing it in ``folder`` (SQLite's commit waits
    for one; the machine's disk is shared with whatever else runs)."""
    took = []
    path = folder / "fsync-probe"
    with path.open("wb") as out:
        for _ in range(count):
            began = time.perf_counter()
            out.write(b"x" * 4096)
            out.flush()
            os.fsync(out.fileno())
            took.append((time.perf_counter() - began) * 1000)
    path.unlink()
    return pct(took, 0.5), pct(took, 0.99)


def cpu_wait_seconds(pid: int | None) -> float:
    """Seconds the threads of ``pid`` spent runnable, waiting for a CPU (schedstat): how
    much the rest of the machine held it back."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*") if pid else ():
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


class Receiver:
    """Callbacks on loopback: when each invocation's arrived (perf_counter) and its status."""

    def __init__(self) -> None:
        self.arrived: dict[str, tuple[float, str]] = {}
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                now = time.perf_counter()
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with receiver.changed:
                    receiver.arrived[self.headers.get("x-invocation-id", "")] = (
                        now,
                        self.headers.get("x-invocation-status", ""),
                    )
                    receiver.changed.notify_all()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/done"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, invocation_id: str, timeout: float) -> tuple[float, str] | None:
        with self.changed:
            self.changed.wait_for(lambda: invocation_id in self.arrived, timeout)
            return self.arrived.get(invocation_id)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def metric_sum(server: SlessServer, name: str, function: str) -> int:
    """The sum of a counter's series of ``function`` in /metrics."""
    total = 0.0
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and f'function="{function}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def submitted_total(server: SlessServer, function: str) -> int:
    return metric_sum(server, "sless_async_submitted_total", function)


def listing(server: SlessServer, function: str, status: str | None = None) -> list[dict] | None:
    """Every invocation of ``function`` (in ``status``), page by page; None: no answer."""
    found: list[dict] = []
    after = None
    while True:
        params: dict[str, Any] = {"function": function, "limit": 1000}
        if status:
            params["status"] = status
        if after:
            params["after"] = after
        try:
            reply = server.client.get("/api/v1/invocations", params=params)
        except httpx.TransportError:
            return None
        if reply.status_code != 200:
            return None
        page = reply.json()
        found += page
        if len(page) < 1000:
            return found
        after = page[-1]["id"]


def record(server: SlessServer, invocation_id: str) -> dict | None:
    """One invocation's record; None when there is none (404)."""
    try:
        reply = server.client.get(f"/api/invocations/{invocation_id}")
    except httpx.TransportError:
        return {"status": "unanswered"}
    if reply.status_code == 404:
        return None
    if reply.status_code != 200:  # a 503 while the queue is away: not ended, not gone
        return {"status": "unanswered"}
    return reply.json()


def drained(server: SlessServer, function: str) -> bool:
    for status in ("queued", "running"):
        reply = server.client.get(
            "/api/v1/invocations", params={"function": function, "status": status, "limit": 1}
        )
        if reply.status_code != 200 or reply.json():
            return False
    return True


# --------------------------------------------------------------------------- 1. submissions


def submissions(
    server: SlessServer,
    nats: NatsServer | None,
    tmp: Path,
    function: str,
    connections: int,
    duration: float,
    drain_timeout: float | None,
) -> Submits:
    """wrk against ``function``; then, unless ``drain_timeout`` is None, wait until its
    queue is empty."""
    script = tmp / "submit.lua"
    script.write_text(WRK_SCRIPT)
    url = f"{server.base}/fn/prod/{function}/"
    serve_pid = server.process.pid if server.process else None
    nats_pid = nats.proc.pid if nats is not None and nats.proc is not None else None
    counted0 = submitted_total(server, function)
    serve0, nats0 = cpu_seconds(serve_pid), cpu_seconds(nats_pid)
    waited0, kernel0 = cpu_wait_seconds(serve_pid), cpu_seconds(serve_pid, system=True)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{duration:g}s", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    ended = time.monotonic()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = Submits(
        serve_cpu=cpu_seconds(serve_pid) - serve0,
        serve_waited=cpu_wait_seconds(serve_pid) - waited0,
        serve_kernel=cpu_seconds(serve_pid, system=True) - kernel0,
        nats_cpu=cpu_seconds(nats_pid) - nats0,
        wrk_cpu=(children1.ru_utime + children1.ru_stime)
        - (children0.ru_utime + children0.ru_stime),
    )
    match = re.search(r"^BENCH-WRK (.*)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or match is None:
        raise Stop(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    figures = {k: float(v) for k, v in (part.split("=") for part in match.group(1).split())}
    result.requests = int(figures["requests"])
    result.seconds = figures["duration_us"] / 1e6
    result.p50_ms, result.p99_ms = figures["p50_us"] / 1000, figures["p99_us"] / 1000
    result.max_ms = figures["max_us"] / 1000
    result.errors = {
        k: int(figures[k]) for k in ("connect", "read", "write", "status", "timeout") if figures[k]
    }
    result.counted = submitted_total(server, function) - counted0
    if drain_timeout is None:
        return result
    deadline = time.monotonic() + drain_timeout
    progress, moved = -1, time.monotonic()
    while time.monotonic() < deadline:
        if drained(server, function):
            result.drained_sec = time.monotonic() - ended
            return result
        done_now = metric_sum(server, "sless_async_attempts_total", function)
        if done_now != progress:
            progress, moved = done_now, time.monotonic()
        elif time.monotonic() - moved > STALL_SEC:
            break  # nothing ran for a while, and something is still queued
        time.sleep(0.2)
    queued = listing(server, function, "queued")
    result.stuck = len(queued) if queued is not None else -1
    return result


# --------------------------------------------------------------------------- 2. end to end


def end_to_end(server: SlessServer, receiver: Receiver, rounds: int) -> EndToEnd:
    result = EndToEnd()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=server.base, timeout=30, limits=limits) as client:
        for n in range(rounds + 1):  # the first round warms the connection up: not counted
            began = time.perf_counter()
            reply = client.post("/fn/prod/hello/", content=BODY, headers=JSON)
            sync_ms = (time.perf_counter() - began) * 1000
            if reply.status_code != 200:
                raise Stop(f"sync call: {reply.status_code} {reply.text}")

            headers = {**ASYNC, "X-Callback-Url": receiver.url}
            wall, began = time.time(), time.perf_counter()
            reply = client.post("/fn/prod/hello/", content=BODY, headers=headers)
            accepted_ms = (time.perf_counter() - began) * 1000
            if reply.status_code != 202:
                raise Stop(f"async call: {reply.status_code} {reply.text}")
            invocation_id = reply.json()["id"]
            arrived = receiver.wait(invocation_id, 60)
            if arrived is None:
                raise Stop(f"no callback for {invocation_id} within 60 s")
            callback_ms = (arrived[0] - began) * 1000
            found = client.get(f"/api/invocations/{invocation_id}", headers=read_auth(server))
            found.raise_for_status()
            inv = found.json()
            if inv["status"] != "succeeded" or arrived[1] != "succeeded":
                raise Stop(f"invocation {invocation_id}: {inv['status']}, {arrived[1]}")
            if n == 0:
                continue
            attempt = inv["attemptLog"][-1]
            started, ended = epoch(attempt["started"]), epoch(inv["ended"])
            assert started is not None and ended is not None
            result.sync_ms.append(sync_ms)
            result.accepted_ms.append(accepted_ms)
            result.callback_ms.append(callback_ms)
            result.started_ms.append((started - wall) * 1000)
            result.attempt_ms.append((ended - started) * 1000)
            result.ended_ms.append((ended - wall) * 1000)
    return result


def read_auth(server: SlessServer) -> dict[str, str]:
    token = server.read_token or server.api_token()
    return {"Authorization": f"Bearer {token}"}


# --------------------------------------------------------------------------- 3. crashes


def submit_many(server: SlessServer, count: int, sleep: float) -> tuple[list[str], int]:
    """``count`` invocations of sleepy from 16 threads: (accepted ids, other answers)."""
    body = json.dumps({"sleep": sleep}).encode()
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    with httpx.Client(base_url=server.base, timeout=30, limits=limits) as client:

        def one(_: int) -> str | None:
            try:
                reply = client.post("/fn/prod/sleepy/", content=body, headers=ASYNC)
            except httpx.TransportError:
                return None
            return reply.json()["id"] if reply.status_code == 202 else None

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(count)))
    ids = [a for a in answers if a]
    return ids, len(answers) - len(ids)


def statuses(server: SlessServer, ids: list[str]) -> dict[str, int]:
    wanted = set(ids)
    found = listing(server, "sleepy") or []
    return dict(Counter(r["status"] for r in found if r["id"] in wanted))


def until_running(server: SlessServer, count: int, timeout: float = 60) -> None:
    def running() -> bool:
        found = listing(server, "sleepy", "running")
        return found is not None and len(found) >= count

    wait_until(f"{count} invocations of sleepy running", running, timeout, error=Stop)
    time.sleep(0.3)  # their first log lines through the replica's pipe into its log


def settle(server: SlessServer, crash: Crash, ids: list[str], timeout: float, stall: float) -> None:
    """Wait until every accepted invocation has ended, then count. Stops waiting after
    ``timeout``, or once none has ended for ``stall`` seconds."""
    began = time.monotonic()
    deadline = began + timeout
    progress, moved = -1, began
    while True:
        listed = {r["id"]: r for r in listing(server, "sleepy") or []}
        open_ = [i for i in ids if listed.get(i, {}).get("status") not in ENDED]
        busy = any(r["status"] in ("queued", "running") for r in listed.values())
        if len(open_) != progress:
            progress, moved = len(open_), time.monotonic()
        late = time.monotonic() > deadline or time.monotonic() - moved > stall
        if open_ and (late or (listed and not busy and len(open_) <= 100)):
            # not listed (an index behind, or no record at all): asked one by one
            for one in open_:
                got = record(server, one)
                if got is not None:
                    listed[one] = got
            open_ = [i for i in ids if listed.get(i, {}).get("status") not in ENDED]
            if all(one not in listed for one in open_):
                break  # what is left has no record: lost, waiting longer cannot help
        if not open_ or late:
            break
        time.sleep(0.5)
    crash.drain_sec = time.monotonic() - began
    for one in ids:
        got = listed.get(one)
        if got is None:
            crash.missing += 1
        elif got["status"] not in ENDED:
            crash.unfinished += 1
        else:
            crash.ended[got["status"]] += 1
        if got is None or got.get("attempts", 0) <= 1:
            continue
        crash.multi += 1
        attempts = (record(server, one) or {}).get("attemptLog", [])
        if any(not a["counted"] for a in attempts):
            crash.interrupted += 1
        failed = [a["error"] for a in attempts if a["counted"] and a["error"]]
        crash.retried += bool(failed)
        crash.errors.update(failed)
    starts = log_starts(server)
    runs = Counter({one: starts[one] for one in ids if one in starts})
    crash.log_runs = sum(runs.values())
    crash.log_multi = sum(1 for n in runs.values() if n > 1)
    crash.log_extra = sum(n - 1 for n in runs.values() if n > 1)


def log_starts(server: SlessServer) -> Counter[str]:
    """How many times each invocation id started, from sleepy's log (the logs API)."""
    text, offset = [], 0
    while True:
        reply = server.client.get(
            "/api/v1/environments/prod/functions/sleepy/logs", params={"offset": offset}
        )
        reply.raise_for_status()
        chunk = reply.json()
        text.append(chunk["text"])
        if chunk["nextOffset"] >= chunk["size"] or not chunk["text"]:
            break
        offset = chunk["nextOffset"]
    starts: Counter[str] = Counter()
    for line in "".join(text).splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "bench-run":
            starts[parts[2]] += 1
    return starts


def kill_serve(
    start: Callable[[], SlessServer],
    server: SlessServer,
    queued: int,
    sleep: float,
    wait_more: float,
) -> tuple[Crash, SlessServer]:
    """``wait_more``: seconds to wait for the end beyond three times the work itself, and
    with nothing ending."""
    crash = Crash("serve (kill -9)")
    ids, crash.refused = submit_many(server, queued + CONCURRENCY, sleep)
    crash.accepted = len(ids)
    until_running(server, CONCURRENCY)
    crash.at_kill = statuses(server, ids)
    server.kill()
    server.client.close()
    print("  serve killed; starting it again on the same state folder", file=sys.stderr)
    again = start()
    remaining = crash.accepted - crash.at_kill.get("succeeded", 0)
    crash.expected_sec = remaining * sleep / CONCURRENCY
    settle(again, crash, ids, crash.expected_sec * 3 + wait_more, stall=wait_more)
    return crash, again


def kill_nats(server: SlessServer, nats: NatsServer, queued: int) -> Crash:
    crash = Crash("nats-server (kill -9)")
    ids, crash.refused = submit_many(server, queued + CONCURRENCY, NATS_SLEEP_SEC)
    crash.accepted = len(ids)
    until_running(server, CONCURRENCY)
    crash.at_kill = statuses(server, ids)
    nats.stop()  # SIGKILL
    body = json.dumps({"sleep": NATS_SLEEP_SEC}).encode()
    for _ in range(3):
        try:
            reply = server.client.post("/fn/prod/sleepy/", content=body, headers=ASYNC)
        except httpx.TransportError:
            crash.outage[0] += 1
            continue
        crash.outage[reply.status_code] += 1
        if reply.status_code == 202:
            ids.append(reply.json()["id"])
            crash.accepted += 1
    time.sleep(OUTAGE_SEC)
    print("  nats-server killed; starting it again on the same store", file=sys.stderr)
    nats.start()
    remaining = crash.accepted - crash.at_kill.get("succeeded", 0)
    crash.expected_sec = remaining * NATS_SLEEP_SEC / CONCURRENCY
    settle(server, crash, ids, crash.expected_sec * 3 + ACK_WAIT_SEC * 2 + 60, ACK_WAIT_SEC + 20)
    return crash


# --------------------------------------------------------------------------- one engine


@contextlib.contextmanager
def maybe_nats(kind: str, folder: Path) -> Iterator[NatsServer | None]:
    if kind != "nats":
        yield None
        return
    nats = NatsServer(folder / "nats")
    nats.folder.mkdir(parents=True, exist_ok=True)
    try:
        yield nats.start()
    finally:
        nats.stop()


def run_engine(kind: str, args: argparse.Namespace, repo: Path, tmp: Path) -> Engine:
    result = Engine(kind)
    folder = tmp / kind
    folder.mkdir()
    servers: list[SlessServer] = []
    receiver = Receiver()
    try:
        with maybe_nats(kind, folder) as nats:
            queue = nats.url if nats is not None else "sqlite"

            def start() -> SlessServer:
                server = SlessServer(
                    str(repo), folder / "state", args=[*SERVE_ARGS, "--queue", queue]
                )
                servers.append(server)
                try:
                    server.start()
                except AssertionError as exc:  # the helper's way of saying serve did not start
                    raise Stop(f"serve ({kind}): {exc}") from None
                wait_until("every function Ready", lambda: ready(server), 60, error=Stop)
                return server

            server = start()
            drain = 120 + args.duration * 60
            print(f"  {kind}: submissions ...", file=sys.stderr)
            if not args.smoke:  # warm-up
                submissions(server, nats, tmp, "hello", args.connections, 1, drain)
            result.submits = submissions(
                server, nats, tmp, "hello", args.connections, args.duration, drain
            )
            print(f"  {kind}: end to end, {args.rounds} rounds ...", file=sys.stderr)
            result.e2e = end_to_end(server, receiver, args.rounds)
            print(f"  {kind}: kill -9 with {args.queued} queued ...", file=sys.stderr)
            # NATS: the killed worker's messages come back after AckWait
            more = 30 + (ACK_WAIT_SEC + 20 if nats is not None else 0)
            crash, server = kill_serve(start, server, args.queued, args.sleep, more)
            result.crashes.append(crash)
            if nats is not None:
                print(f"  {kind}: nats-server kill -9 ...", file=sys.stderr)
                result.crashes.append(kill_nats(server, nats, args.queued))
            # last: its backlog is never run (one at a time, each sleeping 60 s)
            print(f"  {kind}: submissions with nothing running ...", file=sys.stderr)
            result.parked = submissions(
                server, nats, tmp, "parked", args.connections, args.duration, None
            )
    except (Stop, httpx.HTTPError) as exc:
        result.failed = f"{type(exc).__name__}: {exc}"
        if servers:
            result.failed += "\n" + servers[-1].output()[-3000:]
    finally:
        for server in servers:
            if server.process is not None and server.process.poll() is None:
                server.stop()
        receiver.close()
    return result


def ready(server: SlessServer) -> bool:
    names = ("hello", "sleepy", "parked")
    return all((server.function(n) or {}).get("phase") == "Ready" for n in names)


# --------------------------------------------------------------------------- report


def mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(args: argparse.Namespace, engines: list[Engine]) -> None:
    print(
        f"\n## Submissions (wrk -t2 -c{args.connections}, {args.duration:g} s, "
        "POST /fn/prod/hello/ with Prefer: respond-async; hello's invocations run meanwhile)"
    )
    print(
        "| engine | submissions/s | p50 ms | p99 ms | max ms | errors | server counted "
        "| serve CPU µs/submission | of it, kernel | serve cores | serve waiting for a CPU "
        "| nats-server cores "
        "| wrk cores | queue drained after |"
    )
    print(
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |"
    )
    rows = [(e.name, e.submits, True) for e in engines]
    rows += [(f"{e.name}, to parked (nothing running)", e.parked, False) for e in engines]
    for name, s, drains in rows:
        if not s.requests:
            continue
        errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        per = s.serve_cpu * 1e6 / s.requests
        if not drains:
            drained_after = "(never runs)"
        elif s.drained_sec is not None:
            drained_after = f"{s.drained_sec:.1f} s"
        else:
            drained_after = f"NEVER: {s.stuck} left queued, none run for {STALL_SEC:g} s"
        print(
            f"| {name} | {s.rate:,.0f} | {s.p50_ms:.2f} | {s.p99_ms:.2f} | {s.max_ms:.1f} "
            f"| {errors} | {s.counted:,} | {per:.0f} "
            f"| {s.serve_kernel / s.serve_cpu if s.serve_cpu else 0:.0%} "
            f"| {s.serve_cpu / s.seconds:.2f} "
            f"| {s.serve_waited / s.seconds:.2f} | {s.nats_cpu / s.seconds:.2f} "
            f"| {s.wrk_cpu / s.seconds:.2f} | {drained_after} |"
        )

    print(
        f"\n## Async over sync, end to end ({args.rounds} rounds, one call at a time, "
        "hello, p50 ms)"
    )
    print(
        "| engine | sync call | async: 202 | submit to attempt start | attempt "
        "| submit to record ended | ended - sync | ended / sync | submit to callback "
        "| callback - ended |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for e in engines:
        t = e.e2e
        if not t.sync_ms:
            continue
        sync, ended, callback = pct(t.sync_ms, 0.5), pct(t.ended_ms, 0.5), pct(t.callback_ms, 0.5)
        print(
            f"| {e.name} | {sync:.2f} | {pct(t.accepted_ms, 0.5):.2f} "
            f"| {pct(t.started_ms, 0.5):.1f} | {pct(t.attempt_ms, 0.5):.1f} "
            f"| {ended:.1f} | {ended - sync:+.1f} | {ended / sync if sync else 0:.1f} x "
            f"| {callback:.1f} | {callback - ended:+.1f} |"
        )
    print(
        "(the record's times are milliseconds of the server's clock against the client's "
        "before it sent: same machine, same clock, +-0.5 ms; the callback's arrival is "
        "timed by the receiver in this process)"
    )

    print(
        f"\n## Crash safety ({args.queued} queued + {CONCURRENCY} running of sleepy, "
        f"async concurrency {CONCURRENCY}, timeoutSec {TIMEOUT_SEC})"
    )
    print(
        "| engine | killed | sleep | accepted | just before the kill | succeeded | lost "
        "| ran more than once (records) | of them interrupted | executions in the log "
        "| ids started more than once (log) | drained after restart | the work alone |"
    )
    print(
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for e in engines:
        for c in e.crashes:
            before = ", ".join(f"{k} {v}" for k, v in sorted(c.at_kill.items()))
            sleep = NATS_SLEEP_SEC if c.what.startswith("nats") else args.sleep
            print(
                f"| {e.name} | {c.what} | {sleep:g} s | {c.accepted} | {before} "
                f"| {c.ended['succeeded']} | {c.lost} | {c.multi} | {c.interrupted} "
                f"| {c.log_runs} | {c.log_multi} (+{c.log_extra} runs) | {c.drain_sec:.1f} s "
                f"| {c.expected_sec:.1f} s |"
            )
    for e in engines:
        for c in e.crashes:
            details = []
            if c.refused:
                details.append(f"{c.refused} submissions not accepted")
            if c.outage:
                details.append(
                    "submissions while NATS was down: "
                    + ", ".join(
                        f"{n} x {code or 'no answer'}" for code, n in sorted(c.outage.items())
                    )
                )
            if c.lost:
                parts = [f"{c.missing} without a record"]
                parts.append(f"{c.unfinished} still queued or running when the wait stopped")
                parts += [f"{n} {s}" for s, n in c.ended.items() if s != "succeeded"]
                details.append("LOST: " + ", ".join(parts))
            if c.errors:
                details.append(
                    "failed attempts (tried again): "
                    + ", ".join(f"{n} x {error!r}" for error, n in c.errors.most_common(5))
                )
            if details:
                print(f"{e.name}, {c.what}: " + "; ".join(details))

    failed = [e for e in engines if e.failed]
    for e in failed:
        print(f"\n{e.name}: STOPPED EARLY: {e.failed}")

    print("\n## Targets")
    for e in engines:
        s = e.submits
        if s.requests:
            target = RATE_TARGET[e.name]
            print(
                f"{e.name}: submit p50 {s.p50_ms:.2f} ms (target <= {SUBMIT_P50_TARGET_MS:g} ms) "
                f"{mark(s.p50_ms <= SUBMIT_P50_TARGET_MS)}; {s.rate:,.0f} submissions/s "
                f"(target >= {target:,.0f}) {mark(s.rate >= target)}"
            )
        else:
            print(f"{e.name}: submissions not measured MISS")
        if e.parked.requests:
            print(
                f"{e.name}: (not a target) with nothing running meanwhile: submit p50 "
                f"{e.parked.p50_ms:.2f} ms, {e.parked.rate:,.0f} submissions/s"
            )
        for c in e.crashes:
            print(f"{e.name}: {c.what}: lost {c.lost} (target 0) {mark(c.lost == 0)}")
        if not e.crashes:
            print(f"{e.name}: crash safety not measured MISS")
        for c in e.crashes:
            running = c.at_kill.get("running", 0)
            print(
                f"{e.name}: {c.what}: ran more than once (not a target; at least once is "
                f"the contract, the {running} running at the kill may run again): "
                f"{c.multi} by the records ({c.interrupted} interrupted, {c.retried} "
                f"retried after an error), {c.log_multi} by the function's log"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds of wrk (10)")
    parser.add_argument("--connections", type=int, default=16, help="wrk's connections (16)")
    parser.add_argument("--rounds", type=int, default=50, help="sync/async pairs (50)")
    parser.add_argument("--queued", type=int, default=1000, help="queued at the kill (1000)")
    parser.add_argument("--sleep", type=float, default=2.0, help="sleepy's sleep, s (2)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="sqlite,nats")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--smoke", action="store_true", help="everything, at a tiny size")
    args = parser.parse_args()
    if args.smoke:
        args.duration, args.rounds, args.queued, args.sleep = 1, 3, 20, 0.5
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - set(ENGINES):
        parser.error(f"--engines: a list of {', '.join(ENGINES)}")
    if args.duration <= 0 or args.rounds < 1 or args.queued < 0 or args.connections < 2:
        parser.error("--duration, --rounds and --connections must be positive, --queued >= 0")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind, so that serve and NATS are stopped
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    for tool in ("wrk", "git", "bwrap"):
        if shutil.which(tool) is None:
            print(f"error: {tool} is not installed (bench/setup installs wrk)", file=sys.stderr)
            return 1
    if "nats" in engines:
        try:
            nats_binary()
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)")
    tmp = Path(tempfile.mkdtemp(prefix="sless-bench-async-"))
    results: list[Engine] = []
    disk: list[tuple[float, float]] = []
    try:
        repo = init_bare(tmp / "origin.git")
        work = WorkRepo(tmp / "work")
        work.commit(
            "hello and sleepy",
            {
                "hello/sless.yaml": manifest("hello"),
                "hello/handler.py": HELLO,
                "sleepy/sless.yaml": manifest(
                    "sleepy",
                    f"    timeoutSec: {TIMEOUT_SEC}",
                    f"    async: {{concurrency: {CONCURRENCY}}}",
                ),
                "sleepy/handler.py": SLEEPY,
                "parked/sless.yaml": manifest(
                    "parked", "    timeoutSec: 120", "    async: {concurrency: 1}"
                ),
                "parked/handler.py": PARKED,
            },
        )
        work.push(str(repo))
        disk.append(fsync_ms(tmp))
        for kind in engines:
            results.append(run_engine(kind, args, repo, tmp))
        disk.append(fsync_ms(tmp))
    finally:
        if args.keep:
            print(f"kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(args, results)
    print(
        "\nfsync of 4 KiB in the state folder's file system, before / after: "
        + " / ".join(f"p50 {p50:.2f} ms, p99 {p99:.2f} ms" for p50, p99 in disk)
    )
    print(f"\nload average after: {load_average()}")
    return 1 if any(e.failed for e in results) else 0


if __name__ == "__main__":
    sys.exit(main())
