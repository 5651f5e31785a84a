"""Cold starts: the first call to a function at zero replicas, against a bare sandboxed
interpreter start.

    .venv/bin/python bench/coldstart.py [--calls 20] [--burst 50] [--smoke]

A real ``gitops-sless serve --sandbox bubblewrap`` (``--scale-window 3s
--scale-panic-window 1s --scale-tick 0.2s``) follows a bare repository on disk with two
hello functions, ``py`` (python3.11) and ``js`` (nodejs20), each with
``scale: {min: 0, max: 4, idle: 1s}`` and an http trigger.

Each round, for each runtime in turn: wait until the status API says the function is
``Idle`` (``GET /api/v1/environments/prod/functions/{name}``, ``scaling.ready == 0``), let
0.3 s pass (the stopped replica's teardown is not measured), start the bare interpreter
once (the baseline, below), then time one ``GET /fn/prod/{name}/`` from the client, and
read its ``X-Sless-Cold-Start`` (the milliseconds the proxy held it). ``--calls`` rounds.

Baseline, interleaved with the cold calls: ``python3 -c pass`` and ``node -e ""`` started
in the sandbox a replica gets, timed from spawn to exit. The command comes from the
product's public class, as the supervisor builds it: ``sandbox.resolve("bubblewrap")``
(as root, a uid of its own through setpriv and prlimit, as serve does), then
``Sandbox.run(argv, artifact=..., runtime=runtimes/<name>, env=..., max_processes=256)``,
started with ``subprocess.Popen(command.argv, env=command.env, cwd=command.cwd,
start_new_session=True)`` and its uid given back with ``Sandbox.release``. The memory
guard's wrapper (a cgroup join, where serve uses cgroups) is not part of it.

Printed: p50/p95 of the cold call as the client saw it and as the header says, per
runtime; the bare start's p50/p95; the ratio cold p50 / bare p50 (target <= 2.0 x);
absolute targets p50 <= 100 ms, p95 <= 150 ms (Fission's pool: 110/145 ms); where the
start's time went (``sless_cold_start_seconds`` by phase from /metrics, mean over the
run); and the burst: ``--burst`` simultaneous first calls to each idle function, the
count of 200s, of 5xx and of other answers or transport errors.

``--smoke`` runs everything with 2 rounds and a burst of 5 (tests/test_bench.py); its
figures mean nothing. Targets are printed PASS/MISS, never asserted: exit 0 once
everything ran, 1 when something could not run. Every process started is stopped on
exit, SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gitops_sless and tests/ (the git and serve helpers)

from syncbench.common import load_average, pct, wait_until  # noqa: E402

from gitops_sless.local import sandbox  # noqa: E402
from tests.gitserver import WorkRepo, init_bare  # noqa: E402
from tests.sless_server import SlessServer  # noqa: E402

SERVE_ARGS = ["--sandbox", "bubblewrap"]
SERVE_ARGS += ["--scale-window", "3s", "--scale-panic-window", "1s", "--scale-tick", "0.2s"]
SETTLE_SEC = 0.3
RATIO_TARGET = 2.0
P50_TARGET_MS, P95_TARGET_MS = 100.0, 150.0
FISSION = "Fission's pool: p50 110 ms, p95 145 ms"

PYTHON = 'def main(event):\n    return {"hello": "python"}\n'
NODE = 'exports.main = () => ({ hello: "node" });\n'


class Runtime:
    def __init__(self, name: str, function: str, source: tuple[str, str], bare: list[str]):
        self.name, self.function, self.source, self.bare = name, function, source, bare
        self.client_ms: list[float] = []  # the cold call, as the client timed it
        self.header_ms: list[float] = []  # X-Sless-Cold-Start
        self.bare_ms: list[float] = []
        self.warm = 0  # calls that found a replica (no header): not counted as cold
        self.burst: dict[str, int] = {}
        self.burst_sec = 0.0


RUNTIMES = [
    Runtime("python3.11", "py", ("handler.py", PYTHON), ["python3", "-c", "pass"]),
    Runtime("nodejs20", "js", ("handler.js", NODE), ["node", "-e", ""]),
]


def manifest(rt: Runtime) -> str:
    return (
        "functions:\n"
        f"  - name: {rt.function}\n"
        f"    runtime: {rt.name}\n"
        "    entrypoint: handler.main\n"
        "    triggers: [{type: http}]\n"
        "    scale: {min: 0, max: 4, idle: 1s}\n"
    )


@contextlib.contextmanager
def served(tmp: Path) -> Iterator[SlessServer]:
    bare = init_bare(tmp / "origin.git")
    files = {}
    for rt in RUNTIMES:
        files[f"{rt.function}/sless.yaml"] = manifest(rt)
        files[f"{rt.function}/{rt.source[0]}"] = rt.source[1]
    work = WorkRepo(tmp / "work")
    work.commit("hello functions", files)
    work.push(str(bare))
    server = SlessServer(str(bare), tmp / "state", args=SERVE_ARGS)
    try:
        server.start()
        yield server
    except AssertionError as exc:  # the helper's way of saying serve did not come up
        raise SystemExit(f"serve: {exc}") from None
    finally:
        server.stop()


def idle(server: SlessServer, name: str) -> None:
    def check() -> bool:
        status = server.function(name) or {}
        return status.get("phase") == "Idle" and (status.get("scaling") or {}).get("ready") == 0

    wait_until(f"{name} to be Idle", check, 60)
    time.sleep(SETTLE_SEC)


class Bare:
    """The baseline: an interpreter started and ended in the sandbox a replica gets."""

    def __init__(self, tmp: Path) -> None:
        self.box = sandbox.resolve("bubblewrap", ("python3", "node"))
        self.artifact = tmp / "bare-artifact"
        self.artifact.mkdir()

    def start(self, rt: Runtime) -> float:
        command = self.box.run(
            rt.bare,
            artifact=self.artifact,
            runtime=ROOT / "runtimes" / rt.name,
            env={"HOME": "/tmp", "LANG": "C.UTF-8"},
            max_processes=256,
        )
        try:
            began = time.perf_counter()
            done = subprocess.run(
                command.argv,
                env=command.env,
                cwd=command.cwd,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
            )
            took = (time.perf_counter() - began) * 1000
        finally:
            self.box.release(command)
        if done.returncode != 0:
            raise SystemExit(
                f"{' '.join(rt.bare)} in the sandbox: exit {done.returncode}\n"
                f"{done.stderr.decode(errors='replace')}"
            )
        return took


def cold_call(server: SlessServer, client: httpx.Client, rt: Runtime) -> None:
    began = time.perf_counter()
    reply = client.get(f"/fn/prod/{rt.function}/")
    took = (time.perf_counter() - began) * 1000
    if reply.status_code != 200:
        raise SystemExit(
            f"{rt.function}: {reply.status_code} {reply.text}\n{server.output()[-3000:]}"
        )
    waited = reply.headers.get("x-sless-cold-start")
    if waited is None:
        rt.warm += 1
        return
    rt.client_ms.append(took)
    rt.header_ms.append(float(waited))


def burst(server: SlessServer, rt: Runtime, calls: int) -> None:
    """``calls`` simultaneous first calls to the idle function, each on its own connection."""
    idle(server, rt.function)
    start = threading.Barrier(calls)
    limits = httpx.Limits(max_connections=calls, max_keepalive_connections=calls)
    counts: dict[str, int] = {"200": 0, "5xx": 0, "other": 0}
    lock = threading.Lock()
    with httpx.Client(base_url=server.base, timeout=60, limits=limits) as client:

        def one(_: int) -> None:
            start.wait()
            try:
                code = client.get(f"/fn/prod/{rt.function}/").status_code
                kind = "200" if code == 200 else "5xx" if code >= 500 else "other"
            except httpx.TransportError:
                kind = "other"
            with lock:
                counts[kind] += 1

        began = time.perf_counter()
        with ThreadPoolExecutor(calls) as pool:
            list(pool.map(one, range(calls)))
        rt.burst_sec = time.perf_counter() - began
    rt.burst = counts


def phase_sums(server: SlessServer) -> dict[tuple[str, str], list[float]]:
    """(runtime, phase) -> [sum, count] of sless_cold_start_seconds, from /metrics."""
    sums: dict[tuple[str, str], list[float]] = {}
    for line in server.client.get("/metrics").text.splitlines():
        if not line.startswith(
            ("sless_cold_start_seconds_sum{", "sless_cold_start_seconds_count{")
        ):
            continue
        labels, value = line.rsplit(" ", 1)
        fields = dict(part.split("=", 1) for part in labels[labels.index("{") + 1 : -1].split(","))
        key = (fields.get("runtime", "").strip('"'), fields.get("phase", "").strip('"'))
        slot = sums.setdefault(key, [0.0, 0.0])
        slot[0 if "_sum{" in line else 1] += float(value)
    return sums


def mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(args: argparse.Namespace, before: dict, after: dict, status: dict) -> None:
    print(f"\n## Cold start, {args.calls} rounds (client: GET /fn/prod/<name>/ to its response)")
    print(
        "| runtime | cold p50 ms | cold p95 ms | header p50 ms | header p95 ms "
        "| bare p50 ms | bare p95 ms | p50 / bare p50 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rt in RUNTIMES:
        c50, c95 = pct(rt.client_ms, 0.5), pct(rt.client_ms, 0.95)
        b50, b95 = pct(rt.bare_ms, 0.5), pct(rt.bare_ms, 0.95)
        ratio = c50 / b50 if b50 else 0.0
        print(
            f"| {rt.name} | {c50:.1f} | {c95:.1f} | {pct(rt.header_ms, 0.5):.0f} "
            f"| {pct(rt.header_ms, 0.95):.0f} | {b50:.1f} | {b95:.1f} | {ratio:.2f} x |"
        )
    print(
        '\nbare: `python3 -c pass` / `node -e ""` in the replica\'s bubblewrap sandbox, '
        "spawn to exit, interleaved with the cold calls"
    )
    warm = {rt.name: rt.warm for rt in RUNTIMES if rt.warm}
    if warm:
        print(f"calls that found a replica already (no X-Sless-Cold-Start, left out): {warm}")

    print("\n## Where a start went (sless_cold_start_seconds from /metrics, mean ms over the run)")
    phases = ("process", "runtime", "handler", "ready", "answer", "total")
    print("| runtime | " + " | ".join(phases) + " |")
    print("| --- |" + " ---: |" * len(phases))
    for rt in RUNTIMES:
        cells = []
        for phase in phases:
            s1, n1 = after.get((rt.name, phase), [0.0, 0.0])
            s0, n0 = before.get((rt.name, phase), [0.0, 0.0])
            cells.append(f"{(s1 - s0) / (n1 - n0) * 1000:.1f}" if n1 > n0 else "-")
        print(f"| {rt.name} | " + " | ".join(cells) + " |")
    print(
        "\nstatus API afterwards (scaling.coldStartP50Ms / coldStartP95Ms): "
        + ", ".join(
            f"{name} {s.get('coldStartP50Ms')}/{s.get('coldStartP95Ms')} ms"
            for name, s in status.items()
        )
    )

    print(f"\n## {args.burst} simultaneous first calls to an idle function")
    print("| runtime | 200 | 5xx | other | all answered in |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for rt in RUNTIMES:
        b = rt.burst
        print(
            f"| {rt.name} | {b['200']} | {b['5xx']} | {b['other']} | {rt.burst_sec * 1000:.0f} ms |"
        )

    print("\n## Targets")
    for rt in RUNTIMES:
        c50, c95, b50 = pct(rt.client_ms, 0.5), pct(rt.client_ms, 0.95), pct(rt.bare_ms, 0.5)
        ratio = c50 / b50 if b50 else 0.0
        print(
            f"{rt.name}: cold p50 / bare p50 {ratio:.2f} x (target <= {RATIO_TARGET} x) "
            f"{mark(ratio <= RATIO_TARGET)}; p50 {c50:.1f} ms (<= {P50_TARGET_MS:g}) "
            f"{mark(c50 <= P50_TARGET_MS)}; p95 {c95:.1f} ms (<= {P95_TARGET_MS:g}) "
            f"{mark(c95 <= P95_TARGET_MS)}; burst all 200 {mark(rt.burst['200'] == args.burst)}"
        )
    print(f"for comparison, {FISSION}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="cold calls per runtime (20)")
    parser.add_argument("--burst", type=int, default=50, help="simultaneous first calls (50)")
    parser.add_argument("--smoke", action="store_true", help="everything, in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.burst = 2, 5
    if args.calls < 1 or args.burst < 1:
        parser.error("--calls and --burst must be at least 1")
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind, so that serve is stopped
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    for tool in ("bwrap", "node", "git"):
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:{sandbox.SANDBOX_PATH}") is None:
            print(f"error: {tool} is not installed", file=sys.stderr)
            return 1
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)")
    tmp = Path(tempfile.mkdtemp(prefix="sless-bench-coldstart-"))
    try:
        bare = Bare(tmp)
        with served(tmp) as server:
            before = phase_sums(server)
            for n in range(args.calls):
                for rt in RUNTIMES:
                    idle(server, rt.function)
                    rt.bare_ms.append(bare.start(rt))
                    cold_call(server, server.client, rt)
                print(
                    f"  round {n + 1}/{args.calls}: "
                    + ", ".join(
                        f"{rt.name} {rt.client_ms[-1]:.1f} ms (bare {rt.bare_ms[-1]:.1f})"
                        for rt in RUNTIMES
                        if rt.client_ms
                    ),
                    file=sys.stderr,
                )
            after = phase_sums(server)
            status = {
                rt.name: (server.function(rt.function) or {}).get("scaling") or {}
                for rt in RUNTIMES
            }
            for rt in RUNTIMES:
                burst(server, rt, args.burst)
    except sandbox.SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, before, after, status)
    print(f"\nload average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
