"""Reconciler benchmarks on the local backend: push to serving (idle, and while slow work of
other functions is in flight), a ``sless.yaml``-only change of a function with heavy
dependencies, and passes over N functions (first, no-change, one change).

    .venv/bin/python bench/sync.py [--pushes 5] [--slow-sec 60] [--heavy-sec 20]
        [--yaml-rounds 3] [--sizes 1000] [--passes 5] [--http-every 50]
        [--profile DIR] [--only serve|scale] [--smoke]

Through a real ``gitops-sless serve`` (``--poll-interval 3600``: signed GitHub push
webhooks drive every pass) following a bare repository on disk:

1. **Push to serving, idle**: a new greeting in ``greet/handler.py`` is committed, pushed,
   announced by webhook, and ``/fn/prod/greet/`` polled until it answers the new text.
   Nothing else is in flight. This is the baseline of 2. Target: p50 <= 2 s.
2. **Push to serving, busy**: first a commit that starts a ``--slow-sec`` build of another
   function (its requirements.txt installs a local package whose build sleeps) and a
   ``--slow-sec`` job of a third (its handler sleeps; its ``runId`` is bumped); once the
   API shows them in flight, the same greeting push as in 1 is timed. Idle and busy
   pushes alternate, ``--pushes`` of each. Target: busy p50 <= 1.5 x idle p50.
3. **sless.yaml-only change of a function with heavy dependencies**: ``heavy`` installs a
   local package whose build sleeps ``--heavy-sec`` (the stand-in for pandas and scipy,
   without a network). Timed: an env change in its ``sless.yaml`` until it answers the
   new value, and a ``runId`` bump of its job until the run succeeded; with the builds
   (``sless_builds_total``) and installs (the package's build counts itself) each caused.
   Baseline: the same env change of ``greet``, which has no dependencies. Target: <= 1 s,
   no install.

In this process, for each N of ``--sizes``: a repository of N function folders without
dependencies (one in ``--http-every`` with an http trigger, the others deployed without
processes), followed with serve's own wiring (``serve.Server``: its reconciler, store and
backend; the reconciler's loop runs, nothing polls; passes are started with the public
``Reconciler.sync``):

4. **First pass**: from the start of the pass until every function is Ready, with where
   the time went: timers around every public call of the backend, the store and the
   source, ``manifest.load`` and ``planner.plan`` (exclusive time, summed over threads).
5. **No-change pass**: ``--passes`` passes at the same commit, fetch excluded (the
   source's fetch is timed and subtracted): median and max, builds and process starts
   (runtime processes are counted in /proc). Baseline: ``manifest.load`` of the same
   snapshot without a cache. Targets: <= 0.02 x that, <= 100 ms, 0 builds, 0 starts;
   and the ratio between the largest and smallest N against the ratio of the N.
6. **One function changed**: a commit that changes one http function's code; the time from
   the start of the pass until the new code answers on its upstream (as the proxy routes
   it), minus the fetch and minus its build (``sless_build_duration_seconds``). Target:
   <= 300 ms after its build, 1 build, 1 process start.

``--profile DIR`` writes a cProfile of the thread that runs each measured pass (and of
extra no-change passes, not the timed ones) and prints the top functions of the
no-change pass at the largest N and of the first pass. ``--smoke`` runs every scenario at
a tiny size in seconds (tests/test_bench.py runs it): the figures then mean nothing.

Targets are printed PASS/MISS, never asserted: exit 0 once everything ran, 1 when a
scenario could not run. Every process started is stopped on exit, SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import hashlib
import hmac
import inspect
import io
import json
import os
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gitops_sless import manifest, planner  # noqa: E402
from gitops_sless.metrics import METRICS  # noqa: E402
from gitops_sless.serve import ServeConfig, Server  # noqa: E402
from tests.gitserver import WorkRepo, free_port, init_bare  # noqa: E402
from tests.sless_server import WEBHOOK_SECRET, SlessServer  # noqa: E402

ENV = "prod"
SMOKE = {
    "pushes": 1,
    "slow_sec": 2.0,
    "heavy_sec": 1.0,
    "yaml_rounds": 1,
    "sizes": "12,40",
    "passes": 3,
    "http_every": 20,
}


# --- small helpers -----------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def wait_until(what: str, predicate: Callable[[], Any], timeout: float, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def runtime_pids(root: int) -> set[int]:
    """Runtime processes (servers and job runners) below ``root``, found in /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
    found = set()
    for pid in parents:
        ancestor, hops = parents.get(pid), 0
        while ancestor not in (None, 0, 1, root) and hops < 64:
            ancestor, hops = parents.get(ancestor), hops + 1  # type: ignore[arg-type]
        if ancestor != root:
            continue
        with contextlib.suppress(OSError):
            if b"\0SLESS_FUNCTION_NAME=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                found.add(pid)
    return found


def pass_failure(result: Any) -> str | None:
    """Why a pass failed; None when it did not (work left in flight, "Progressing", did not)."""
    outcome = getattr(result, "result", None)  # older reconcilers had only .error
    if outcome in ("Failed", "Degraded") or (outcome is None and result.error):
        return result.error or outcome
    return None


def metric_builds() -> float:
    return sum(METRICS.builds.values.values())


# --- what the repositories hold --------------------------------------------------------


def sless_yaml(
    name: str,
    *,
    http: bool = False,
    env: dict[str, str] | None = None,
    job: dict[str, Any] | None = None,
    timeout: int = 30,
) -> str:
    fn: dict[str, Any] = {
        "name": name,
        "runtime": "python3.11",
        "entrypoint": "handler.main",
        "timeoutSec": timeout,
    }
    if env:
        fn["env"] = env
    if http:
        fn["triggers"] = [{"type": "http"}]
    if job:
        fn["jobs"] = [job]
    return json.dumps({"functions": [fn]}, indent=2) + "\n"  # JSON is YAML


SLOW_BACKEND = '''\
"""This package's own build backend (PEP 517). It sleeps, as a slow setup.py would, then
writes its wheel by hand: installing it downloads nothing, not even setuptools."""
import base64
import hashlib
import os
import time
import zipfile

SLEEP = {sleep!r}
MARKER = {marker!r}  # one line per install, for the benchmark to count
VERSION = {version!r}
DIST = "sless_slowdep-" + VERSION


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    time.sleep(SLEEP)
    try:
        with open(MARKER, "a") as marker:
            marker.write(VERSION + "\\n")
    except OSError:
        pass
    files = {{
        "sless_slowdep/__init__.py": ("VERSION = %r\\n" % VERSION).encode(),
        DIST + ".dist-info/METADATA": (
            "Metadata-Version: 2.1\\nName: sless-slowdep\\nVersion: %s\\n" % VERSION
        ).encode(),
        DIST + ".dist-info/WHEEL": (
            b"Wheel-Version: 1.0\\nGenerator: bench\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
        ),
    }}
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (name, digest, len(data)))
    record.append(DIST + ".dist-info/RECORD,,")
    files[DIST + ".dist-info/RECORD"] = ("\\n".join(record) + "\\n").encode()
    wheel = DIST + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel
'''


def slow_dependency(folder: str, sleep: float, marker: Path, version: str) -> dict[str, str]:
    """A requirements.txt that installs a local package whose build takes ``sleep`` s."""
    pkg = f"{folder}/vendored/slowdep"
    return {
        f"{folder}/requirements.txt": f"# version {version}\n./vendored/slowdep\n",
        f"{pkg}/pyproject.toml": (
            '[build-system]\nrequires = []\nbuild-backend = "slow_build"\nbackend-path = ["."]\n'
            f'\n[project]\nname = "sless-slowdep"\nversion = "{version}"\n'
        ),
        f"{pkg}/slow_build.py": SLOW_BACKEND.format(
            sleep=sleep, marker=str(marker), version=version
        ),
    }


GREET = """\
import os


def main(event):
    return {"text": %r, "greeting": os.environ.get("GREETING")}
"""
HEAVY = """\
import os

import sless_slowdep  # the heavy dependency: it must be installed to answer


def main(event):
    return {"greeting": os.environ.get("GREETING"), "dep": sless_slowdep.VERSION}
"""
SLEEPER = """\
import time


def main(event):
    time.sleep(float(event.get("sleep", 0)))
    return {"slept": event.get("sleep", 0)}
"""


def greet_code(text: str) -> dict[str, str]:
    return {"greet/handler.py": GREET % text}


def greet_yaml(greeting: str) -> dict[str, str]:
    return {"greet/sless.yaml": sless_yaml("greet", http=True, env={"GREETING": greeting})}


def heavy_yaml(greeting: str, run_id: int) -> dict[str, str]:
    job = {"name": "heavy-job", "runId": run_id}
    return {"heavy/sless.yaml": sless_yaml("heavy", http=True, env={"GREETING": greeting}, job=job)}


def slow_job_yaml(run_id: int, sleep: float) -> dict[str, str]:
    job = {"name": "slow-job", "runId": run_id, "event": {"sleep": sleep}}
    timeout = int(min(900, sleep + 60))
    return {"slowjob/sless.yaml": sless_yaml("slowjob", job=job, timeout=timeout)}


# --- the report ---------------------------------------------------------------------------


@dataclass
class Report:
    figures: list[tuple[str, str, str]] = field(default_factory=list)  # figure, value, baseline
    targets: list[tuple[str, bool, str]] = field(default_factory=list)

    def figure(self, name: str, value: str, baseline: str = "") -> None:
        self.figures.append((name, value, baseline))
        print(f"  {name}: {value}" + (f"  (baseline: {baseline})" if baseline else ""), flush=True)

    def target(self, name: str, ok: bool, figure: str) -> None:
        self.targets.append((name, ok, figure))

    def print(self) -> None:
        print("\n## Figures\n")
        print("| figure | value | baseline, same run |")
        print("| --- | --- | --- |")
        for name, value, baseline in self.figures:
            print(f"| {name} | {value} | {baseline} |")
        print("\n## Targets\n")
        for name, ok, figure in self.targets:
            print(f"{'PASS' if ok else 'MISS'}  {name:58} {figure}")


# --- 1-3: a real serve ---------------------------------------------------------------------


class Served:
    """``gitops-sless serve`` following a bare repository, pushed to from a work tree."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.installs = tmp / "installs.log"
        self.bare = str(init_bare(tmp / "origin.git"))
        self.work = WorkRepo(tmp / "work")
        self.work.commit(
            "v0",
            {
                **greet_code("v0"),
                **greet_yaml("g0"),
                **heavy_yaml("g0", 0),
                "heavy/handler.py": HEAVY,
                **slow_dependency("heavy", args.heavy_sec, self.installs, "0"),
                # the slow build and job are made slow round by round, not at start
                "slowbuild/sless.yaml": sless_yaml("slowbuild"),
                "slowbuild/handler.py": SLEEPER,
                **slow_dependency("slowbuild", 0, self.installs, "0"),
                **slow_job_yaml(0, 0),
                "slowjob/handler.py": SLEEPER,
            },
        )
        self.work.push(self.bare)
        # PIP_NO_INDEX: the installers find everything in the repository, never online
        self.server = SlessServer(self.bare, tmp / "state", env={"PIP_NO_INDEX": "1"})
        self.client = httpx.Client(base_url=self.server.base, timeout=30)

    def start(self) -> float:
        """Start serve; the seconds until greet and heavy (one install) answer."""
        started = time.perf_counter()
        self.server.start(wait_for_sync=False)
        self.answers("greet", "text", "v0", 120 + self.args.heavy_sec)
        self.answers("heavy", "greeting", "g0", 120 + self.args.heavy_sec)
        return time.perf_counter() - started

    def close(self) -> None:
        self.client.close()
        self.server.stop()

    # --- talking to it ---------------------------------------------------------------

    def push(self, message: str, files: dict[str, str]) -> float:
        """Commit, push, send the webhook; the time just before the push."""
        self.work.commit(message, files)
        started = time.perf_counter()
        self.work.push(self.bare)
        body = json.dumps({"ref": "refs/heads/main"}).encode()
        digest = hmac.new(WEBHOOK_SECRET.encode(), body, hashlib.sha256).hexdigest()
        headers = {"X-Hub-Signature-256": f"sha256={digest}", "X-GitHub-Event": "push"}
        response = self.client.post("/api/v1/webhooks/github", content=body, headers=headers)
        if response.status_code != 202:
            raise SystemExit(f"the webhook was refused: {response.status_code} {response.text}")
        return started

    def answers(self, name: str, key: str, value: str, timeout: float) -> float:
        """Poll /fn/prod/<name>/ until its JSON has ``key: value``; the time it first did."""

        def check() -> float | None:
            with contextlib.suppress(httpx.TransportError, ValueError):
                response = self.client.get(f"/fn/{ENV}/{name}/")
                if response.status_code == 200 and response.json().get(key) == value:
                    return time.perf_counter()
            return None

        return wait_until(f"{name} to answer {key}={value!r}", check, timeout, every=0.01)

    def function(self, name: str) -> dict[str, Any]:
        return self.server.function(name) or {}

    def job_phase(self, name: str, run_id: int) -> str | None:
        runs = [j for j in self.server.jobs() if j["name"] == name and j["runId"] == run_id]
        return runs[0]["phase"] if runs else None

    def builds(self) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in self.client.get("/metrics").text.splitlines()
            if line.startswith("sless_builds_total")
        )

    def install_count(self) -> int:
        return len(self.installs.read_text().splitlines()) if self.installs.exists() else 0

    # --- 1 and 2 -------------------------------------------------------------------------

    def idle_push(self, k: int) -> float:
        text = f"idle {k}"
        started = self.push(f"greet: {text}", greet_code(text))
        return self.answers("greet", "text", text, 60) - started

    def in_flight(self, k: int) -> tuple[bool, bool]:
        building = self.function("slowbuild").get("phase") == "Building"
        return building, self.job_phase("slow-job", k) == "Running"

    def busy_push(self, k: int) -> dict[str, Any]:
        slow = self.args.slow_sec
        before = self.function("slowbuild").get("buildTag")
        self.push(
            f"slow work {k}",
            {
                **slow_dependency("slowbuild", slow, self.installs, str(k)),
                **slow_job_yaml(k, slow),
            },
        )
        # both in flight, or one of them and a second more for the other (a pass that runs
        # builds before jobs never has both)
        seen = wait_until(
            "the slow build or job to be in flight", lambda: any(self.in_flight(k)), 30 + slow
        )
        with contextlib.suppress(SystemExit):
            wait_until("both", lambda: all(self.in_flight(k)), 1.0)
        flight = self.in_flight(k)
        seen = seen and any(flight)
        if not seen:
            raise SystemExit("the slow build and job ended before the push: raise --slow-sec")
        text = f"busy {k}"
        started = self.push(f"greet: {text}", greet_code(text))
        latency = self.answers("greet", "text", text, 3 * slow + 120) - started
        after = self.in_flight(k)
        self.wait_slow_work(k, before)
        return {"latency": latency, "at_push": flight, "at_answer": after}

    def wait_slow_work(self, k: int, tag_before: str | None) -> None:
        def done() -> bool:
            fn = self.function("slowbuild")
            built = fn.get("phase") == "Ready" and fn.get("buildTag") != tag_before
            return built and self.job_phase("slow-job", k) in ("Succeeded", "Failed")

        wait_until("the slow build and job to finish", done, 4 * self.args.slow_sec + 180, 0.2)
        if self.job_phase("slow-job", k) != "Succeeded":
            raise SystemExit(f"slow-job run {k} failed: {self.server.jobs()}")

    # --- 3 ---------------------------------------------------------------------------------

    def yaml_round(self, k: int) -> dict[str, Any]:
        greeting = f"yaml {k}"
        started = self.push(f"greet env {k}", greet_yaml(greeting))
        plain = self.answers("greet", "greeting", greeting, 60) - started
        builds, installs = self.builds(), self.install_count()
        timeout = 3 * self.args.heavy_sec + 120
        started = self.push(f"heavy env {k}", heavy_yaml(greeting, k - 1))
        env_change = self.answers("heavy", "greeting", greeting, timeout) - started
        env_builds, env_installs = self.builds() - builds, self.install_count() - installs
        builds, installs = self.builds(), self.install_count()
        started = self.push(f"heavy runId {k}", heavy_yaml(greeting, k))
        wait_until(
            f"heavy-job run {k} to finish",
            lambda: self.job_phase("heavy-job", k) in ("Succeeded", "Failed"),
            timeout,
            0.01,
        )
        run_change = time.perf_counter() - started
        if self.job_phase("heavy-job", k) != "Succeeded":
            raise SystemExit(f"heavy-job run {k} failed: {self.server.jobs()}")
        self.answers("heavy", "greeting", greeting, timeout)
        return {
            "plain": plain,
            "env": env_change,
            "env_builds": env_builds,
            "env_installs": env_installs,
            "run": run_change,
            "run_builds": self.builds() - builds,
            "run_installs": self.install_count() - installs,
        }

    def heavy_install_seconds(self) -> float | None:
        build = self.function("heavy").get("build") or {}
        if not build.get("finished"):
            return None
        started, finished = (datetime.fromisoformat(build[k]) for k in ("started", "finished"))
        return (finished - started).total_seconds()


def serve_scenarios(tmp: Path, args: argparse.Namespace, report: Report) -> None:
    served = Served(tmp, args)
    try:
        took = served.start()
        print(f"serve answered greet and heavy after {took:.1f} s (one install of heavy)")
        idle, busy = [], []
        print(f"\n## Push to serving: idle, and while a {args.slow_sec:g} s build and job run")
        for k in range(1, args.pushes + 1):
            idle.append(served.idle_push(k))
            busy.append(served.busy_push(k))
            print(
                f"  round {k}: idle {idle[-1]:.3f} s, busy {busy[-1]['latency']:.3f} s "
                f"(build, job in flight at the push: {busy[-1]['at_push']}, "
                f"when it answered: {busy[-1]['at_answer']})",
                flush=True,
            )
        push_figures(report, idle, busy, args)
        print(f"\n## sless.yaml-only changes; heavy installs in {args.heavy_sec:g} s")
        rounds = [served.yaml_round(k) for k in range(1, args.yaml_rounds + 1)]
        yaml_figures(report, rounds, served.heavy_install_seconds())
    except SystemExit:
        print(f"serve's log (the end):\n{served.server.output()[-3000:]}", file=sys.stderr)
        raise
    finally:
        served.close()


def spread(values: list[float]) -> str:
    return f"p50 {pct(values, 0.5):.3f} s, p90 {pct(values, 0.9):.3f} s, max {max(values):.3f} s"


def push_figures(
    report: Report, idle: list[float], busy: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    latencies = [b["latency"] for b in busy]
    both = sum(1 for b in busy if all(b["at_push"]))
    still = sum(1 for b in busy if any(b["at_answer"]))
    idle_p50, busy_p50 = pct(idle, 0.5), pct(latencies, 0.5)
    report.figure(f"push -> new code answers, idle ({len(idle)} pushes)", spread(idle))
    report.figure(
        f"push -> new code answers, {args.slow_sec:g} s build + job of others in flight",
        f"{spread(latencies)}; {busy_p50 / idle_p50:.2f} x idle",
        f"idle p50 {idle_p50:.3f} s",
    )
    report.figure(
        "busy pushes with both build and job in flight at the push / still when answered",
        f"{both} / {still} of {len(busy)}",
    )
    report.target("idle push -> answering p50 <= 2 s", idle_p50 <= 2, f"{idle_p50:.3f} s")
    report.target(
        "busy push -> answering p50 <= 1.5 x idle p50",
        busy_p50 <= 1.5 * idle_p50,
        f"{busy_p50:.3f} s = {busy_p50 / idle_p50:.2f} x",
    )


def yaml_figures(report: Report, rounds: list[dict[str, Any]], install: float | None) -> None:
    plain = [r["plain"] for r in rounds]
    env = [r["env"] for r in rounds]
    run = [r["run"] for r in rounds]
    counts = {
        key: sum(r[key] for r in rounds)
        for key in ("env_builds", "env_installs", "run_builds", "run_installs")
    }
    baseline = f"greet (no deps) env change p50 {pct(plain, 0.5):.3f} s"
    if install is not None:
        baseline += f"; heavy's install {install:.1f} s"
    report.figure(
        f"heavy: env change in sless.yaml -> answers ({len(rounds)} rounds)",
        f"{spread(env)}; {counts['env_builds']:.0f} builds, {counts['env_installs']} installs",
        baseline,
    )
    report.figure(
        "heavy: runId bump in sless.yaml -> its job ran",
        f"{spread(run)}; {counts['run_builds']:.0f} builds, {counts['run_installs']} installs",
    )
    worst = max(pct(env, 0.5), pct(run, 0.5))
    installs = counts["env_installs"] + counts["run_installs"]
    report.target(
        "sless.yaml-only change of heavy: <= 1 s, no install",
        worst <= 1 and installs == 0,
        f"p50 {worst:.3f} s, {installs} installs",
    )


# --- 4-6: in this process ---------------------------------------------------------------


class Harness:
    """serve's reconciler, store, backend and routes in this process (serve.Server, whose
    HTTP server, poller and garbage collector are not started; the reconciler's loop is)."""

    def __init__(self, repo: Path, state: Path) -> None:
        config = ServeConfig(repo=str(repo), state_dir=state, port=free_port(), poll_interval=3600)
        self.server = Server(config)
        self.reconciler = self.server.reconciler
        self.store = self.server.store
        self.fetch_seconds = 0.0
        fetch = self.server.mirror.fetch

        def timed_fetch() -> Any:
            started = time.perf_counter()
            try:
                return fetch()
            finally:
                self.fetch_seconds = time.perf_counter() - started

        self.server.mirror.fetch = timed_fetch  # type: ignore[method-assign]
        # follow-ups a pass asks for (request_sync) run on the loop, as in serve
        threading.Thread(target=self.reconciler.run_forever, name="bench-loop", daemon=True).start()

    def sync(self) -> float:
        """One pass; its seconds without the fetch."""
        started = time.perf_counter()
        result = self.reconciler.sync("bench")
        took = time.perf_counter() - started - self.fetch_seconds
        failure = pass_failure(result)
        if failure:
            raise SystemExit(f"the pass failed: {failure}")
        return took

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


class CallTimers:
    """Exclusive time and calls of public methods, per name, summed over every thread."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.own: defaultdict[str, float] = defaultdict(float)
        self.in_thread: defaultdict[int, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def wrap_methods(self, obj: Any, label: str) -> None:
        for name, member in inspect.getmembers(type(obj)):
            if not name.startswith("_") and inspect.isfunction(member):
                original = obj.__dict__.get(name)
                setattr(obj, name, self._timed(f"{label}.{name}", getattr(obj, name)))
                self._undo.append(self._restorer(obj, name, original))

    def wrap_function(self, module: Any, name: str) -> None:
        """``module.name``, wherever a gitops_sless module imported it by name."""
        original = getattr(module, name)
        timed = self._timed(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", original)
        for loaded in list(sys.modules.values()):
            if getattr(loaded, "__name__", "").startswith("gitops_sless") and (
                getattr(loaded, name, None) is original
            ):
                setattr(loaded, name, timed)
                self._undo.append(functools.partial(setattr, loaded, name, original))

    @staticmethod
    def _restorer(obj: Any, name: str, original: Any) -> Callable[[], None]:
        def restore() -> None:
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)

        return restore

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _timed(self, key: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # time in timed calls made by this one
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                own = took - stack.pop()
                if stack:
                    stack[-1] += took
                with self._lock:
                    self.calls[key] += 1
                    self.own[key] += own
                    self.in_thread[threading.get_ident()] += own

        return timed

    def table(self, wall: float, thread: int, top: int = 15) -> str:
        lines = [
            "| call | calls | seconds (own, all threads) | mean ms | ÷ wall |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key, seconds in sorted(self.own.items(), key=lambda kv: -kv[1])[:top]:
            n = self.calls[key]
            lines.append(
                f"| {key} | {n} | {seconds:.2f} | {seconds / n * 1000:.2f} | {seconds / wall:.2f} |"
            )
        mine = self.in_thread.get(thread, 0.0)
        lines.append(
            f"\nthe thread that ran sync(): {mine:.2f} s in these calls, {wall - mine:.2f} s "
            "outside them (the reconciler's own work, e.g. hashing and deciding, and waiting "
            "for its worker threads); all threads together: "
            f"{sum(self.own.values()):.2f} s in these calls"
        )
        return "\n".join(lines)


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
    no_change_builds: float = 0
    no_change_starts: int = 0
    baseline: float = 0.0
    one_serving: float = 0.0
    one_fetch: float = 0.0
    one_build: float = 0.0
    one_builds: float = 0
    one_starts: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.no_change)

    @property
    def after_build(self) -> float:
        return self.one_serving - self.one_fetch - self.one_build


def scale_scenario(tmp: Path, n: int, args: argparse.Namespace) -> Scale:
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
    profile = cProfile.Profile() if args.profile else None
    builds = metric_builds()
    started = time.perf_counter()
    try:
        if profile is not None:
            profile.enable()
        h.sync()
        result.first_sync = time.perf_counter() - started
        if profile is not None:
            profile.disable()
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
    if profile is not None:
        path = args.profile / f"first-pass-{result.n}.prof"
        result.breakdown += f"\n\ncProfile of sync() in its thread ({path}):\n"
        result.breakdown += profile_top([profile], path)


def no_change(h: Harness, result: Scale, args: argparse.Namespace) -> None:
    pids, builds = runtime_pids(os.getpid()), metric_builds()
    result.no_change = [h.sync() for _ in range(args.passes)]
    result.no_change_builds = metric_builds() - builds
    result.no_change_starts = len(runtime_pids(os.getpid()) - pids)
    snapshot = h.server.mirror.snapshot()
    cold = []
    for _ in range(3):
        started = time.perf_counter()
        manifest.load(snapshot)
        cold.append(time.perf_counter() - started)
    result.baseline = statistics.median(cold)
    print(
        f"  no-change pass, fetch excluded: median {ms(result.median)}, max "
        f"{ms(max(result.no_change))} over {args.passes}; {result.no_change_builds:.0f} builds, "
        f"{result.no_change_starts} process starts; manifest.load without a cache "
        f"{ms(result.baseline)}",
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
                        reply = client.get(f"http://{upstream[0]}:{upstream[1]}/")
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
    profile = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profile is not None:
        profile.enable()
    h.sync()
    if profile is not None:
        profile.disable()
        profile_top([profile], args.profile / f"one-change-{result.n}.prof")
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


def scale_figures(report: Report, runs: list[Scale], args: argparse.Namespace) -> None:
    for s in runs:
        ratio = s.median / s.baseline
        report.figure(
            f"first pass, {s.n} functions ({s.http} http)",
            f"{s.first_ready:.2f} s to all Ready (sync() {s.first_sync:.2f} s); "
            f"{s.first_builds:.0f} builds, {s.first_starts} processes",
        )
        report.figure(
            f"no-change pass, {s.n} functions, fetch excluded",
            f"median {ms(s.median)}, max {ms(max(s.no_change))} ({len(s.no_change)} passes); "
            f"{ratio:.3f} x baseline",
            f"manifest.load without a cache {ms(s.baseline)}",
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
        grows, size = big.median / small.median, big.n / small.n
        report.figure(
            f"no-change pass, {big.n} ÷ {small.n} functions",
            f"{grows:.1f} x the time for {size:.0f} x the functions",
        )
        report.target(
            f"no-change pass linear or better ({small.n} -> {big.n})",
            grows <= size * 1.25,  # a quarter for noise
            f"{grows:.1f} x for {size:.0f} x",
        )
    print(f"\n## First pass at {runs[-1].n} functions: where the time went\n")
    print(runs[-1].breakdown)
    if runs[-1].no_change_profile:
        print(f"\n## No-change pass at {runs[-1].n} functions\n\n{runs[-1].no_change_profile}")


# --- the run -------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=5, help="idle and busy pushes, each")
    parser.add_argument("--slow-sec", type=float, default=60.0, help="the slow build and job")
    parser.add_argument("--heavy-sec", type=float, default=20.0, help="heavy's install")
    parser.add_argument("--yaml-rounds", type=int, default=3, help="sless.yaml-only changes")
    parser.add_argument("--sizes", default="1000", help="N functions, comma-separated")
    parser.add_argument("--passes", type=int, default=5, help="no-change passes per N")
    parser.add_argument("--http-every", type=int, default=50, help="one http function in K")
    parser.add_argument("--profile", type=Path, help="write cProfiles here and print the top")
    parser.add_argument("--only", choices=("serve", "scale"), help="one half of the benchmark")
    parser.add_argument("--smoke", action="store_true", help="every scenario at a tiny size")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.sizes = sorted(int(n) for n in str(args.sizes).split(",") if n)
    if args.pushes < 1 or args.yaml_rounds < 1 or args.passes < 1 or not args.sizes:
        parser.error("--pushes, --yaml-rounds, --passes and --sizes need at least 1")
    return args


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="sless-bench-sync-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    args = parse()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # seen as it runs
    # SIGTERM and SIGHUP unwind like an error, so every finally stops what it started
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    report = Report()
    with scratch() as tmp:
        if args.smoke and args.profile is None:
            args.profile = tmp / "profile"
        print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)")
        if args.only in (None, "serve"):
            (tmp / "serve").mkdir()
            serve_scenarios(tmp / "serve", args, report)
        if args.only in (None, "scale"):
            runs = [scale_scenario(tmp, n, args) for n in args.sizes]
            scale_figures(report, runs, args)
        print(f"\nload average after: {load_average()}")
    report.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
