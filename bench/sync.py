"""Reconciler benchmarks: push-to-serving latency, and a no-change pass over 1,000 functions.

    .venv/bin/python bench/sync.py [--pushes 15] [--functions 1000]

1. Push to serving: a real ``gitops-sless serve`` follows a bare repository on
   disk; each round commits a new greeting, pushes, sends a signed GitHub
   webhook, and polls /fn/ until the new text answers. Baseline measured in
   the same run: ``git push`` alone. Target: p50 <= 2 s.
2. No-change sync: an in-process reconciler over a repository of N functions
   (2% with an http trigger, so some runtime processes run). After the first
   pass, passes at the same commit are timed with the fetch excluded. Baseline
   in the same run: loading every manifest from scratch (what a pass would
   cost without caching). Targets: <= 100 ms, zero builds, zero restarts.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gitops_sless import manifest  # noqa: E402
from gitops_sless.local.backend import LocalBackend  # noqa: E402
from gitops_sless.local.secrets import SecretsDir  # noqa: E402
from gitops_sless.mirror import Mirror  # noqa: E402
from gitops_sless.reconciler import Reconciler  # noqa: E402
from gitops_sless.routes import RouteTable  # noqa: E402
from gitops_sless.store import Store  # noqa: E402

SECRET = "bench-secret"


def git(*args: str, cwd: Path) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def greeting(text: str) -> dict[str, str]:
    return {
        "greet/sless.yaml": (
            "functions:\n  - {name: greet, runtime: python3.11, entrypoint: h.main,"
            " triggers: [{type: http}]}\n"
        ),
        "greet/h.py": f"def main(event):\n    return {{'text': {text!r}}}\n",
    }


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def push_to_serving(tmp: Path, rounds: int) -> None:
    bare, work = tmp / "origin.git", tmp / "work"
    git("init", "-q", "--bare", "-b", "main", str(bare), cwd=tmp)
    git("init", "-q", "-b", "main", str(work), cwd=tmp)
    write(work, greeting("v0"))
    git("add", "-A", cwd=work)
    git("commit", "-qm", "v0", cwd=work)
    git("push", "-q", str(bare), "HEAD:main", cwd=work)
    port = free_port()
    log = (tmp / "serve.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gitops_sless",
            "serve",
            "--repo",
            str(bare),
            "--state-dir",
            str(tmp / "state"),
            "--listen",
            f"127.0.0.1:{port}",
            "--poll-interval",
            "3600",
            "--webhook-secret",
            SECRET,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        wait_for(client, "v0", 60)
        push_times, serve_times = [], []
        body = json.dumps({"ref": "refs/heads/main"}).encode()
        signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        headers = {"X-Hub-Signature-256": signature, "X-GitHub-Event": "push"}
        for i in range(1, rounds + 1):
            write(work, greeting(f"v{i}"))
            git("commit", "-qam", f"v{i}", cwd=work)
            started = time.perf_counter()
            git("push", "-q", str(bare), "HEAD:main", cwd=work)
            pushed = time.perf_counter()
            assert (
                client.post("/api/v1/webhooks/github", content=body, headers=headers).status_code
                == 202
            )
            wait_for(client, f"v{i}", 30)
            push_times.append(pushed - started)
            serve_times.append(time.perf_counter() - started)
        print("\n## Push to serving (webhook, function without dependencies)")
        print(f"{'':28}{'p50':>10}{'p90':>10}{'max':>10}")
        for name, values in (
            ("git push alone (baseline)", push_times),
            ("push -> new code answers", serve_times),
        ):
            print(
                f"{name:28}{pct(values, 0.5):>9.3f}s{pct(values, 0.9):>9.3f}s{max(values):>9.3f}s"
            )
        p50 = pct(serve_times, 0.5)
        print(
            f"ratio push-to-serving / push alone (p50): {p50 / pct(push_times, 0.5):.1f}x; "
            f"target p50 <= 2 s: {'PASS' if p50 <= 2 else 'FAIL'} ({rounds} pushes)"
        )
    finally:
        server.terminate()
        server.wait(20)
        client.close()


def wait_for(client: httpx.Client, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = client.get("/fn/prod/greet/")
            if response.status_code == 200 and response.json()["text"] == text:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.01)
    raise SystemExit(f"{text} never answered")


class TimedMirror(Mirror):
    fetch_seconds = 0.0

    def fetch(self):  # type: ignore[override]
        started = time.perf_counter()
        try:
            return super().fetch()
        finally:
            self.fetch_seconds = time.perf_counter() - started


def no_change_sync(tmp: Path, count: int, passes: int = 20) -> None:
    repo = tmp / "many"
    git("init", "-q", "-b", "main", str(repo), cwd=tmp)
    for i in range(count):
        trigger = " triggers: [{type: http}]," if i % 50 == 0 else ""
        write(
            repo,
            {
                f"fns/f{i:04d}/sless.yaml": (
                    f"functions:\n  - {{name: f{i:04d}, runtime: python3.11,{trigger}"
                    " entrypoint: h.main}\n"
                ),
                f"fns/f{i:04d}/h.py": f"def main(event):\n    return {i}\n",
            },
        )
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "many", cwd=repo)

    routes = RouteTable()
    backend = LocalBackend(tmp / "state", routes, SecretsDir(None), max_builds=2)
    store = Store(tmp / "state" / "status.db")
    mirror = TimedMirror(str(repo), "main", tmp / "state" / "mirror.git")
    reconciler = Reconciler(mirror, backend, store)
    builds = {"n": 0}
    build = backend.build

    def counting_build(fn, snapshot):
        builds["n"] += 1
        return build(fn, snapshot)

    backend.build = counting_build  # type: ignore[method-assign]
    spawns = {"n": 0}
    spawn = backend.supervisor._spawn

    def counting_spawn(spec):
        spawns["n"] += 1
        return spawn(spec)

    backend.supervisor._spawn = counting_spawn  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        first = reconciler.sync("bench")
        first_seconds = time.perf_counter() - started
        assert first.error is None, first.error
        builds_before, spawns_before = builds["n"], spawns["n"]
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            result = reconciler.sync("bench")
            times.append(time.perf_counter() - started - mirror.fetch_seconds)
            assert result.error is None and result.plan is not None and result.plan.is_empty
        snapshot = mirror.snapshot()
        cold = []
        for _ in range(3):
            started = time.perf_counter()
            manifest.load(snapshot)
            cold.append(time.perf_counter() - started)
        p50 = pct(times, 0.5)
        print(f"\n## No-change sync of {count} functions ({count // 50} with an http trigger)")
        print(
            f"first pass (builds everything): {first_seconds:.2f}s, {builds_before} builds, "
            f"{spawns_before} runtime processes"
        )
        print(
            f"no-change pass, fetch excluded: p50 {p50 * 1000:.1f} ms, "
            f"max {max(times) * 1000:.1f} ms over {passes} passes"
        )
        baseline = statistics.median(cold)
        print(
            f"baseline, loading every manifest from scratch: {baseline * 1000:.1f} ms"
            f" (ratio {p50 / baseline:.3f})"
        )
        print(
            f"builds during no-change passes: {builds['n'] - builds_before}; "
            f"process starts: {spawns['n'] - spawns_before}"
        )
        ok = p50 <= 0.1 and builds["n"] == builds_before and spawns["n"] == spawns_before
        print(f"target <= 100 ms, zero builds, zero restarts: {'PASS' if ok else 'FAIL'}")
        write(repo, {"fns/f0000/h.py": "def main(event):\n    return 'changed'\n"})
        git("commit", "-qam", "one change", cwd=repo)
        builds_before, spawns_before = builds["n"], spawns["n"]
        started = time.perf_counter()
        assert reconciler.sync("bench").error is None
        one = time.perf_counter() - started - mirror.fetch_seconds
        print(
            f"a commit changing 1 of {count} functions: {one * 1000:.0f} ms, fetch excluded "
            f"({builds['n'] - builds_before} build, {spawns['n'] - spawns_before} process start)"
        )
    finally:
        reconciler.stop()
        backend.close()
        store.close()


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=15)
    parser.add_argument("--functions", type=int, default=1000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sless-bench-"))
    try:
        print(f"load average before: {load_average()}")
        (tmp / "push").mkdir()
        push_to_serving(tmp / "push", args.pushes)
        (tmp / "sync").mkdir()
        no_change_sync(tmp / "sync", args.functions)
        print(f"load average after: {load_average()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
