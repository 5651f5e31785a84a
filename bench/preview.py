"""Pull-request previews: time from a PR webhook to the preview answering its new code.

    .venv/bin/python bench/preview.py [--rounds 10] [--functions 50] [--http 1] [--smoke]

A real ``gitops-sless serve --previews`` (local backend, ``--poll-interval 3600``:
webhooks drive every pass) follows ``acme/functions.git`` on a ``git daemon``
on 127.0.0.1. The repository has ``--functions`` python3.11 function folders
without dependencies: ``greet`` with an http trigger, ``--http - 1`` more http
functions, the rest ``enabled: false`` (built and deployed at zero replicas).

Each round, interleaved so that both meet the same load:

1. **Preview** (a new PR each round, k = 1..N, all left open: the k-th preview
   is made while k-1 others exist): commit a one-function change (greet's
   text) on a branch from main, ``git push`` it to ``refs/pull/<k>/head``,
   send a signed GitHub ``pull_request`` ``opened`` webhook, and poll
   ``/fn/pr-<k>/greet/`` until it answers the new text.
2. **Baseline**: the same kind of change committed to ``main``, pushed, a
   signed GitHub ``push`` webhook, and ``/fn/prod/greet/`` polled until it
   answers the new text.

Timed from the webhook being sent (and, in another column, from before the
``git push``). Per preview: builds (``sless_builds_total`` from ``/metrics``,
before and after) and runtime processes (``/proc/*/environ`` of the server's
children: ``SLESS_ENV=pr-<k>``, and all of them before/after once the old
replicas of a replaced function have drained). Target: p50 <= 3 s from the
webhook to the preview answering. ``--max-previews`` is set to ``--rounds``.

``--smoke`` runs one round over 3 functions (tests/test_bench.py): its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret"
TOKEN = "bench-token"
REPO = "acme/functions.git"
DRAIN_SEC = 1.5  # a replaced replica stops DRAIN_SEC (1 s) after the switch


def git(*args: str, cwd: Path) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def handler(text: str) -> str:
    return f"def main(event, context):\n    return {{'text': {text!r}}}\n"


def function(name: str, text: str, enabled: bool) -> dict[str, str]:
    flag = "" if enabled else ", enabled: false"
    return {
        f"{name}/sless.yaml": (
            f"functions:\n  - {{name: {name}, runtime: python3.11, entrypoint: handler.main,"
            f" triggers: [{{type: http}}]{flag}}}\n"
        ),
        f"{name}/handler.py": handler(text),
    }


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def commit(work: Path, files: dict[str, str], message: str) -> str:
    write(work, files)
    git("add", "-A", cwd=work)
    git("commit", "-qm", message, cwd=work)
    return git("rev-parse", "HEAD", cwd=work)


def signed(body: bytes, event: str) -> dict[str, str]:
    digest = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-Hub-Signature-256": f"sha256={digest}",
        "X-GitHub-Event": event,
        "Content-Type": "application/json",
    }


def pull_request_body(number: int, sha: str) -> bytes:
    data = json.loads((ROOT / "tests/data/webhooks/github-pull-request-opened.json").read_text())
    pr = data["pull_request"]
    data["number"] = pr["number"] = number
    pr["head"]["sha"] = sha
    pr["head"]["ref"] = f"change-{number}"
    pr["title"] = f"greet: round {number}"
    return json.dumps(data).encode()


def runtime_processes(state: Path) -> dict[int, str]:
    """pid -> SLESS_ENV of every runtime process the server on ``state`` started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "bwrap":
                continue  # the sandbox around a runtime (it has the runtime's environment)
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(v.split("=", 1) for v in raw.decode(errors="replace").split("\0") if "=" in v)
        if env.get("SLESS_FUNCTION_DIR", "").startswith(str(state)):
            found[int(entry.name)] = env.get("SLESS_ENV", "?")
    return found


def builds(client: httpx.Client) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("sless_builds_total")
    )


def answers(client: httpx.Client, env: str, text: str, timeout: float) -> float:
    """Poll /fn/<env>/greet/ until it answers ``text``; the time it first did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = client.get(f"/fn/{env}/greet/")
            if response.status_code == 200 and response.json().get("text") == text:
                return time.perf_counter()
        except httpx.TransportError:
            pass
        time.sleep(0.01)
    raise SystemExit(f"/fn/{env}/greet/ never answered {text!r}")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class Bench:
    def __init__(self, tmp: Path, functions: int, http: int, rounds: int) -> None:
        self.tmp, self.rounds = tmp, rounds
        self.served = tmp / "served"
        self.work = tmp / "work"
        self.state = tmp / "state"
        (self.served / "acme").mkdir(parents=True)
        git("init", "-q", "--bare", "-b", "main", str(self.served / REPO), cwd=tmp)
        git("init", "-q", "-b", "main", str(self.work), cwd=tmp)
        files = function("greet", "main v0", True)
        for i in range(functions - 1):
            files.update(function(f"fn-{i:02d}", f"fn {i}", enabled=i < http - 1))
        commit(self.work, files, "main v0")
        self.daemon_port = free_port()
        self.daemon = subprocess.Popen(
            [
                "git",
                "daemon",
                "--reuseaddr",
                "--export-all",
                "--enable=receive-pack",
                f"--base-path={self.served}",
                "--listen=127.0.0.1",
                f"--port={self.daemon_port}",
                str(self.served),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = f"git://127.0.0.1:{self.daemon_port}/{REPO}"
        self.wait_for_daemon()
        self.push("HEAD:refs/heads/main")
        self.port = free_port()
        self.log = (tmp / "serve.log").open("wb")
        self.server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gitops_sless",
                "serve",
                "--repo",
                self.url,
                "--state-dir",
                str(self.state),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--poll-interval",
                "3600",
                "--webhook-secret",
                SECRET,
                "--api-token",
                TOKEN,
                "--anonymous-read",  # the bench reads the API without a token, on loopback
                "--previews",
                "--max-previews",
                str(max(rounds, 1)),
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def wait_for_daemon(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.daemon_port), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise SystemExit("git daemon never listened")

    def push(self, refspec: str) -> None:
        git("push", "-q", self.url, refspec, cwd=self.work)

    def webhook(self, body: bytes, event: str) -> None:
        response = self.client.post(
            "/api/v1/webhooks/github", content=body, headers=signed(body, event)
        )
        assert response.status_code == 202, response.text

    def close(self) -> None:
        self.client.close()
        if self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self.log.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.daemon.pid, signal.SIGTERM)
        self.daemon.wait(5)

    # --- the rounds --------------------------------------------------------------------

    def preview_round(self, k: int) -> dict[str, Any]:
        text = f"pr {k}"
        git("checkout", "-q", "-b", f"change-{k}", "main", cwd=self.work)
        head = commit(self.work, {"greet/handler.py": handler(text)}, f"PR {k}")
        git("checkout", "-q", "main", cwd=self.work)
        before_builds, before = builds(self.client), runtime_processes(self.state)
        started = time.perf_counter()
        self.push(f"{head}:refs/pull/{k}/head")
        sent = time.perf_counter()
        self.webhook(pull_request_body(k, head), "pull_request")
        answered = answers(self.client, f"pr-{k}", text, 60)
        built = builds(self.client) - before_builds
        time.sleep(DRAIN_SEC)  # let replaced replicas (none expected) stop before counting
        after = runtime_processes(self.state)
        return {
            "from_push": answered - started,
            "from_webhook": answered - sent,
            "builds": built,
            "processes": sum(1 for env in after.values() if env == f"pr-{k}"),
            "all_processes_delta": len(after) - len(before),
        }

    def baseline_round(self, k: int) -> dict[str, Any]:
        text = f"main v{k}"
        commit(self.work, {"greet/handler.py": handler(text)}, f"main v{k}")
        before_builds = builds(self.client)
        started = time.perf_counter()
        self.push("HEAD:refs/heads/main")
        sent = time.perf_counter()
        self.webhook(json.dumps({"ref": "refs/heads/main"}).encode(), "push")
        answered = answers(self.client, "prod", text, 60)
        built = builds(self.client) - before_builds
        time.sleep(DRAIN_SEC)  # the replaced prod replica stops after the switch
        return {"from_push": answered - started, "from_webhook": answered - sent, "builds": built}

    def run(self) -> bool:
        answers(self.client, "prod", "main v0", 120)
        first_builds = builds(self.client)
        first_processes = len(runtime_processes(self.state))
        print(
            f"main served: {first_builds:.0f} builds, {first_processes} runtime processes "
            f"(load average {load_average()})"
        )
        previews, baseline = [], []
        for k in range(1, self.rounds + 1):
            previews.append(self.preview_round(k))
            baseline.append(self.baseline_round(k))
        listing = self.client.get("/api/v1/environments").json()
        ready = sum(1 for e in listing if (e.get("preview") or {}).get("state") == "Ready")
        return report(previews, baseline, ready, self.rounds)


def row(name: str, values: list[float]) -> str:
    return f"{name:44}{pct(values, 0.5):>9.3f}s{pct(values, 0.9):>9.3f}s{max(values):>9.3f}s"


def report(
    previews: list[dict[str, Any]], baseline: list[dict[str, Any]], ready: int, rounds: int
) -> bool:
    print(f"\n## PR webhook to preview answering ({rounds} new PRs, left open)")
    print(f"{'':44}{'p50':>10}{'p90':>10}{'max':>10}")
    print(row("preview: webhook -> pr-k answers", [p["from_webhook"] for p in previews]))
    print(row("preview: git push + webhook -> pr-k answers", [p["from_push"] for p in previews]))
    print(row("baseline: push webhook -> prod answers", [b["from_webhook"] for b in baseline]))
    print(row("baseline: git push + webhook -> prod answers", [b["from_push"] for b in baseline]))
    print(
        "preview k = 1..N, webhook -> answers: "
        + ", ".join(f"{p['from_webhook']:.2f}" for p in previews)
    )
    print(
        "per preview: builds "
        + ", ".join(f"{p['builds']:.0f}" for p in previews)
        + "; its runtime processes "
        + ", ".join(str(p["processes"]) for p in previews)
        + "; all runtime processes after - before "
        + ", ".join(f"{p['all_processes_delta']:+d}" for p in previews)
    )
    print("per baseline push: builds " + ", ".join(f"{b['builds']:.0f}" for b in baseline))
    print(f"previews listed Ready at the end: {ready} of {rounds}")
    p50 = pct([p["from_webhook"] for p in previews], 0.5)
    base = pct([b["from_webhook"] for b in baseline], 0.5)
    verdict = "PASS" if p50 <= 3 else "MISS"
    print(
        f"preview / baseline (p50, from the webhook): {p50 / base:.1f}x; "
        f"target p50 <= 3 s: {verdict} ({p50:.3f} s)"
    )
    return p50 <= 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--functions", type=int, default=50)
    parser.add_argument("--http", type=int, default=1, help="functions with replicas (>= 1)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--smoke", action="store_true", help="one round over 3 functions")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.functions, args.http = 1, 3, 1
    if not 1 <= args.http <= args.functions:
        parser.error("--http must be between 1 and --functions")
    tmp = Path(tempfile.mkdtemp(prefix="sless-bench-preview-"))
    bench = None
    try:
        print(f"load average before: {load_average()}")
        bench = Bench(tmp, args.functions, args.http, args.rounds)
        bench.run()
        print(f"load average after: {load_average()}")
    finally:
        if bench is not None:
            bench.close()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
