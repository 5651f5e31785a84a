"""Scenarios 4-6 of bench/sync.py: passes over N functions in this process, through
serve's own wiring (``serve.Server``) and the public ``Reconciler`` API."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gitops_sless.manifests import load as manifest
from gitops_sless.metrics import METRICS
from gitops_sless.plan import planner
from gitops_sless.serve import ServeConfig, Server
from tests.gitserver import WorkRepo, free_port

from .common import ENV, GREET, Report, metric_builds, ms, pass_failure, runtime_pids, sless_yaml
from .timers import CallTimers


class Harness:
    """serve's reconciler, store, backend and routes in this process (serve.Server, whose
    HTTP server, poller and garbage collector are not started; the reconciler's loop is)."""

    def __init__(self, repo: Path, state: Path) -> None:
        config = ServeConfig(repo=str(repo), state_dir=state, port=free_port(), poll_interval=3600)
        self.server = Server(config)
        self.reconciler = self.server.reconciler
        self.store = self.server.store
        self.fetch_seconds = 0.0
        self.fetch_cpu = 0.0
        fetch = self.server.mirror.fetch

        def timed_fetch() -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return fetch()
            finally:
                self.fetch_seconds = time.perf_counter() - started
                self.fetch_cpu = time.thread_time() - cpu

        self.server.mirror.fetch = timed_fetch  # type: ignore[method-assign]
        # follow-ups a pass asks for (request_sync) run on the loop, as in serve
        threading.Thread(target=self.reconciler.run_forever, name="bench-loop", daemon=True).start()

    def sync(self) -> tuple[float, float]:
        """One pass; its seconds without the fetch, wall and CPU.

        CPU is the thread's that runs the pass: the process's other threads (the
        supervisor watching 10,000 functions' replicas, the memory guard reading /proc)
        work whether a pass runs or not, and their share grows with what else runs on
        the machine."""
        started, cpu = time.perf_counter(), time.thread_time()
        result = self.reconciler.sync("bench")
        took = time.perf_counter() - started - self.fetch_seconds
        took_cpu = time.thread_time() - cpu - self.fetch_cpu
        failure = pass_failure(result)
        if failure:
            raise SystemExit(f"the pass failed: {failure}")
        return took, took_cpu

    def ready(self, count: int) -> bool:
        functions = self.store.functions(ENV)
        return len(functions) == count and all(f["phase"] == "Ready" for f in functions)

    def settle(self, count: int, timeout: float) -> int:
        """More passes (on the loop) until every function is Ready; how many it took."""
        passes = 0
        deadline = time.monotonic() + timeout
        while not self.ready(count):
            if time.monotonic() > deadline:
                raise SystemExit(f"not every one of {count} functions became Ready")
            after = self.reconciler.request_sync("bench")
            self.reconciler.wait_for_pass(after - 1, 60)
            passes += 1
        return passes

    def close(self) -> None:
        self.server.close()


def make_many(path: Path, count: int, http_every: int) -> WorkRepo:
    repo = WorkRepo(path)
    files = {}
    for i in range(count):
        name = f"f{i:05d}"
        files[f"fns/{name}/sless.yaml"] = sless_yaml(name, http=i % http_every == 0)
        files[f"fns/{name}/handler.py"] = GREET % f"{name} v0"
    repo.commit(f"{count} functions", files)
    return repo


def profile_top(profiles: list[cProfile.Profile], path: Path, top: int = 15) -> str:
    stats = pstats.Stats(profiles[0], stream=io.StringIO())
    for more in profiles[1:]:
        stats.add(more)
    path.parent.mkdir(parents=True, exist_ok=True)
    stats.dump_stats(path)
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats(top)
    body = out.getvalue()
    return body[body.find("   ncalls") :] if "   ncalls" in body else body


@dataclass
class Scale:
    n: int
    http: int
    first_sync: float = 0.0
    first_ready: float = 0.0
    first_builds: float = 0
    first_starts: int = 0
    settle_passes: int = 0
    breakdown: str = ""
    no_change_profile: str = ""
    no_change: list[float] = field(default_factory=list)
    no_change_cpu: list[float] = field(default_factory=list)
    no_change_builds: float = 0
    no_change_starts: int = 0
    baseline: float = 0.0
    baseline_cpu: float = 0.0
    one_serving: float = 0.0
    one_fetch: float = 0.0
    one_build: float = 0.0
    one_builds: float = 0
    one_starts: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.no_change)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.no_change_cpu)

    @property
    def after_build(self) -> float:
        return self.one_serving - self.one_fetch - self.one_build


def scenario(tmp: Path, n: int, args: argparse.Namespace) -> Scale:
    started = time.perf_counter()
    repo = make_many(tmp / f"repo-{n}", n, args.http_every)
    result = Scale(n, http=len(range(0, n, args.http_every)))
    print(f"\n## {n} functions, {result.http} with an http trigger")
    print(f"  repository written and committed in {time.perf_counter() - started:.1f} s")
    harness = Harness(repo.path, tmp / f"state-{n}")
    try:
        first_pass(harness, result, args)
        no_change(harness, result, args)
        one_change(harness, repo, result, args)
    finally:
        harness.close()
    return result


def first_pass(h: Harness, result: Scale, args: argparse.Namespace) -> None:
    timers = CallTimers()
    timers.wrap_methods(h.server.backend, "backend")
    timers.wrap_methods(h.store, "store")
    timers.wrap_methods(h.server.mirror, "source")
    timers.wrap_function(manifest, "load")
    timers.wrap_function(planner, "plan")
    builds = metric_builds()
    started = time.perf_counter()
    try:
        h.sync()
        result.first_sync = time.perf_counter() - started
        result.settle_passes = h.settle(result.n, 600 + result.n * 0.2)
        result.first_ready = time.perf_counter() - started
    finally:
        timers.restore()
    result.first_builds = metric_builds() - builds
    result.first_starts = len(runtime_pids(os.getpid()))
    result.breakdown = timers.table(result.first_ready, threading.get_ident())
    print(
        f"  first pass: sync() returned after {result.first_sync:.2f} s, every function "
        f"Ready after {result.first_ready:.2f} s ({result.settle_passes} more passes); "
        f"{result.first_builds:.0f} builds, {result.first_starts} runtime processes",
        flush=True,
    )


def no_change(h: Harness, result: Scale, args: argparse.Namespace) -> None:
    pids, builds = runtime_pids(os.getpid()), metric_builds()
    passes = [h.sync() for _ in range(args.passes)]
    result.no_change = [wall for wall, _ in passes]
    result.no_change_cpu = [cpu for _, cpu in passes]
    result.no_change_builds = metric_builds() - builds
    result.no_change_starts = len(runtime_pids(os.getpid()) - pids)
    snapshot = h.server.mirror.snapshot()
    cold, cold_cpu = [], []
    for _ in range(3):
        started, cpu = time.perf_counter(), time.thread_time()
        manifest.load(snapshot)
        cold.append(time.perf_counter() - started)
        cold_cpu.append(time.thread_time() - cpu)
    result.baseline, result.baseline_cpu = statistics.median(cold), statistics.median(cold_cpu)
    print(
        f"  no-change pass, fetch excluded: median {ms(result.median)} "
        f"(CPU {ms(result.median_cpu)}), max {ms(max(result.no_change))} over {args.passes}; "
        f"{result.no_change_builds:.0f} builds, {result.no_change_starts} process starts; "
        f"manifest.load without a cache {ms(result.baseline)} (CPU {ms(result.baseline_cpu)})",
        flush=True,
    )
    if args.profile:
        profiles = []
        for _ in range(args.passes):
            profile = cProfile.Profile()
            profile.enable()
            h.sync()
            profile.disable()
            profiles.append(profile)
        path = args.profile / f"no-change-{result.n}.prof"
        result.no_change_profile = (
            f"cProfile of {args.passes} no-change passes at {result.n} functions, "
            f"in the thread that ran them ({path}):\n" + profile_top(profiles, path)
        )


class UpstreamWatch(threading.Thread):
    """Watches a function's route; the first time a new upstream answers ``text``."""

    def __init__(self, h: Harness, name: str, text: str) -> None:
        super().__init__(name="bench-watch", daemon=True)
        self.routes, self.name, self.text = h.server.routes, name, text
        route = self.routes.get(ENV, name)
        self.old = route.upstreams if route else ()
        self.answered: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set() and self.answered is None:
                route = self.routes.get(ENV, self.name)
                upstream = route.pick() if route and route.upstreams != self.old else None
                if upstream is not None:
                    with contextlib.suppress(httpx.TransportError, ValueError):
                        # a replica answers only the proxy's header line (Route.proof)
                        proof = route.proof.decode().strip().split(": ", 1) if route.proof else []
                        url = f"http://{upstream[0]}:{upstream[1]}/"
                        reply = client.get(url, headers=dict([proof]) if proof else None)
                        if reply.json().get("text") == self.text:
                            self.answered = time.perf_counter()
                            return
                time.sleep(0.002)


def one_change(h: Harness, repo: WorkRepo, result: Scale, args: argparse.Namespace) -> None:
    name = "f00000"  # has an http trigger
    repo.commit("one change", {f"fns/{name}/handler.py": GREET % "changed"})
    pids, builds = runtime_pids(os.getpid()), metric_builds()
    build_seconds = METRICS.build_duration.total
    watch = UpstreamWatch(h, name, "changed")
    watch.start()
    started = time.perf_counter()
    h.sync()
    result.one_fetch = h.fetch_seconds
    watch.join(120)  # a build left to the background deploys in a follow-up pass
    watch.stop.set()
    if watch.answered is None:
        raise SystemExit(f"{name}'s new code never answered")
    result.one_serving = watch.answered - started
    result.one_build = METRICS.build_duration.total - build_seconds
    result.one_builds = metric_builds() - builds
    result.one_starts = len(runtime_pids(os.getpid()) - pids)
    print(
        f"  one function changed: new code answers {ms(result.one_serving)} after the pass "
        f"started (fetch {ms(result.one_fetch)}, build {ms(result.one_build)}): "
        f"{ms(result.after_build)} after its build; {result.one_builds:.0f} builds, "
        f"{result.one_starts} process starts",
        flush=True,
    )


def figures(report: Report, runs: list[Scale], args: argparse.Namespace) -> None:
    for s in runs:
        ratio = s.median / s.baseline
        report.figure(
            f"first pass, {s.n} functions ({s.http} http)",
            f"{s.first_ready:.2f} s to all Ready (sync() {s.first_sync:.2f} s); "
            f"{s.first_builds:.0f} builds, {s.first_starts} processes",
        )
        report.figure(
            f"no-change pass, {s.n} functions, fetch excluded",
            f"median {ms(s.median)} (CPU {ms(s.median_cpu)}), max {ms(max(s.no_change))} "
            f"({len(s.no_change)} passes); {ratio:.3f} x baseline",
            f"manifest.load without a cache {ms(s.baseline)} (CPU {ms(s.baseline_cpu)})",
        )
        report.figure(
            f"one function changed in {s.n}: pass start -> new code answers",
            f"{ms(s.one_serving)}; {ms(s.after_build)} after its build ({ms(s.one_build)}) "
            f"and fetch; {s.one_builds:.0f} build, {s.one_starts} start",
        )
        report.target(
            f"no-change pass, {s.n}: <= 0.02 x manifest.load", ratio <= 0.02, f"{ratio:.3f} x"
        )
        report.target(f"no-change pass, {s.n}: <= 100 ms", s.median <= 0.1, ms(s.median))
        report.target(
            f"no-change pass, {s.n}: 0 builds, 0 process starts",
            s.no_change_builds == 0 and s.no_change_starts == 0,
            f"{s.no_change_builds:.0f}, {s.no_change_starts}",
        )
        report.target(
            f"one changed in {s.n}: <= 300 ms after its build, 1 build, 1 start",
            s.after_build <= 0.3 and s.one_builds == 1 and s.one_starts == 1,
            f"{ms(s.after_build)}, {s.one_builds:.0f}, {s.one_starts}",
        )
    if len(runs) > 1:
        small, big = runs[0], runs[-1]
        size = big.n / small.n
        # CPU time: the load from elsewhere changes between the sizes, wall time with it
        grows, grows_cpu = big.median / small.median, big.median_cpu / small.median_cpu
        report.figure(
            f"no-change pass, {big.n} ÷ {small.n} functions",
            f"{grows_cpu:.1f} x the CPU time ({grows:.1f} x the wall time) "
            f"for {size:.0f} x the functions",
        )
        report.target(
            f"no-change pass linear or better ({small.n} -> {big.n}, CPU)",
            grows_cpu <= size * 1.25,  # a quarter for noise
            f"{grows_cpu:.1f} x for {size:.0f} x",
        )
    print(f"\n## First pass at {runs[-1].n} functions: where the time went\n")
    print(runs[-1].breakdown)
    if runs[-1].no_change_profile:
        print(f"\n## No-change pass at {runs[-1].n} functions\n\n{runs[-1].no_change_profile}")
