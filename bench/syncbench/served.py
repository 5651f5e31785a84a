"""Scenarios 1-3 of bench/sync.py, through a real ``gitops-sless serve``."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.gitserver import WorkRepo, init_bare
from tests.sless_server import WEBHOOK_SECRET, ReadAuth, SlessServer

from .common import ENV, GREET, Report, pct, sless_yaml, wait_until

SLOW_BACKEND = '''\
"""This package's own build backend (PEP 517). It sleeps, as a slow setup.py would, then
writes its wheel by hand: installing it downloads nothing, not even setuptools."""
import base64
import hashlib
import os
import time
import urllib.request
import zipfile

SLEEP = {sleep!r}
COUNTER = {counter!r}  # the benchmark counts installs: one POST each
VERSION = {version!r}
DIST = "sless_slowdep-" + VERSION


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    time.sleep(SLEEP)
    # over loopback: a sandboxed installer writes no file of the host, but keeps the network;
    # an install it cannot count fails the build, so the count is never silently short
    urllib.request.urlopen(COUNTER, data=VERSION.encode(), timeout=10).close()
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


class InstallCounter:
    """Counts the slow package's installs, each reported by its build over loopback HTTP."""

    def __init__(self) -> None:
        self.versions: list[str] = []
        counter = self

        class Report(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                counter.versions.append(body.decode())
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Report)
        self.url = f"http://127.0.0.1:{self.server.server_port}/install"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def slow_dependency(folder: str, sleep: float, counter: str, version: str) -> dict[str, str]:
    """A requirements.txt that installs a local package whose build takes ``sleep`` s."""
    pkg = f"{folder}/vendored/slowdep"
    return {
        f"{folder}/requirements.txt": f"# version {version}\n./vendored/slowdep\n",
        f"{pkg}/pyproject.toml": (
            '[build-system]\nrequires = []\nbuild-backend = "slow_build"\nbackend-path = ["."]\n'
            f'\n[project]\nname = "sless-slowdep"\nversion = "{version}"\n'
        ),
        f"{pkg}/slow_build.py": SLOW_BACKEND.format(sleep=sleep, counter=counter, version=version),
    }


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


class Served:
    """``gitops-sless serve`` following a bare repository, pushed to from a work tree."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.args = args
        self.installs = InstallCounter()
        self.push_seconds: list[float] = []  # `git push` alone, the baseline of the idle push
        self.bare = str(init_bare(tmp / "origin.git"))
        self.work = WorkRepo(tmp / "work")
        self.work.commit(
            "v0",
            {
                **greet_code("v0"),
                **greet_yaml("g0"),
                **heavy_yaml("g0", 0),
                "heavy/handler.py": HEAVY,
                **slow_dependency("heavy", args.heavy_sec, self.installs.url, "0"),
                # the slow build and job are made slow round by round, not at start
                "slowbuild/sless.yaml": sless_yaml("slowbuild"),
                "slowbuild/handler.py": SLEEPER,
                **slow_dependency("slowbuild", 0, self.installs.url, "0"),
                **slow_job_yaml(0, 0),
                "slowjob/handler.py": SLEEPER,
            },
        )
        self.work.push(self.bare)
        # PIP_NO_INDEX: the installers find everything in the repository, never online
        self.server = SlessServer(self.bare, tmp / "state", env={"PIP_NO_INDEX": "1"})
        self.client = httpx.Client(
            base_url=self.server.base, timeout=30, auth=ReadAuth(self.server.read_token)
        )

    def start(self) -> float:
        """Start serve; the seconds until greet and heavy (one install) answer."""
        started = time.perf_counter()
        self.server.start(wait_for_sync=False)
        self.answers("greet", "text", "v0", 120 + self.args.heavy_sec)
        self.answers("heavy", "greeting", "g0", 120 + self.args.heavy_sec)
        took = time.perf_counter() - started
        if not self.install_count():  # heavy was installed: a counter that saw nothing is broken
            raise SystemExit("no install was counted: the slow package could not report it")
        return took

    def sandbox(self) -> str:
        """How serve confines function processes (issue 17's figures are with bubblewrap)."""
        return str(self.client.get("/api/v1/status").json().get("sandbox"))

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.installs.close()

    # --- talking to it ---------------------------------------------------------------

    def push(self, message: str, files: dict[str, str]) -> float:
        """Commit, push, send the webhook; the time just before the push."""
        self.work.commit(message, files)
        started = time.perf_counter()
        self.work.push(self.bare)
        self.push_seconds.append(time.perf_counter() - started)
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
        return len(self.installs.versions)

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
                **slow_dependency("slowbuild", slow, self.installs.url, str(k)),
                **slow_job_yaml(k, slow),
            },
        )
        # both in flight, or one of them and a second more for the other (a pass that runs
        # builds before jobs never has both)
        wait_until("the slow build or job to start", lambda: any(self.in_flight(k)), 30 + slow)
        with contextlib.suppress(SystemExit):
            wait_until("both", lambda: all(self.in_flight(k)), 1.0)
        flight = self.in_flight(k)
        if not any(flight):
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


def scenarios(tmp: Path, args: argparse.Namespace, report: Report) -> None:
    served = Served(tmp, args)
    try:
        took = served.start()
        print(f"serve answered greet and heavy after {took:.1f} s (one install of heavy)")
        print(f"function processes run in the sandbox: {served.sandbox()}")
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
        push_figures(report, idle, busy, served.push_seconds, args)
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
    report: Report,
    idle: list[float],
    busy: list[dict[str, Any]],
    pushes: list[float],
    args: argparse.Namespace,
) -> None:
    latencies = [b["latency"] for b in busy]
    both = sum(1 for b in busy if all(b["at_push"]))
    still = sum(1 for b in busy if any(b["at_answer"]))
    idle_p50, busy_p50 = pct(idle, 0.5), pct(latencies, 0.5)
    report.figure(
        f"push -> new code answers, idle ({len(idle)} pushes)",
        spread(idle),
        f"`git push` alone p50 {pct(pushes, 0.5):.3f} s",
    )
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
