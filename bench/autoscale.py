"""Autoscaling under a burst: an autoscaled function against the same handler on one
fixed replica.

    .venv/bin/python bench/autoscale.py [--duration 10] [--callers 16] [--concurrency N]
        [--smoke]

A real ``gitops-sless serve --sandbox bubblewrap`` (``--scale-window 3s
--scale-panic-window 1s --scale-tick 0.2s``) follows a bare repository on disk with two
python3.11 functions whose handler sleeps 200 ms:

- ``auto``: ``scale: {min: 1, max: 4, target: 4}`` (4 calls in flight per replica);
- ``fixed``: ``replicas: 1``, the baseline.

Both get ``concurrency: 4`` (``--concurrency N``; 0 leaves it unset): a replica takes 4
calls at a time, the rest wait in the proxy, so one replica is what limits the baseline.

``--callers`` threads (16) each call ``GET /fn/prod/<name>/`` one call after the other,
on keep-alive connections of one ``httpx.Client``, for ``--duration`` seconds: first
against ``fixed``, then against ``auto`` (once the status API says it is back at 1 ready
replica). Meanwhile a thread reads ``auto``'s status API
(``GET /api/v1/environments/prod/functions/auto``) every 50 ms.

Sixteen callers that each wait for their answer make at most 16 / 0.2 s = 80 calls/s,
whatever serves them, and the python runtime answers every connection in a thread of its
own: without ``concurrency`` one replica takes all 16 sleeping calls at once, so the
fixed replica already reaches that ceiling and the ratio stays near 1 x
(``--concurrency 0``). With 4, one replica takes 4 at a time (20 calls/s) and 4
replicas 80: the case the 3 x target describes.

Printed: calls/s, 200s, other answers and p50/p95 latency of each, the ratio of
their throughputs (target >= 3 x), and for ``auto`` the time from the start of the burst
until the status API first said ``scaling.ready == 4`` (target: within the panic window,
1 s), with the first time each replica count was seen. ``--smoke`` runs both for 2 s
(tests/test_bench.py): its figures mean nothing. Targets are printed PASS/MISS, never
asserted: exit 0 once everything ran, 1 when something could not run. Every process
started is stopped on exit, SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gitops_sless and tests/ (the git and serve helpers)

from syncbench.common import load_average, pct, wait_until  # noqa: E402

from tests.gitserver import WorkRepo, init_bare  # noqa: E402
from tests.sless_server import SlessServer  # noqa: E402

PANIC_WINDOW_SEC = 1.0
SERVE_ARGS = ["--sandbox", "bubblewrap", "--scale-window", "3s"]
SERVE_ARGS += ["--scale-panic-window", f"{PANIC_WINDOW_SEC:g}s", "--scale-tick", "0.2s"]
MAX = 4
RATIO_TARGET = 3.0
HANDLER = "import time\n\n\ndef main(event):\n    time.sleep(0.2)\n    return {'slept': 0.2}\n"


@dataclass
class Run:
    name: str
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # ms of the 200s
    other: int = 0  # non-200 answers and transport errors
    ready_seen: dict[int, float] = field(default_factory=dict)  # ready -> first seen, s

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


def manifest(name: str, policy: str, concurrency: int | None) -> str:
    lines = [
        "functions:",
        f"  - name: {name}",
        "    runtime: python3.11",
        "    entrypoint: handler.main",
        "    triggers: [{type: http}]",
        f"    {policy}",
    ]
    if concurrency:
        lines.append(f"    concurrency: {concurrency}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def served(tmp: Path, concurrency: int | None) -> Iterator[SlessServer]:
    bare = init_bare(tmp / "origin.git")
    policies = {"auto": f"scale: {{min: 1, max: {MAX}, target: 4}}", "fixed": "replicas: 1"}
    files = {}
    for name, policy in policies.items():
        files[f"{name}/sless.yaml"] = manifest(name, policy, concurrency)
        files[f"{name}/handler.py"] = HANDLER
    work = WorkRepo(tmp / "work")
    work.commit("a sleeping handler, autoscaled and fixed", files)
    work.push(str(bare))
    server = SlessServer(str(bare), tmp / "state", args=SERVE_ARGS)
    try:
        server.start()
        yield server
    except AssertionError as exc:  # the helper's way of saying serve did not come up
        raise SystemExit(f"serve: {exc}") from None
    finally:
        server.stop()


def ready(server: SlessServer, name: str) -> int | None:
    scaling = (server.function(name) or {}).get("scaling") or {}
    return scaling.get("ready")


def drive(server: SlessServer, run: Run, callers: int, duration: float, watch: bool) -> None:
    """``callers`` threads calling ``run.name`` back to back for ``duration`` seconds."""
    limits = httpx.Limits(max_connections=callers, max_keepalive_connections=callers)
    lock = threading.Lock()
    stop = threading.Event()
    with httpx.Client(base_url=server.base, timeout=30, limits=limits) as client:
        began = time.perf_counter()
        deadline = began + duration

        def caller(_: int) -> None:
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                try:
                    ok = client.get(f"/fn/prod/{run.name}/").status_code == 200
                except httpx.TransportError:
                    ok = False
                took = (time.perf_counter() - sent) * 1000
                with lock:
                    if ok:
                        run.latencies.append(took)
                    else:
                        run.other += 1

        def watcher() -> None:  # the status API, as an operator would read it
            while not stop.is_set():
                count = ready(server, run.name)
                if count is not None and count not in run.ready_seen:
                    run.ready_seen[count] = time.perf_counter() - began
                stop.wait(0.05)

        threads = [threading.Thread(target=watcher, daemon=True)] if watch else []
        for thread in threads:
            thread.start()
        with ThreadPoolExecutor(callers) as pool:
            list(pool.map(caller, range(callers)))
        run.seconds = time.perf_counter() - began
        stop.set()
        for thread in threads:
            thread.join()


def report(args: argparse.Namespace, fixed: Run, auto: Run) -> None:
    limit = f"concurrency: {args.concurrency}" if args.concurrency else "concurrency unset"
    print(f"\n## {args.callers} callers for {args.duration:g} s, handler sleeps 200 ms ({limit})")
    print("| function | calls/s | 200s | other | p50 ms | p95 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for run, label in ((fixed, "fixed, replicas: 1 (baseline)"), (auto, "auto, scale 1..4")):
        p50, p95 = pct(run.latencies, 0.5), pct(run.latencies, 0.95)
        print(
            f"| {label} | {run.rate:.1f} | {len(run.latencies)} | {run.other} "
            f"| {p50:.1f} | {p95:.1f} |"
        )
    ceiling = args.callers / 0.2
    who = f"{args.callers} callers one call after the other, 200 ms each"
    print(f"\nceiling: {who}: {ceiling:.0f} calls/s")
    seen = ", ".join(f"{n} at {s:.2f} s" for n, s in sorted(auto.ready_seen.items()))
    print(f"\nauto: scaling.ready first seen (from the start of the burst): {seen or 'never'}")
    ratio = auto.rate / fixed.rate if fixed.rate else 0.0
    to_max = auto.ready_seen.get(MAX)
    print("\n## Targets")
    mark = "PASS" if ratio >= RATIO_TARGET else "MISS"
    print(f"throughput auto / fixed {ratio:.2f} x (target >= {RATIO_TARGET:g} x) {mark}")
    if to_max is None:
        print(
            f"ready == {MAX}: never seen during the burst (target <= {PANIC_WINDOW_SEC:g} s) MISS"
        )
    else:
        mark = "PASS" if to_max <= PANIC_WINDOW_SEC else "MISS"
        print(f"ready == {MAX} after {to_max:.2f} s (target <= {PANIC_WINDOW_SEC:g} s) {mark}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per function (10)")
    parser.add_argument("--callers", type=int, default=16, help="concurrent callers (16)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="concurrency: N on both functions (default 4; 0: unset)",
    )
    parser.add_argument("--smoke", action="store_true", help="everything, in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.duration = 2
    if args.duration <= 0 or args.callers < 1:
        parser.error("--duration and --callers must be positive")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind, so that serve is stopped
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    if shutil.which("git") is None:
        print("error: git is not installed", file=sys.stderr)
        return 1
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)")
    fixed, auto = Run("fixed"), Run("auto")
    tmp = Path(tempfile.mkdtemp(prefix="sless-bench-autoscale-"))
    try:
        with served(tmp, args.concurrency) as server:
            for run in (fixed, auto):
                wait_until(
                    f"{run.name} to be Ready", lambda n=run.name: _ready_phase(server, n), 90
                )
            wait_until("auto at 1 ready replica", lambda: ready(server, "auto") == 1, 90)
            print(f"  fixed: {args.duration:g} s ...", file=sys.stderr)
            drive(server, fixed, args.callers, args.duration, watch=False)
            wait_until("auto at 1 ready replica", lambda: ready(server, "auto") == 1, 90)
            print(f"  auto: {args.duration:g} s ...", file=sys.stderr)
            drive(server, auto, args.callers, args.duration, watch=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, fixed, auto)
    print(f"\nload average after: {load_average()}")
    return 0


def _ready_phase(server: SlessServer, name: str) -> bool:
    return (server.function(name) or {}).get("phase") == "Ready"


if __name__ == "__main__":
    sys.exit(main())
