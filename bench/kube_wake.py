"""Kubernetes: a call held at zero replicas, forwarded once the watch says a replica is ready.

    .venv/bin/python bench/kube_wake.py [--calls 20] [--smoke]

Issue 27's Kubernetes target: a held request is forwarded after the Deployment reports
ready, <= 50 ms after the watch event.

Starts the test Kubernetes API server (``tests/kubeapi``'s ``FakeKube``) in this process,
a SeaweedFS S3 server (``tests/s3server.py``) for build contexts, and a real
``gitops-sless serve --backend kubernetes --scale-window 3s --scale-panic-window 1s
--scale-tick 0.2s`` in its own process, following a repository with one python3.11
function ``wake`` (http trigger, ``scale: {min: 0, max: 2, idle: 1s}``). The invoke proxy
reaches a function through the API server's service proxy (``services/wake:80/proxy``,
as outside a cluster), which the test API server answers itself (an echo of the call).

Each round: wait until the status API says ``Idle`` and the Deployment asks for 0
replicas and has no pod, let 0.3 s pass, then send ``GET /fn/prod/wake/`` and time it
from the client; read its ``X-Sless-Cold-Start``. The proxy holds it, the reconciler
raises the Deployment through ``deployments/wake/scale``, the test API server's
controllers start a pod and mark it ready, the Deployment's ``status.availableReplicas``
goes to 1 and a watch event carries it to the reconciler, whose route for ``wake`` gets
its upstream (``KubeBackend`` on ``View.on_serving_change``), and the held call goes on.

Timestamps are the test API server's own (``FakeKube.trace``), on this process's monotonic
clock, as is the client's: when it wrote each Deployment event to a watch stream (the
first one with ``spec.replicas >= 1``: the wake; the first with ``availableReplicas >=
1``: ready), and when its service proxy took the held call (forwarded). The figure is
forwarded - ready event. Then, at once, the same call again while the replica is up
(warm): the baseline the cold figures are read against.

Printed: p50/p95/max of forwarded - ready event (target <= 50 ms: PASS/MISS), the whole
cold call from the client and its ``X-Sless-Cold-Start`` (p50/p95), where the cold call's
time went (sent -> wake written -> ready event -> forwarded -> answered: p50 and max), and the
warm call's p50/p95.

``--smoke`` runs 2 rounds (tests/test_bench.py); its figures mean nothing. Targets are
printed, never asserted: exit 0 once everything ran. Every process started is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gitops_sless and tests/ (the API server double, serve helpers)

from gitops_sless.kube.client import KubeClient  # noqa: E402
from gitops_sless.kube.renderer import FUNCTION_LABEL as FUNCTION  # noqa: E402
from tests.gitserver import WorkRepo  # noqa: E402
from tests.kube_harness import NAMESPACE, kube_env  # noqa: E402
from tests.kubeapi import FakeKube  # noqa: E402
from tests.s3server import start_weed  # noqa: E402
from tests.sless_server import SlessServer  # noqa: E402

NAME = "wake"
PROD = "sless-prod"  # the namespace of the environment prod
SERVE_ARGS = ["--backend", "kubernetes"]
SERVE_ARGS += ["--scale-window", "3s", "--scale-panic-window", "1s", "--scale-tick", "0.2s"]
SETTLE_SEC = 0.3
TARGET_MS = 50.0
MANIFEST = (
    "functions:\n"
    f"  - name: {NAME}\n"
    "    runtime: python3.11\n"
    "    entrypoint: main.handler\n"
    "    triggers:\n"
    "      - type: http\n"
    "    scale: {min: 0, max: 2, idle: 1s}\n"
)
HANDLER = "def handler(event, context):\n    return {'hello': 'kubernetes'}\n"


class Trace:
    """What the test API server did, with the monotonic time it did it (``FakeKube.trace``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # resourceVersion -> (first sent on a watch stream, replicas asked, available)
        self.events: dict[int, tuple[float, int, int]] = {}
        self.forwarded: list[float] = []  # services/wake/proxy took a call

    def __call__(self, what: str, body: dict[str, Any]) -> None:
        now = time.monotonic()
        if what == "proxy":
            if body["service"] == NAME and body["namespace"] == PROD:
                with self.lock:
                    self.forwarded.append(now)
            return
        obj = body["object"]
        meta = obj.get("metadata") or {}
        if obj.get("kind") != "Deployment" or meta.get("name") != NAME:
            return
        asked = int((obj.get("spec") or {}).get("replicas") or 0)
        available = int((obj.get("status") or {}).get("availableReplicas") or 0)
        with self.lock:  # every stream sends every event: the first send counts
            self.events.setdefault(int(meta["resourceVersion"]), (now, asked, available))

    def wake(self, after: float) -> float | None:
        """When the first event after ``after`` asking for a replica was sent."""
        with self.lock:
            times = [t for t, asked, _ in self.events.values() if t >= after and asked]
        return min(times, default=None)

    def ready(self, after: float) -> float | None:
        """When the first event after ``after`` with a replica available was sent."""
        with self.lock:
            times = [t for t, _, available in self.events.values() if t >= after and available]
        return min(times, default=None)

    def forward(self, after: float) -> float | None:
        with self.lock:
            return next((t for t in self.forwarded if t >= after), None)


@dataclass
class Round:
    sent: float
    answered: float
    header_ms: float | None
    wake: float | None
    ready: float | None
    forwarded: float | None
    warm_ms: float

    def ms(self, start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else (end - start) * 1000

    def line(self) -> str:
        def ms(start: float | None, end: float | None) -> str:
            value = self.ms(start, end)
            return "-" if value is None else f"{value:.1f}"

        header = "-" if self.header_ms is None else f"{self.header_ms:.0f}"
        return (
            f"cold {ms(self.sent, self.answered)} ms (header {header}); from sent: wake "
            f"{ms(self.sent, self.wake)}, ready event {ms(self.sent, self.ready)}, forwarded "
            f"{ms(self.sent, self.forwarded)}; forwarded - ready {ms(self.ready, self.forwarded)}"
            f" ms; warm {self.warm_ms:.1f} ms"
        )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))  # nearest rank
    return ordered[index]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@contextlib.contextmanager
def api_server(folder: Path, trace: Trace) -> Iterator[FakeKube]:
    kube = FakeKube().start()
    kube.kubeconfig = kube.write_kubeconfig(folder / "kubeconfig")
    kube.trace = trace
    try:
        KubeClient.from_config(str(kube.kubeconfig), calls=None).create(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        )
        yield kube
    finally:
        kube.stop()


def at_zero(kube: FakeKube, server: SlessServer) -> bool:
    live = kube.get("Deployment", PROD, NAME)
    if live is None or live["spec"].get("replicas", 1) != 0:
        return False
    pods = [p for p in kube.objects("Pod", PROD) if p["metadata"]["labels"].get(FUNCTION) == NAME]
    record = server.function(NAME) or {}
    return not pods and record.get("phase") == "Idle"


def one_round(kube: FakeKube, server: SlessServer, trace: Trace) -> Round:
    server.wait(lambda: at_zero(kube, server), "Idle at zero replicas", 60)
    time.sleep(SETTLE_SEC)
    sent = time.monotonic()
    reply = server.call(NAME, "/")
    answered = time.monotonic()
    if reply.status_code != 200:
        raise SystemExit(f"the cold call answered {reply.status_code}: {reply.text[:500]}")
    header = reply.headers.get("x-sless-cold-start")
    started = time.monotonic()
    warm = server.call(NAME, "/")
    warm_ms = (time.monotonic() - started) * 1000
    if warm.status_code != 200 or "x-sless-cold-start" in warm.headers:
        raise SystemExit(f"the warm call answered {warm.status_code} {dict(warm.headers)}")
    return Round(
        sent,
        answered,
        float(header) if header is not None else None,
        trace.wake(sent),
        trace.ready(sent),
        trace.forward(sent),
        warm_ms,
    )


def stats(values: list[float]) -> str:
    if not values:
        return f"{'-':>9}{'-':>9}{'-':>9}"
    return f"{percentile(values, 50):>9.1f}{percentile(values, 95):>9.1f}{max(values):>9.1f}"


def report(rounds: list[Round]) -> None:
    def column(start: str, end: str) -> list[float]:
        out = [r.ms(getattr(r, start), getattr(r, end)) for r in rounds]
        return [v for v in out if v is not None]

    after_ready = column("ready", "forwarded")
    cold = column("sent", "answered")
    header = [r.header_ms for r in rounds if r.header_ms is not None]
    warm = [r.warm_ms for r in rounds]
    print(f"\n## Held call forwarded after the ready watch event ({len(rounds)} rounds)\n")
    print(f"{'measure':46}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}")
    print(f"{'forwarded - ready watch event':46}{stats(after_ready)}")
    print(f"{'cold call, client':46}{stats(cold)}")
    print(f"{'cold call, X-Sless-Cold-Start':46}{stats(header)}")
    print(f"{'warm call, client (baseline)':46}{stats(warm)}")
    print(f"\nwhere the cold call's time went (ms):  {'median':>8}{'max':>9}")
    steps = [
        ("sent -> wake written (replicas >= 1 event)", "sent", "wake"),
        ("wake written -> ready event (pod ready)", "wake", "ready"),
        ("ready event -> forwarded", "ready", "forwarded"),
        ("forwarded -> answered at the client", "forwarded", "answered"),
    ]
    for label, start, end in steps:
        values = column(start, end)
        figure = f"{percentile(values, 50):>8.1f}{max(values):>9.1f}" if values else "-"
        print(f"  {label:44}{figure}")
    print("\nforwarded - ready event, each round: " + ", ".join(f"{v:.1f}" for v in after_ready))
    missing = sum(1 for r in rounds if None in (r.wake, r.ready, r.forwarded))
    if missing:
        print(f"{missing} rounds lacked an event or a forward (left out of the figures)")
    print("\n## Targets\n")
    worst = percentile(after_ready, 95) if after_ready else float("inf")
    verdict = "PASS" if worst <= TARGET_MS else "MISS"
    print(
        f"{verdict}  held call forwarded <= {TARGET_MS:.0f} ms after the ready watch event "
        f"(p95 {worst:.1f} ms, max {max(after_ready, default=float('nan')):.1f} ms)"
    )


def run(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> None:
    print(f"load average before: {load_average()}")
    trace = Trace()
    s3 = stack.enter_context(start_weed(tmp / "s3"))
    kube = stack.enter_context(api_server(tmp, trace))
    repo = WorkRepo(tmp / "functions")
    repo.commit(NAME, {f"{NAME}/sless.yaml": MANIFEST, f"{NAME}/main.py": HANDLER})
    server = SlessServer(
        str(repo.path),
        tmp / "state",
        env=kube_env(kube.kubeconfig, s3),
        poll_interval=3600,
        args=SERVE_ARGS,
    )
    stack.callback(server.stop)
    server.start()
    print(f"test API server {kube.url}; S3 {s3.endpoint}; serve {server.base}")
    rounds: list[Round] = []
    for i in range(args.calls):
        done = one_round(kube, server, trace)
        rounds.append(done)
        print(f"  round {i + 1}: " + done.line(), flush=True)
    if args.serve_log:
        args.serve_log.write_text(server.output())
    if "Traceback" in server.output():
        print("serve logged a traceback:\n" + server.output()[-3000:])
    report(rounds)
    print(f"\nload average after: {load_average()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="cold calls (rounds)")
    parser.add_argument("--serve-log", type=Path, help="copy serve's log here")
    parser.add_argument("--smoke", action="store_true", help="2 rounds")
    args = parser.parse_args()
    if args.smoke:
        args.calls = 2
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    # a short folder: weed's Unix socket paths are limited to 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="sless-kw-"))

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        run(args, tmp, stack)
    return 0


if __name__ == "__main__":
    sys.exit(main())
