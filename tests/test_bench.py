"""Every benchmark runs, at a tiny size: a benchmark that nothing runs rots (LESSONS.md).

Each script in bench/ runs with ``--smoke`` in its own process, as a user would run it,
and must exit 0 having printed its table. Figures are never asserted: at this size they
mean nothing. The tools they need (nginx, wrk, Flask, waitress) are installed by
bench/setup, which scripts/test runs; a missing tool fails its script, never skips it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .paths import ROOT

HANG_GUARD_SEC = 600  # a hung benchmark fails here instead of stalling the suite

# script -> lines its report prints once it measured everything
REPORTS = {
    "sync.py": ["## Figures", "| figure | value | baseline, same run |", "## Targets"],
    "runtimes.py": [
        "requests/s",
        "python3.11 runtime / flask+waitress",
        "replica start, spawn to first /health 200",
        "loadavg after",
    ],
    "proxy.py": [
        "| target | conns | req/s |",
        "| /fn/ fast | 4 |",
        "| /fn/ split | 4 |",
        "| /fn/ asgi | 4 |",
    ],
    "preview.py": ["## PR webhook to preview answering", "target p50 <= 3 s"],
    "kube_sync.py": ["## Kubernetes backend, 3 functions", "(b) no-change sync", "## Targets"],
    "coldstart.py": [
        "| runtime | cold p50 ms | cold p95 ms |",
        "simultaneous first calls to an idle function",
        "## Targets",
    ],
    "autoscale.py": ["| function | calls/s |", "throughput auto / fixed", "## Targets"],
    "async.py": [
        "| engine | submissions/s |",
        "## Async over sync, end to end",
        "## Crash safety",
        "## Targets",
        "sqlite: serve (kill -9): lost",
        "nats: serve (kill -9): lost",
        "nats: nats-server (kill -9): lost",
    ],
    "restart.py": [
        "## A restart under steady load",
        "| in place (SIGUSR2) |",
        "| stop and start |",
        "## Targets",
    ],
    "revisions.py": [
        "## Rollback, 1 rounds (local backend, python3.11)",
        "| a warm revision |",
        "| a revision at zero |",
        "## The split's cost (wrk -t2 -c16, 1 rounds of each)",
        "## The share",
        "## Targets",
    ],
    "stream.py": [
        "## Time to first byte of a stream",
        "| /fn/ | 20 |",
        "## SSE events per second",
        "| nginx |",
        "## WebSocket echo",
        "## Idle WebSockets through /fn/ (10, held 1 s)",
        "## Targets",
        "- idle WebSockets held: 10 of 10",
    ],
    "kube_wake.py": [
        "## Held call forwarded after the ready watch event (2 rounds)",
        "forwarded - ready watch event",
        "warm call, client (baseline)",
        "## Targets",
    ],
}


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = {path.name for path in (ROOT / "bench").glob("*.py")}
    assert scripts == set(REPORTS)


@pytest.mark.parametrize("script", [pytest.param(name, id=name) for name in REPORTS])
def test_benchmark_runs_at_a_tiny_size(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SEC,
    )
    output = f"stdout:\n{done.stdout[-6000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0, output
    for line in REPORTS[script]:
        assert line in done.stdout, f"{line!r} not printed\n{output}"
