"""Revisions and rollouts (issue 29): how long a rollback takes to reach callers, what a
rollout's traffic split costs the proxy, and how exact its share is.

    .venv/bin/python bench/revisions.py [--rounds 5] [--duration 5] [--wrk-rounds 3]
        [--calls 2000] [--smoke]

A real ``gitops-sless serve --sandbox bubblewrap`` follows a bare repository on disk with
two python3.11 functions that answer their version, each ``scale: {min: 1, max: 2, idle:
1s}`` (one replica serves; a kept revision goes to zero after a second without calls):

- ``plain``: no ``rollout`` block; v1, then v2 (switched at once). Both revisions kept.
- ``canary``: ``rollout: {steps: [10], interval: 1h, minRequests: 1000000}``: v1, then
  v2, which stays at its first step (10 %) for the whole run.

1. **Rollback to a warm revision** (``--rounds`` times each way): the kept revision is
   called at its own URL (``plain@rN``: warm), then ``POST .../rollback {"to": rN}``;
   as soon as the API answers, one call to ``/fn/prod/plain/``. Printed: the API call,
   and from the API's answer to that call's answer (its version must be the revision
   rolled back to: a call that got the other one is counted as wrong).
2. **Rollback to a revision at zero**: the same, after the revision rolled back to went
   to zero (its replicas listed 0); the cold start of the same runtime measured in the
   same round (a call to ``plain@rN`` while it is at zero) is the baseline: from the
   API request to the first answer of the old code, against it.
3. **The split's cost**: ``wrk -t2 -c16 -d{--duration}s`` on keep-alive connections,
   against ``/fn/prod/canary/`` before its rollout (no split) and during it (10/90),
   with ``/fn/prod/plain/`` measured right after each as the control, ``--wrk-rounds``
   times: the median of canary / plain during, over the same before.
4. **The share**: ``--calls`` sequential calls to ``/fn/prod/canary/`` during the
   rollout: the percent answered by v2.

Targets (printed PASS/MISS, never asserted): warm rollback, API answer to the old code's
answer <= 50 ms; rollback at zero <= cold start + 50 ms; split / no split throughput
>= 0.95 (each against its control: end to end, so with the candidate's own replica
running beside, on the same cores; the proxy's cost alone is ``bench/proxy.py --proxies
fast,split``); share 10 % +- 2. ``--smoke`` (tests/test_bench.py):
1 round, 1 s of wrk, 200 calls; figures meaningless. Exit 0 once everything ran.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gitops_sless and tests/ (the git and serve helpers)

from syncbench.common import load_average, wait_until  # noqa: E402

from tests.gitserver import WorkRepo, init_bare  # noqa: E402
from tests.sless_server import TOKEN, SlessServer  # noqa: E402

HANDLER = "def main(event):\n    return {{'version': {version!r}}}\n"
WRITE = {"Authorization": f"Bearer {TOKEN}"}
API = "/api/v1/environments/prod/functions/{name}"


def function(name: str, version: str, rollout: bool) -> dict[str, str]:
    block = (
        "    rollout: {steps: [10], interval: 1h, minRequests: 1000000, maxErrorRate: 1}\n"
        if rollout
        else ""
    )
    return {
        f"{name}/handler.py": HANDLER.format(version=version),
        f"{name}/sless.yaml": (
            "functions:\n"
            f"  - name: {name}\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    scale: {min: 1, max: 2, idle: 1s}\n"
            "    triggers: [{type: http}]\n" + block
        ),
    }


def version(client: httpx.Client, path: str) -> str:
    response = client.get(f"/fn/prod/{path}/")
    return response.json()["version"] if response.status_code == 200 else str(response.status_code)


def replicas(client: httpx.Client, name: str, revision: str) -> int:
    listing = client.get(API.format(name=name) + "/revisions").json()
    return next(r["replicas"] for r in listing["revisions"] if r["revision"] == revision)


def rollback(client: httpx.Client, to: str) -> tuple[float, float, str]:
    """(API seconds, API answer to the next call's answer, the version that answered)."""
    sent = time.perf_counter()
    response = client.post(
        API.format(name="plain") + "/rollback", headers=WRITE, json={"to": to}, timeout=60
    )
    answered = time.perf_counter()
    if response.status_code != 200:
        raise RuntimeError(f"rollback to {to}: {response.status_code} {response.text}")
    seen = version(client, "plain")
    return answered - sent, time.perf_counter() - answered, seen


def wrk(url: str, duration: float) -> float:
    out = subprocess.run(
        ["wrk", "-t2", "-c16", f"-d{duration:g}s", url],
        capture_output=True,
        text=True,
        check=True,
        timeout=duration + 60,
    ).stdout
    found = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    if found is None:
        raise RuntimeError(f"cannot read wrk's output:\n{out}")
    return float(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--wrk-rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.duration, args.calls, args.wrk_rounds = 1, 1.0, 200, 1
    if shutil.which("wrk") is None:
        print("could not run: wrk is missing (bench/setup installs it)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="sless-revisions-bench-") as tmp:
        root = Path(tmp)
        bare = init_bare(root / "functions.git")
        work = WorkRepo(root / "work")
        work.commit("v1", {**function("plain", "v1", False), **function("canary", "v1", True)})
        work.push(str(bare))
        server = SlessServer(str(bare), root / "state", args=["--sandbox", "bubblewrap"])
        try:
            server.start()
            results = _measure(server, work, bare, args)
        except Exception as exc:
            print(f"could not run: {exc!r}", file=sys.stderr)
            return 1
        finally:
            server.stop()
    _print(results, args)
    return 0


def _measure(server: SlessServer, work: WorkRepo, bare: Path, args: argparse.Namespace) -> dict:
    client = server.client
    results: dict = {"warm": [], "zero": [], "wrong": 0}
    for name in ("plain", "canary"):
        wait_until(name, lambda n=name: version(client, n) == "v1", 60)
    base = f"{server.base}/fn/prod"
    # the split's cost, before: no split
    wrk(f"{base}/canary/", 1)  # warm-up
    before = _pairs(base, args)
    work.commit("v2", {**function("plain", "v2", False), **function("canary", "v2", True)})
    work.push(str(bare))
    server.sync()
    wait_until("plain v2", lambda: version(client, "plain") == "v2", 60)
    listing = client.get(API.format(name="canary") + "/revisions").json()
    if (listing["rollout"] or {}).get("phase") != "Progressing":
        raise RuntimeError(f"the canary's rollout did not start: {listing}")
    wrk(f"{base}/canary/", 1)
    during = _pairs(base, args)
    results["throughput"] = (before, during)
    seen = [version(client, "canary") for _ in range(args.calls)]
    results["share"] = (seen.count("v2"), len(seen), sorted(set(seen)))

    # rollbacks of plain: r1 is v1, r2 is v2 (serving now)
    targets = ["r1", "r2"]
    for round_ in range(args.rounds):
        for to in targets:
            want = "v1" if to == "r1" else "v2"
            assert version(client, f"plain@{to}") == want  # warm: it answered just now
            api, after, got = rollback(client, to)
            results["warm"].append((api, after))
            results["wrong"] += got != want
        # at zero: wait for r1 (kept, not serving after the last rollback) to idle out
        wait_until("r1 at zero", lambda: replicas(client, "plain", "r1") == 0, 60)
        started = time.perf_counter()
        cold_answer = client.get("/fn/prod/plain@r1/")  # the cold start, the baseline
        cold = time.perf_counter() - started
        assert cold_answer.json()["version"] == "v1"
        wait_until("r1 at zero again", lambda: replicas(client, "plain", "r1") == 0, 60)
        api, after, got = rollback(client, "r1")
        results["zero"].append((api, after, cold))
        results["wrong"] += got != "v1"
        api, after, got = rollback(client, "r2")  # back: r2 serves, r1 kept
        results["wrong"] += got != "v2"
        print(f"  round {round_ + 1} done", flush=True)
    return results


def _pairs(base: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(canary req/s, plain req/s), ``--wrk-rounds`` times, one after the other: the
    control measured beside each, so that what the machine does meanwhile cancels out."""
    return [
        (wrk(f"{base}/canary/", args.duration), wrk(f"{base}/plain/", args.duration))
        for _ in range(args.wrk_rounds)
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _print(results: dict, args: argparse.Namespace) -> None:
    warm, zero = results["warm"], results["zero"]
    print(f"\n## Rollback, {args.rounds} rounds (local backend, python3.11)\n")
    print("| rollback to | API call ms p50 / max | API answer to old code's answer ms p50 / max |")
    print("| --- | --- | --- |")
    w_api, w_after = [a for a, _ in warm], [b for _, b in warm]
    print(
        f"| a warm revision | {_ms(statistics.median(w_api))} / {_ms(max(w_api))} "
        f"| {_ms(statistics.median(w_after))} / {_ms(max(w_after))} |"
    )
    z_total = [a + b for a, b, _ in zero]
    z_cold = [c for _, _, c in zero]
    z_api = [a for a, _, _ in zero]
    print(
        f"| a revision at zero | {_ms(statistics.median(z_api))} / {_ms(max(z_api))} "
        f"| {_ms(statistics.median([b for _, b, _ in zero]))} / "
        f"{_ms(max(b for _, b, _ in zero))} |"
    )
    print(
        f"\nat zero: API request to the old code's answer p50 {_ms(statistics.median(z_total))}"
        f" ms; cold start of the same revision, same rounds, p50 "
        f"{_ms(statistics.median(z_cold))} ms (baseline)"
    )
    print(f"calls after a rollback's answer that got the other version: {results['wrong']}")
    before, during = results["throughput"]
    print(f"\n## The split's cost (wrk -t2 -c16, {args.wrk_rounds} rounds of each)\n")
    print("| | canary req/s | plain req/s (control) | canary / plain, median |")
    print("| --- | --- | --- | --- |")
    ratios = []
    for label, pairs in (("no split", before), ("10/90 split", during)):
        ratio = statistics.median(c / p for c, p in pairs)
        ratios.append(ratio)
        canary = " ".join(f"{c:.0f}" for c, _ in pairs)
        plain = " ".join(f"{p:.0f}" for _, p in pairs)
        print(f"| {label} | {canary} | {plain} | {ratio:.3f} |")
    split = ratios[1] / ratios[0]
    print(f"\nsplit / no split, each against its control: {split:.3f}")
    v2, calls, kinds = results["share"]
    share = 100 * v2 / calls
    print(f"\n## The share\n\n{v2} of {calls} calls to v2: {share:.1f} % (answers seen: {kinds})")
    print(f"loadavg after: {load_average()}")
    print("\n## Targets\n")
    targets = [
        (
            statistics.median(w_after) <= 0.050,
            "warm rollback, API answer to old code <= 50 ms",
            f"p50 {_ms(statistics.median(w_after))} ms",
        ),
        (
            statistics.median(z_total) <= statistics.median(z_cold) + 0.050,
            "rollback at zero <= cold start + 50 ms",
            f"{_ms(statistics.median(z_total))} vs {_ms(statistics.median(z_cold))} + 50 ms",
        ),
        (
            split >= 0.95,
            "10/90 split throughput >= 0.95 x no split, end to end (the candidate's replica "
            "runs beside; the proxy alone: bench/proxy.py --proxies fast,split)",
            f"{split:.3f}",
        ),
        (abs(share - 10) <= 2, "share at a 10 % step: 10 % +- 2", f"{share:.1f} %"),
    ]
    for ok, what, figure in targets:
        print(f"{'PASS' if ok else 'MISS'}  {what}  {figure}")


if __name__ == "__main__":
    sys.exit(main())
