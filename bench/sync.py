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
   Nothing else is in flight. Baseline: ``git push`` alone. Target: p50 <= 2 s.
2. **Push to serving, busy**: first a commit that starts a ``--slow-sec`` build of another
   function (its requirements.txt installs a local package whose build sleeps) and a
   ``--slow-sec`` job of a third (its handler sleeps; its ``runId`` is bumped); once the
   API shows them in flight, the same greeting push as in 1 is timed. Idle and busy
   pushes alternate, ``--pushes`` of each; the idle ones are the baseline. Target:
   busy p50 <= 1.5 x idle p50.
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
   (runtime processes are counted in /proc), in wall and CPU time (of the thread that
   runs the pass). Baseline:
   ``manifest.load`` of the same snapshot without a cache. Targets: <= 0.02 x that,
   <= 100 ms, 0 builds, 0 starts; and from the smallest to the largest N, CPU time that
   grows no faster than N (wall time moves with the load from elsewhere).
6. **One function changed**: a commit that changes one http function's code; the time from
   the start of the pass until the new code answers on its upstream (as the proxy routes
   it), minus the fetch and minus its build (``sless_build_duration_seconds``). Target:
   <= 300 ms after its build, 1 build, 1 process start.

``--profile DIR`` runs ``--passes`` more no-change passes under cProfile (in the thread
that runs them; the timed passes never are), writes the profile to DIR and prints its top
15 by cumulative time at the largest N. cProfile makes manifest parsing about five times
slower: the first pass is only timed around its calls. ``--smoke`` runs every scenario
at a tiny size in seconds (tests/test_bench.py runs it): the figures then mean nothing.

Targets are printed PASS/MISS, never asserted: exit 0 once everything ran, 1 when a
scenario could not run. Every process started is stopped on exit, SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gitops_sless and tests/ (the git and serve helpers)

from syncbench import scale, served  # noqa: E402
from syncbench.common import Report, load_average  # noqa: E402

SMOKE = {
    "pushes": 1,
    "slow_sec": 2.0,
    "heavy_sec": 1.0,
    "yaml_rounds": 1,
    "sizes": "12,40",
    "passes": 3,
    "http_every": 20,
}


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
            served.scenarios(tmp / "serve", args, report)
        if args.only in (None, "scale"):
            runs = [scale.scenario(tmp, n, args) for n in args.sizes]
            scale.figures(report, runs, args)
        print(f"\nload average after: {load_average()}")
    report.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
