"""The Kubernetes backend's sync over N functions: time, API requests, writes, builds, memory.

    .venv/bin/python bench/kube_sync.py [--functions 1000] [--passes 5] [--small 10] [--smoke]

Starts the test Kubernetes API server (``python -m tests.kubeapi``) as a
separate process, so its CPU and memory are not the reconciler's, and a real
S3 server (SeaweedFS, ``tests/s3server.py``) for the build contexts; creates
the reconciler's namespace ``gitops-sless``. Makes a git repository of N
python3.11 functions with an http trigger (one folder and sless.yaml each)
and runs a reconciler on the Kubernetes backend in this process
(``tests/kube_harness.py``), measuring:

(a) the first sync (builds and deploys everything), then passes until every
    function is Ready (not measured: rollouts settle);
(b) a no-change sync (``--passes`` of them; median and max time, the most
    requests of any one);
(c) a sync after a commit that changes one function's code.

For each: wall time, API requests by verb and writes (the API server's own
counts, reset before each), builds (``create Job``, the kaniko Jobs in the
reconciler's namespace, and the backend's build calls), and the peak RSS of
this process (``ru_maxrss``; it includes pygit2, boto3 and the kubernetes
client, so the RSS after imports is printed too).

Baselines measured in the same run: a bare LIST of every Deployment in the
environment's namespace through the reconciler's own KubeClient (one
round-trip carrying N objects), and the same no-change sync at N=``--small``
(its own namespace prefix, on the same servers, run first).

Targets (printed PASS/MISS, never asserted; exit 0 whatever they say):
no-change sync 0 writes, <= 20 requests, <= 1 s; one-function change 1
build, <= 3 writes; peak RSS <= 200 MB.

``--smoke`` runs the whole path at N=3 (baseline N=2, one no-change pass, with
``--profile`` into the scratch folder), for tests/test_bench.py: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gitops_sless.kube.client import KubeClient  # noqa: E402
from tests.gitserver import WorkRepo  # noqa: E402
from tests.kube_harness import NAMESPACE, Harness, make, settings  # noqa: E402
from tests.s3server import start_weed  # noqa: E402
from tests.test_kube_backend import HANDLER, function_folder  # noqa: E402

READY_TIMEOUT_SEC = 600


# --- this process ------------------------------------------------------------------------


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# --- the API server, a child process -----------------------------------------------------


class ApiServer:
    """``python -m tests.kubeapi`` in its own process group, with its /_test hooks."""

    def __init__(self, folder: Path) -> None:
        self.kubeconfig = folder / "kubeconfig"
        self.log = folder / "kubeapi.log"
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, timeout: float = 60) -> ApiServer:
        config = str(self.kubeconfig)
        with self.log.open("wb") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.kubeapi", "--port", "0", "--kubeconfig", config],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                start_new_session=True,
            )
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(timeout)
        if not line or not line[0].startswith("listening "):
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the test API server did not start: {line} {tail}")
        self.url = line[0].split()[1]
        return self

    def hook(self, method: str, name: str) -> Any:
        request = urllib.request.Request(f"{self.url}/_test/{name}", method=method, data=None)
        if method == "POST":
            request.data = b"{}"
            request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def reset(self) -> None:
        self.hook("POST", "reset")

    def counts(self) -> dict[str, dict[str, int]]:
        return self.hook("GET", "counts")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


# --- measuring ---------------------------------------------------------------------------


@dataclass
class Measure:
    label: str
    seconds: float
    requests: Counter[str] = field(default_factory=Counter)  # verb -> n
    by_kind: Counter[str] = field(default_factory=Counter)  # "verb Kind" -> n
    writes: Counter[str] = field(default_factory=Counter)  # "verb Kind" -> n
    builds: int = 0  # backend.build calls
    peak_mb: float = 0.0
    rss_mb: float = 0.0

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_writes(self) -> int:
        return sum(self.writes.values())

    @property
    def build_jobs(self) -> int:
        return self.writes.get("create Job", 0)


class Bench:
    def __init__(self, api: ApiServer, harness: Harness, profile: Path | None = None) -> None:
        self.api = api
        self.harness = harness
        self.profile = profile
        self.builds = 0
        build = harness.backend.build
        lock = threading.Lock()

        def counting_build(fn: Any, snapshot: Any) -> str:
            with lock:
                self.builds += 1
            return build(fn, snapshot)

        harness.backend.build = counting_build  # type: ignore[method-assign]

    def sync(self, label: str) -> Measure:
        self.api.reset()
        builds = self.builds
        profiler = cProfile.Profile() if self.profile else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        result = self.harness.reconciler.sync("bench")
        seconds = time.perf_counter() - started
        if profiler is not None and self.profile is not None:
            profiler.disable()
            self.profile.mkdir(parents=True, exist_ok=True)
            slug = "".join(c if c.isalnum() else "-" for c in label).strip("-")
            profiler.dump_stats(self.profile / f"{slug}.prof")
        failure = pass_failure(result)
        if failure:
            raise SystemExit(f"{label}: the sync failed: {failure}")
        counts = self.api.counts()
        measure = Measure(label, seconds, builds=self.builds - builds)
        for key, n in counts["requests"].items():
            measure.requests[key.split()[0]] += n
            measure.by_kind[key] += n
        measure.writes.update({k: n for k, n in counts["writes"].items() if n})
        measure.peak_mb, measure.rss_mb = peak_rss_mb(), rss_mb()
        # at once, so that a run stopped part-way still tells what it measured
        print(
            f"  {label}: {seconds:.3f} s, {measure.total_requests} requests, "
            f"{measure.total_writes} writes, {measure.build_jobs} builds, "
            f"peak RSS {measure.peak_mb:.1f} MB",
            flush=True,
        )
        return measure

    def settle(self, count: int) -> tuple[int, float]:
        """Passes until every function is Ready: (passes, seconds)."""
        started, passes = time.perf_counter(), 0
        while time.perf_counter() - started < READY_TIMEOUT_SEC:
            began = time.perf_counter()
            self.harness.reconciler.sync("settle")
            passes += 1
            functions = self.harness.store.functions("prod")
            ready = sum(1 for f in functions if f["phase"] == "Ready")
            print(f"  settling: {time.perf_counter() - began:.3f} s, {ready}/{count} Ready")
            if ready == count:
                return passes, time.perf_counter() - started
            time.sleep(0.2)
        raise SystemExit(f"not every function became Ready in {READY_TIMEOUT_SEC} s")

    def no_change(self, passes: int) -> tuple[Measure, list[float]]:
        """``passes`` no-change syncs: the one with the most requests, and every time."""
        runs = [self.sync("no-change sync") for _ in range(passes)]
        worst = max(runs, key=lambda m: (m.total_writes, m.total_requests, m.seconds))
        return worst, [m.seconds for m in runs]


def pass_failure(result: Any) -> str | None:
    """Why a pass failed; None when it did not (work left in flight, "Progressing", did not)."""
    outcome = getattr(result, "result", None)  # older reconcilers had only .error
    if outcome in ("Failed", "Degraded") or (outcome is None and result.error):
        return result.error or outcome
    return None


def make_repo(path: Path, count: int, prefix: str = "fn") -> WorkRepo:
    """``count`` functions; another ``prefix`` gives other build tags (nothing shared)."""
    repo = WorkRepo(path)
    files: dict[str, str] = {}
    for i in range(count):
        files.update(function_folder(f"{prefix}-{i:04d}", text=f"{prefix} v{i}"))
    repo.commit(f"{count} functions", files)
    return repo


def list_deployments(client: KubeClient, namespace: str, rounds: int = 7) -> tuple[float, int]:
    """Median seconds of a bare LIST of the namespace's Deployments, and how many it held."""
    times, items = [], 0
    for _ in range(rounds):
        started = time.perf_counter()
        items = len(client.list("Deployment", namespace))
        times.append(time.perf_counter() - started)
    return statistics.median(times), items


# --- the run -----------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> None:
    print(f"load average before: {load_average()}")
    print(f"RSS after imports: {rss_mb():.1f} MB (peak {peak_rss_mb():.1f} MB)")
    api = ApiServer(tmp).start()
    stack.callback(api.stop)
    s3 = stack.enter_context(start_weed(tmp / "s3"))
    print(f"test API server {api.url} (pid {api.proc.pid if api.proc else '?'}); S3 {s3.endpoint}")
    KubeClient.from_config(str(api.kubeconfig), calls=None).create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )

    # the baseline at N=--small first, in its own namespace (prefix "small-")
    small_repo = make_repo(tmp / "small-repo", args.small, "small")
    small = make(
        small_repo,
        tmp / "small-state",
        settings(api.kubeconfig, s3.config(), namespace_prefix="small-"),
    )
    stack.callback(small.close)
    small_bench = Bench(api, small)
    small_first = small_bench.sync(f"first sync, N={args.small}")
    small_bench.settle(args.small)
    small_nochange, small_times = small_bench.no_change(args.passes)
    small.close()
    print(f"RSS after the N={args.small} baseline: {rss_mb():.1f} MB")

    started = time.perf_counter()
    repo = make_repo(tmp / "repo", args.functions)
    print(f"repository of {args.functions} functions: {time.perf_counter() - started:.1f} s")
    harness = make(repo, tmp / "state", settings(api.kubeconfig, s3.config()))
    stack.callback(harness.close)
    bench = Bench(api, harness, args.profile)
    first = bench.sync("(a) first sync")
    settle_passes, settle_seconds = bench.settle(args.functions)
    print(f"settling until all Ready: {settle_passes} passes, {settle_seconds:.1f} s")
    nochange, times = bench.no_change(args.passes)
    nochange.seconds = statistics.median(times)
    nochange.label = "(b) no-change sync"

    one_name = f"fn-{args.functions // 2:04d}"
    repo.commit("change one", {f"{one_name}/main.py": HANDLER % "changed"})
    one = bench.sync("(c) one function changed")

    list_seconds, listed = list_deployments(harness.backend.client, "sless-prod")
    small_nochange.seconds = statistics.median(small_times)
    small_nochange.label = f"no-change sync, N={args.small}"

    report(args, [first, nochange, one, small_first, small_nochange], times, small_times)
    print(
        f"\nbaseline, a bare LIST of {listed} Deployments (same KubeClient), median of 7: "
        f"{list_seconds * 1000:.1f} ms; no-change sync = "
        f"{nochange.seconds / list_seconds:.1f} x that"
    )
    print(
        f"baseline, no-change sync at N={args.small}: {small_nochange.seconds * 1000:.1f} ms, "
        f"{small_nochange.total_requests} requests; at N={args.functions}: "
        f"{nochange.seconds / small_nochange.seconds:.1f} x the time, "
        f"{nochange.total_requests / max(1, small_nochange.total_requests):.2f} x the requests"
    )
    targets(nochange, one)
    print(f"\nload average after: {load_average()}")


def report(
    args: argparse.Namespace, rows: list[Measure], times: list[float], small_times: list[float]
) -> None:
    print(f"\n## Kubernetes backend, {args.functions} functions (python3.11, http)\n")
    header = (
        f"{'sync':30}{'wall s':>9}{'requests':>10}{'writes':>8}{'builds':>8}"
        f"{'RSS MB':>8}{'peak MB':>9}  requests by verb"
    )
    print(header)
    for m in rows:
        verbs = ", ".join(f"{v} {n}" for v, n in sorted(m.requests.items()))
        print(
            f"{m.label:30}{m.seconds:>9.3f}{m.total_requests:>10}{m.total_writes:>8}"
            f"{m.build_jobs:>8}{m.rss_mb:>8.1f}{m.peak_mb:>9.1f}  {verbs}"
        )
    print(
        f"\nno-change sync times over {len(times)} passes: "
        + ", ".join(f"{t * 1000:.0f}" for t in times)
        + f" ms (N={args.small}: "
        + ", ".join(f"{t * 1000:.0f}" for t in small_times)
        + " ms)"
    )
    for m in rows:
        print(f"\n{m.label}: requests {dict(sorted(m.by_kind.items()))}")
        print(f"{'':{len(m.label)}}  writes {dict(sorted(m.writes.items()))}")
        print(f"{'':{len(m.label)}}  backend.build calls {m.builds}")


def targets(nochange: Measure, one: Measure) -> None:
    peak = peak_rss_mb()
    checks = [
        ("no-change sync: 0 writes", nochange.total_writes == 0, f"{nochange.total_writes}"),
        (
            "no-change sync: <= 20 requests",
            nochange.total_requests <= 20,
            f"{nochange.total_requests}",
        ),
        ("no-change sync: <= 1 s (median)", nochange.seconds <= 1, f"{nochange.seconds:.3f} s"),
        ("one function changed: 1 build", one.build_jobs == 1, f"{one.build_jobs}"),
        ("one function changed: <= 3 writes", one.total_writes <= 3, f"{one.total_writes}"),
        ("peak RSS <= 200 MB", peak <= 200, f"{peak:.1f} MB"),
    ]
    print("\n## Targets\n")
    for name, ok, figure in checks:
        print(f"{'PASS' if ok else 'MISS'}  {name:38} {figure}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=5, help="no-change syncs to time")
    parser.add_argument("--small", type=int, default=10, help="N of the baseline sync")
    parser.add_argument(
        "--profile",
        type=Path,
        help="write a cProfile of each measured N-function sync here (slows them down)",
    )
    parser.add_argument("--smoke", action="store_true", help="the whole path at N=3")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # seen as it runs
    # a short folder: weed's Unix socket paths are limited to 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="sless-kb-"))
    stack = contextlib.ExitStack()
    stack.callback(lambda: __import__("shutil").rmtree(tmp, ignore_errors=True))
    atexit.register(stack.close)  # also on an exception that escapes main

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    if args.smoke:
        args.functions, args.passes, args.small = 3, 1, 2
        args.profile = args.profile or tmp / "profile"
    try:
        run(args, tmp, stack)
    finally:
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
