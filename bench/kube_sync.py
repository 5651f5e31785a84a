"""The Kubernetes backend's sync at scale: requests, time, builds, writes, memory.

    .venv/bin/python bench/kube_sync.py [--functions 10000] [--small 1000] [--per-folder 10]
                                        [--passes 5] [--smoke]

Starts the test Kubernetes API server (``python -m tests.kubeapi``) as a
separate process, so its CPU and memory are not the reconciler's, and a real
S3 server (SeaweedFS, ``tests/s3server.py``) for the build contexts; creates
the reconciler's namespace ``gitops-sless``. Runs reconcilers on the
Kubernetes backend in this process (``tests/kube_harness.py``), on two
repositories of python3.11 functions with an http trigger:

* N=``--small`` functions, one folder (one build) each, in the namespace
  ``small-prod``: (a) the first sync, from the first pass until every
  function is Ready: requests beyond writes, per build; (b) a no-change sync
  (``--passes`` of them: median time, the most requests of any one).
* N=``--functions`` functions, ``--per-folder`` of them sharing each folder
  (one image serves them all, as two entrypoints of one folder do), and one
  folder alone: the first sync until Ready (reported, its size is mostly the
  test API server's); (b) a no-change sync; the reconciler's RSS and what one
  cached object costs; (c) a commit that changes the lone function's code:
  builds and writes until it is deployed, and how long after its build ended
  the deployment was written.

Sharing folders keeps 10,000 functions within a CI-sized time (1,000 builds
instead of 10,000): every function still has its own Deployment, Service,
Function resource and watch events, which is what a pass pays for.

Requests and writes are the API server's own counts (reset before each
figure); builds are ``create Job`` writes and the backend's build calls; RSS
is this process's (``VmRSS``; it includes pygit2, boto3 and the kubernetes
client, so the RSS after imports is printed too).

Targets (issue 18; printed PASS/MISS, never asserted; exit 0 whatever they
say): no-change sync at 1,000: 0 requests, <= 50 ms; at 10,000: 0 requests,
<= 0.5 s; first sync at 1,000: <= 3 requests beyond writes per build; RSS at
10,000 <= 1 GB; one function changed in 10,000: 1 build, <= 3 writes, deployed
<= 1 s after its build.

``--smoke`` runs the whole path at N=3 (small N=2, one no-change pass, with
``--profile`` into the scratch folder), for tests/test_bench.py: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import json
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
from tests.gitserver import WorkRepo, stop_group  # noqa: E402
from tests.kube.test_kube_backend import HANDLER, function_folder  # noqa: E402
from tests.kube_harness import NAMESPACE, Harness, make, settings  # noqa: E402
from tests.s3server import start_weed  # noqa: E402

WRITE_VERBS = ("apply", "create", "patch", "delete", "update", "status")

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
        stop_group(proc)
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

    @property
    def reads(self) -> int:
        """Requests that are not writes (a watch counts once, however long it lasts)."""
        return sum(n for verb, n in self.requests.items() if verb not in WRITE_VERBS)


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
        self.built_at: dict[str, float] = {}  # build tag -> when its build returned
        self.applied_at: dict[str, float] = {}  # function -> when its objects were written
        apply = harness.backend.apply

        def timed_build(fn: Any, snapshot: Any) -> str:
            try:
                return counting_build(fn, snapshot)
            finally:
                self.built_at[fn.build_tag] = time.perf_counter()

        def timed_apply(deployment: Any, revision: Any = None) -> None:
            apply(deployment, revision)
            self.applied_at[deployment.name] = time.perf_counter()

        harness.backend.build = timed_build  # type: ignore[method-assign]
        harness.backend.apply = timed_apply  # type: ignore[method-assign]

    def sync(self, label: str, until: Any = None) -> Measure:
        """One pass (``until``: passes until ``until()`` is true), measured together."""
        self.api.reset()
        builds = self.builds
        profiler = cProfile.Profile() if self.profile else None
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        self._pass(label)
        while until is not None and not until():
            if time.perf_counter() - started > READY_TIMEOUT_SEC:
                raise SystemExit(f"{label}: not done in {READY_TIMEOUT_SEC} s")
            time.sleep(0.05)
            self._pass(label)
        seconds = time.perf_counter() - started
        if profiler is not None and self.profile is not None:
            profiler.disable()
            self.profile.mkdir(parents=True, exist_ok=True)
            slug = "".join(c if c.isalnum() else "-" for c in label).strip("-")
            profiler.dump_stats(self.profile / f"{slug}.prof")
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

    def _pass(self, label: str) -> None:
        failure = pass_failure(self.harness.reconciler.sync("bench"))
        if failure:
            raise SystemExit(f"{label}: the sync failed: {failure}")

    def all_ready(self, count: int) -> Any:
        def ready() -> bool:
            functions = self.harness.store.functions("prod")
            return sum(1 for f in functions if f["phase"] == "Ready") == count

        return ready

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


def make_repo(path: Path, count: int, prefix: str = "fn", per_folder: int = 1) -> WorkRepo:
    """``count`` functions, ``per_folder`` to a folder but the last, alone in its own;
    another ``prefix`` gives other build tags (nothing shared)."""
    repo = WorkRepo(path)
    files: dict[str, str] = {}
    names = [f"{prefix}-{i:05d}" for i in range(count)]
    *grouped, alone = names
    for start in range(0, len(grouped), per_folder):
        group = grouped[start : start + per_folder]
        files.update(shared_folder(f"{prefix}-dir-{start:05d}", group, f"{prefix} v{start}"))
    files.update(function_folder(alone, text=f"{prefix} alone"))
    repo.commit(f"{count} functions", files)
    return repo


def shared_folder(folder: str, names: list[str], text: str) -> dict[str, str]:
    if len(names) == 1:
        return {
            f"{folder}/{key.split('/', 1)[1]}": value
            for key, value in function_folder(names[0], text=text).items()
        }
    entries = "".join(
        f"  - name: {name}\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    triggers:\n      - type: http\n"
        for name in names
    )
    return {f"{folder}/sless.yaml": "functions:\n" + entries, f"{folder}/main.py": HANDLER % text}


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
    small = run_small(args, tmp, stack, api, s3)
    big = run_big(args, tmp, stack, api, s3)
    report(args, small, big)
    print(f"\nload average after: {load_average()}")


@dataclass
class Figures:
    first: Measure
    nochange: Measure
    times: list[float]
    one: Measure | None = None
    after_build: float | None = None  # seconds from the changed build's end to its apply
    cached: int = 0
    rss_before: float = 0.0
    rss_after: float = 0.0


def run_small(
    args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack, api: ApiServer, s3: Any
) -> Figures:
    """N=--small, a build each, namespace small-prod: the first sync and no-change passes."""
    repo = make_repo(tmp / "small-repo", args.small, "small")
    harness = make(
        repo, tmp / "small-state", settings(api.kubeconfig, s3.config(), namespace_prefix="small-")
    )
    stack.callback(harness.close)
    bench = Bench(api, harness)
    first = bench.sync(f"first sync until Ready, N={args.small}", bench.all_ready(args.small))
    nochange, times = bench.no_change(args.passes)
    nochange.seconds = statistics.median(times)
    nochange.label = f"(b) no-change sync, N={args.small}"
    harness.close()
    return Figures(first, nochange, times)


def run_big(
    args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack, api: ApiServer, s3: Any
) -> Figures:
    started = time.perf_counter()
    repo = make_repo(tmp / "repo", args.functions, per_folder=args.per_folder)
    print(f"repository of {args.functions} functions: {time.perf_counter() - started:.1f} s")
    rss_before = rss_mb()
    harness = make(repo, tmp / "state", settings(api.kubeconfig, s3.config()))
    stack.callback(harness.close)
    bench = Bench(api, harness, args.profile)
    first = bench.sync(
        f"first sync until Ready, N={args.functions}", bench.all_ready(args.functions)
    )
    nochange, times = bench.no_change(args.passes)
    nochange.seconds = statistics.median(times)
    nochange.label = f"(b) no-change sync, N={args.functions}"
    cached, rss_after = harness.backend.cached(), rss_mb()

    alone = f"fn-{args.functions - 1:05d}"
    repo.commit("change one", {f"{alone}/main.py": HANDLER % "changed"})
    bench.applied_at.pop(alone, None)
    one = bench.sync("(c) one function changed", lambda: alone in bench.applied_at)
    one.label = f"(c) one of {args.functions} changed"
    tag = harness.function(alone)["build_tag"]
    after_build = bench.applied_at[alone] - bench.built_at[tag] if tag in bench.built_at else None
    return Figures(first, nochange, times, one, after_build, cached, rss_before, rss_after)


def report(args: argparse.Namespace, small: Figures, big: Figures) -> None:
    print(f"\n## Kubernetes backend, {args.functions} functions (python3.11, http)\n")
    header = (
        f"{'sync':36}{'wall s':>9}{'requests':>10}{'reads':>7}{'writes':>8}{'builds':>8}"
        f"{'RSS MB':>8}  requests by verb"
    )
    print(header)
    rows = [small.first, small.nochange, big.first, big.nochange]
    rows += [big.one] if big.one else []
    for m in rows:
        verbs = ", ".join(f"{v} {n}" for v, n in sorted(m.requests.items()))
        print(
            f"{m.label:36}{m.seconds:>9.3f}{m.total_requests:>10}{m.reads:>7}"
            f"{m.total_writes:>8}{m.build_jobs:>8}{m.rss_mb:>8.1f}  {verbs}"
        )
    for name, figures in ((f"N={args.small}", small), (f"N={args.functions}", big)):
        print(
            f"\nno-change sync times at {name} over {len(figures.times)} passes: "
            + ", ".join(f"{t * 1000:.1f}" for t in figures.times)
            + " ms"
        )
    for m in rows:
        print(f"\n{m.label}: requests {dict(sorted(m.by_kind.items()))}")
        print(f"{'':{len(m.label)}}  writes {dict(sorted(m.writes.items()))}")
        print(f"{'':{len(m.label)}}  backend.build calls {m.builds}")
    grown = big.rss_after - big.rss_before
    per_object = grown * 1024 * 1024 / big.cached if big.cached else 0.0
    print(
        f"\nreconciler at N={args.functions}: RSS {big.rss_after:.1f} MB "
        f"({grown:.1f} MB more than before it started), {big.cached} cached objects: "
        f"{per_object / 1024:.1f} KiB each (all it holds, divided by what the watches cache)"
    )
    targets(args, small, big)


def targets(args: argparse.Namespace, small: Figures, big: Figures) -> None:
    builds = max(1, small.first.build_jobs)
    # one LIST and one WATCH per cached kind start the informers, whatever N is; any
    # other read (a relist, the pods of an unsettled rollout, a log) counts against builds
    starts = sum(1 for key in small.first.by_kind if key.split()[0] in ("list", "watch"))
    beyond = (small.first.reads - starts) / builds
    one = big.one
    after = big.after_build
    checks = [
        (
            f"no-change sync at {args.small}: 0 requests",
            small.nochange.total_requests == 0,
            f"{small.nochange.total_requests}",
        ),
        (
            f"no-change sync at {args.small}: <= 50 ms (median)",
            small.nochange.seconds <= 0.05,
            f"{small.nochange.seconds * 1000:.1f} ms",
        ),
        (
            f"no-change sync at {args.functions}: 0 requests",
            big.nochange.total_requests == 0,
            f"{big.nochange.total_requests}",
        ),
        (
            f"no-change sync at {args.functions}: <= 0.5 s (median)",
            big.nochange.seconds <= 0.5,
            f"{big.nochange.seconds * 1000:.1f} ms",
        ),
        (
            f"first sync at {args.small}: <= 3 reads per build",
            beyond <= 3,
            f"{small.first.reads} reads ({starts} start the watches), "
            f"{small.first.build_jobs} builds: {beyond:.2f} each",
        ),
        (
            f"RSS at {args.functions}: <= 1 GB",
            big.rss_after <= 1024,
            f"{big.rss_after:.1f} MB",
        ),
        (
            f"one of {args.functions} changed: 1 build",
            one is not None and one.build_jobs == 1,
            f"{one.build_jobs if one else '-'}",
        ),
        (
            f"one of {args.functions} changed: <= 3 writes",
            one is not None and one.total_writes <= 3,
            f"{one.total_writes if one else '-'} ({dict(one.writes) if one else ''})",
        ),
        (
            f"one of {args.functions} changed: deployed <= 1 s after its build",
            after is not None and after <= 1,
            f"{after:.3f} s" if after is not None else "-",
        ),
    ]
    print("\n## Targets\n")
    for name, ok, figure in checks:
        print(f"{'PASS' if ok else 'MISS'}  {name:52} {figure}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", type=int, default=10000)
    parser.add_argument("--per-folder", type=int, default=10, help="functions sharing a folder")
    parser.add_argument("--passes", type=int, default=5, help="no-change syncs to time")
    parser.add_argument("--small", type=int, default=1000, help="N of the one-build-each sync")
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
        args.functions, args.passes, args.small, args.per_folder = 3, 1, 2, 2
        args.profile = args.profile or tmp / "profile"
    try:
        run(args, tmp, stack)
    finally:
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
