"""Benchmark the python3.11 and nodejs20 runtimes against their baselines with wrk.

    .venv/bin/pip install -r bench/requirements.txt
    .venv/bin/python bench/runtimes.py [--duration 10] [--connections 16] [--smoke]

Four servers answer the same trivial handler (``{"message": "hello"}`` as JSON) on
127.0.0.1, one at a time; each gets a 2 s wrk warm-up, then ``--duration`` seconds measured:

- python3.11 runtime vs OpenFaaS python3-http (Flask + waitress, 8 threads): target >= 2.5x
- nodejs20 runtime vs a bare ``http.createServer`` hello: target >= 0.8x

Then the replica start time of the local backend (``Supervisor.apply`` of one python3.11
replica: spawn to its first ``/health`` 200), median of ``--starts`` starts, unconfined and
in the bubblewrap sandbox, with the difference: target <= 30 ms more.

``--smoke`` runs the whole path in seconds (1 s per server, no warm-up, 4 connections), for
tests/test_bench.py: its figures mean nothing.

The result is a report: exit 0 whether the targets pass or not, 1 on errors, 2 when
Flask or waitress is missing. Every server started is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
WARMUP_SEC = 2
PY_TARGET = 2.5
NODE_TARGET = 0.8
SANDBOX_TARGET_MS = 30.0

HANDLER_PY = 'def handle(event):\n    return {"message": "hello"}\n'
HANDLER_JS = "exports.handle = (event) => ({ message: 'hello' });\n"
# The shape of OpenFaaS's python3-http template (index.py): Flask parses the request into
# an Event, calls handler.handle, jsonifies the result; waitress serves the app.
FLASK_APP = """\
import os
from flask import Flask, jsonify, request
from waitress import serve
import handler

app = Flask(__name__)
METHODS = ["GET", "PUT", "POST", "PATCH", "DELETE"]

class Event:
    def __init__(self):
        self.body = request.get_data()
        self.headers = request.headers
        self.method = request.method
        self.query = request.args
        self.path = request.path

@app.route("/", defaults={"path": ""}, methods=METHODS)
@app.route("/<path:path>", methods=METHODS)
def call_handler(path):
    return jsonify(handler.handle(Event()))

serve(app, host=os.environ["SLESS_HOST"], port=int(os.environ["PORT"]), threads=8)
"""
BARE_NODE = """\
require('http').createServer((req, res) => {
  res.writeHead(200, { 'content-type': 'application/json' });
  res.end('{"message":"hello"}');
}).listen(Number(process.env.PORT), process.env.SLESS_HOST);
"""


class BenchError(Exception):
    pass


@dataclass
class Result:
    name: str
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start(argv: list[str], workdir: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = dict(os.environ, PORT=str(port), SLESS_HOST=HOST, PYTHONDONTWRITEBYTECODE="1")
    env.update(SLESS_ENTRYPOINT="handler.handle", SLESS_FUNCTION_DIR=str(workdir))
    with log.open("wb") as out:  # new session: Ctrl-C reaches us only, and we stop it
        proc = subprocess.Popen(
            argv, cwd=workdir, env=env, stdout=out, stderr=out, start_new_session=True
        )
    return proc, port


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_ready(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Wait for GET /health, then check that GET / answers the hello JSON."""
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            raise BenchError(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"no 200 from /health within 15 s:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    with urllib.request.urlopen(f"http://{HOST}:{port}/", timeout=5) as resp:
        body, ctype = json.loads(resp.read()), resp.headers.get("content-type", "")
    if body != {"message": "hello"} or not ctype.startswith("application/json"):
        raise BenchError(f"unexpected answer from GET /: {ctype} {body!r}")


def to_ms(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}[unit]


def parse_wrk(name: str, out: str) -> Result:
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    lat = dict(re.findall(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+(?:us|ms|s|m|h))\s*$", out, re.M))
    if rps is None or set(lat) != {"50", "99"}:
        raise BenchError(f"cannot parse wrk output for {name}:\n{out}")
    p50, p99 = (re.fullmatch(r"([\d.]+)(\w+)", lat[k]) for k in ("50", "99"))
    assert p50 is not None and p99 is not None
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors += int(non2xx.group(1)) if non2xx else 0
    return Result(name, float(rps.group(1)), to_ms(*p50.groups()), to_ms(*p99.groups()), errors)


def wrk(port: int, seconds: int, connections: int) -> str:
    threads = min(2, connections)
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency"]
    done = subprocess.run(
        [*argv, f"http://{HOST}:{port}/"], capture_output=True, text=True, timeout=seconds + 30
    )
    if done.returncode != 0:
        raise BenchError(f"wrk failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def bench(name: str, argv: list[str], workdir: Path, args: argparse.Namespace) -> Result:
    log = workdir / (re.sub(r"\W+", "_", name) + ".log")
    proc, port = start(argv, workdir, log)
    try:
        check_ready(proc, port, log)
        print(f"  {name}: warm-up {args.warmup} s, then {args.duration} s ...", file=sys.stderr)
        if args.warmup:
            wrk(port, args.warmup, args.connections)
        result = parse_wrk(name, wrk(port, args.duration, args.connections))
        if proc.poll() is not None:
            raise BenchError(f"{name} exited during the run:\n{log.read_text()[-2000:]}")
        return result
    finally:
        stop(proc)


def verdict(label: str, ours: Result, base: Result, target: float) -> str:
    ratio = ours.rps / base.rps if base.rps else 0.0
    mark = "PASS" if ratio >= target else "FAIL"
    return f"{label:<36} {ratio:5.2f}x  (target >= {target}x)  {mark}"


def replica_starts(starts: int, sandbox: object, workdir: Path) -> list[float]:
    """Milliseconds from spawn to healthy of ``starts`` replicas started one after another."""
    sys.path.insert(0, str(ROOT))
    from gitops_sless.local.processes import Supervisor
    from gitops_sless.local.units import ProcessSpec
    from gitops_sless.manifests import runtimes

    supervisor = Supervisor(workdir / "state", lambda *_: None, sandbox=sandbox)  # type: ignore[arg-type]
    spec = ProcessSpec(
        "bench", "hello", runtimes.get("python3.11"), "handler.handle", workdir, 30, {}
    )
    took = []
    try:
        for n in range(starts):
            began = time.perf_counter()
            supervisor.apply(spec, f"start-{n}", 1)  # returns once /health answered 200
            took.append((time.perf_counter() - began) * 1000)
    finally:
        supervisor.close()
    return took


def start_times(starts: int) -> None:
    sys.path.insert(0, str(ROOT))
    from gitops_sless.local import sandbox

    bwrap = shutil.which("bwrap")
    why = sandbox.probe(bwrap, ["python3"])
    kinds = [("unconfined", sandbox.Sandbox("off"))]
    if why is None and bwrap:
        kinds.append(("bubblewrap", sandbox.Sandbox("bubblewrap", bwrap)))
    medians = {}
    # both start the same interpreter, the system's, which is all a sandbox sees: the
    # figure is the sandbox's cost, not a shim's (pyenv's python3 is a shell script)
    os.environ["PATH"] = f"{sandbox.SANDBOX_PATH}:{os.environ.get('PATH', '')}"
    print(f"\nreplica start, spawn to first /health 200 (median of {starts}):")
    for name, box in kinds:
        with tempfile.TemporaryDirectory(prefix="sless-start-bench-") as tmp:
            workdir = Path(tmp)
            (workdir / "handler.py").write_text(HANDLER_PY)
            took = sorted(replica_starts(starts, box, workdir))
        medians[name] = took[len(took) // 2]
        print(f"  {name:<12} {medians[name]:8.1f} ms  (min {took[0]:.1f}, max {took[-1]:.1f})")
    if "bubblewrap" not in medians:
        print(f"  bubblewrap: cannot run here ({why})")
        return
    more = medians["bubblewrap"] - medians["unconfined"]
    ratio = medians["bubblewrap"] / medians["unconfined"]
    ok = "PASS" if more <= SANDBOX_TARGET_MS else "FAIL"
    target = f"target <= {SANDBOX_TARGET_MS:g} ms {ok}"
    print(f"sandbox costs {more:+.1f} ms a start ({ratio:.2f}x): {target}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per target (10)")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections (16)")
    parser.add_argument("--starts", type=int, default=15, help="replica starts per kind (15)")
    parser.add_argument("--smoke", action="store_true", help="the whole path in seconds")
    args = parser.parse_args()
    args.warmup = WARMUP_SEC
    if args.smoke:
        args.duration, args.connections, args.warmup, args.starts = 1, 4, 0, 2
    if args.duration < 1 or args.connections < 1:
        parser.error("--duration and --connections must be at least 1")
    try:
        for module in ("flask", "waitress"):
            importlib.import_module(module)
    except ImportError as exc:
        print(f"{exc}: run  pip install -r bench/requirements.txt", file=sys.stderr)
        return 2
    for tool in ("wrk", "node"):
        if shutil.which(tool) is None:
            print(f"error: {tool} is not on PATH (apt-get install -y {tool})", file=sys.stderr)
            return 1
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the finally blocks stop the servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))

    py, rt = sys.executable, ROOT / "runtimes"
    print(f"loadavg before: {loadavg()}  ({os.cpu_count()} CPUs)")
    print(f"wrk -t{min(2, args.connections)} -c{args.connections} -d{args.duration}s --latency")
    try:
        with tempfile.TemporaryDirectory(prefix="sless-runtimes-bench-") as tmp:
            workdir = Path(tmp)
            (workdir / "handler.py").write_text(HANDLER_PY)
            (workdir / "handler.js").write_text(HANDLER_JS)
            (workdir / "flask_app.py").write_text(FLASK_APP)
            (workdir / "bare.js").write_text(BARE_NODE)
            targets = [
                ("python3.11 runtime", [py, str(rt / "python3.11" / "server.py")]),
                ("flask+waitress (8 threads)", [py, "flask_app.py"]),
                ("nodejs20 runtime", ["node", str(rt / "nodejs20" / "server.js")]),
                ("bare node http", ["node", "bare.js"]),
            ]
            results = [bench(name, argv, workdir, args) for name, argv in targets]
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130

    print(f"\n{'target':<28} {'requests/s':>11} {'p50':>9} {'p99':>9} {'errors':>7}")
    for r in results:
        p50, p99 = f"{r.p50_ms:.2f}ms", f"{r.p99_ms:.2f}ms"
        print(f"{r.name:<28} {r.rps:>11.1f} {p50:>9} {p99:>9} {r.errors:>7}")
    print()
    print(verdict("python3.11 runtime / flask+waitress", results[0], results[1], PY_TARGET))
    print(verdict("nodejs20 runtime / bare node http", results[2], results[3], NODE_TARGET))
    start_times(args.starts)
    print(f"\nloadavg after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
