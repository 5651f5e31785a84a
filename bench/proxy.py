"""Benchmark the /fn/ invoke proxy against nginx, in front of the same runtime server.

    python bench/proxy.py [--duration 10] [--connections 16,64] [--rounds 1]
                          [--proxies fast,asgi,asyncio,h11] [--json FILE]
                          [--baseline DIR] [--instructions N] [--smoke]

Starts, all on 127.0.0.1: the python3.11 runtime server with a trivial hello
handler; nginx (1 worker, keep-alive upstream pool, no access log) proxying to
it; and one uvicorn process per proxy variant, each with a RouteTable pointing
at the same runtime server:

    fast     proxy.config() as shipped: uvloop, httptools, /fn/ served from
             uvicorn's protocol callbacks (gitops_sless/proxy/fast.py)
    split    the same, with the route in a rollout: 10 % of its calls to a canary
             route (issue 29), whose upstream is the same runtime server, so that
             only the proxy's cost of the split differs from ``fast``
    traced   the same, exporting spans (issue 31: ``serve --otlp-endpoint``) to a
             sink process that answers every OTLP/HTTP post 200: one span per call,
             batched off the request path by the SDK (this checkout only, not
             ``--baseline``'s; the runtime's own spans are not part of it)
    asgi     uvloop + httptools, ProxyApp called as a plain ASGI app
    asyncio  the fast path on the standard asyncio loop (no uvloop)
    h11      ProxyApp as ASGI on asyncio + h11: neither uvloop nor httptools
    httpx    for reference, the first design: FastAPI + httpx.AsyncClient

With ``--baseline DIR`` (another checkout of this project, e.g. ``git
worktree add /tmp/before <commit>``), each proxy variant also runs from that
tree's code, as ``/fn/ fast (base)`` and so on, in the same rounds: a change
is measured against what it changes, under the same load from elsewhere.

Then wrk (``wrk -t2 -c{N} -d{D}s --latency``) against direct, nginx and each
proxy, and a table: requests/s, p50, p99, CPU per request of the proxy
process, the ratio to nginx and the p50 added over direct. Every process is
stopped at the end. Needs nginx and wrk: ``bench/setup`` installs them.

``--smoke`` runs that path in seconds (proxies fast, split, traced and asgi, 4
connections, 1 s each, no warm-up), for tests/test_bench.py: its figures mean nothing.

``--instructions N`` measures something else, and needs valgrind instead: the
machine instructions each proxy variant runs per request, counted by
``valgrind --tool=cachegrind`` while one client sends N/5, then N requests
one after the other on a keep-alive connection (the difference over 4N/5
leaves start-up out). It does not move with the load from elsewhere, so it
tells a 3 % change from noise where CPU time cannot; valgrind is about 50
times slower, hence the small N (2500 takes a minute per variant).
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_SERVER = ROOT / "runtimes" / "python3.11" / "server.py"
VARIANTS = ("fast", "split", "traced", "asgi", "asyncio", "h11", "httpx")
# the runtime answers only calls that carry its replica key, as every local replica does:
# the current proxy adds it itself (Route.proof) and drops the client's; for the other
# targets (direct, nginx, a base checkout from before the key) the client sends it
REPLICA_KEY = "bench-replica-key"
REPLICA_HEADER = f"x-sless-replica: {REPLICA_KEY}"
HELLO = 'def main(event):\n    return {"hello": "world"}\n'

NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream runtime {{
        server 127.0.0.1:{upstream};
        keepalive 128;
    }}
    # "nginx": the same job as the /fn/ proxy, with the headers it sets.
    server {{
        listen 127.0.0.1:{port} backlog=2048;
        location / {{
            proxy_pass http://runtime;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $http_host;
            proxy_set_header X-Forwarded-Prefix /fn/prod/hello;
            proxy_set_header X-Request-Id $request_id;
        }}
    }}
    # "nginx plain": a bare reverse proxy (the runtime then parses fewer headers).
    server {{
        listen 127.0.0.1:{plain_port} backlog=2048;
        location / {{
            proxy_pass http://runtime;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


@dataclass
class Result:
    target: str
    connections: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float | None  # CPU time of the proxy process per request


# --------------------------------------------------------------------------- the proxies


def serve(variant: str, port: int, upstream: int, root: Path = ROOT, otlp: str = "") -> None:
    """Run one proxy variant, with the code of the checkout ``root``, until terminated."""
    sys.path.insert(0, str(root))
    import uvicorn

    if variant == "traced":
        import atexit

        from gitops_sless import telemetry

        telemetry.configure(otlp, "bench")
        atexit.register(telemetry.shutdown)  # what is queued is encoded and sent: counted

    from gitops_sless.proxy import ProxyApp, config
    from gitops_sless.state.routes import Route, RouteTable

    routes = RouteTable()
    upstreams = (("127.0.0.1", upstream),)
    if "proof" in Route.__dataclass_fields__:
        route = Route("prod", "hello", 30.0, upstreams, proof=f"{REPLICA_HEADER}\r\n".encode())
    else:
        route = Route("prod", "hello", 30.0, upstreams)  # a checkout from before replica keys
    if variant == "split":
        from gitops_sless.state.routes import Canary

        routes.set(Route("prod", "hello@canary", 30.0, upstreams, proof=route.proof))
        route = Route(
            "prod", "hello", 30.0, upstreams, proof=route.proof, canary=Canary("hello@canary", 10)
        )
    routes.set(route)
    if variant == "httpx":
        app = _httpx_app(upstream)
        server_config = uvicorn.Config(
            app, "127.0.0.1", port, access_log=False, log_level="warning", backlog=2048
        )
    else:
        records: deque = deque(maxlen=10000)  # stands in for the buffer flushed to SQLite
        proxy = ProxyApp(routes, records.append)
        overrides = {
            "fast": {},
            "split": {},
            "traced": {},
            "asgi": {"http": "httptools"},
            "asyncio": {"loop": "asyncio"},
            "h11": {"loop": "asyncio", "http": "h11"},
        }[variant]
        server_config = config(proxy, "127.0.0.1", port, **overrides)
    uvicorn.Server(server_config).run()


def sink(port: int) -> None:
    """An OTLP/HTTP collector that takes every post and keeps nothing, until terminated."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Take(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a collector is

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Take).serve_forever()


def _httpx_app(upstream: int):
    """The design this proxy replaced: FastAPI + a shared httpx.AsyncClient, streaming."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    from starlette.background import BackgroundTask

    app = FastAPI()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{upstream}", timeout=30)
    hop = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host"}

    @app.api_route("/fn/{env}/{name}/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(request: Request, env: str, name: str, path: str):
        headers = {k: v for k, v in request.headers.items() if k not in hop}
        upstream_request = client.build_request(
            request.method, "/" + path, headers=headers, content=request.stream()
        )
        response = await client.send(upstream_request, stream=True)
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            headers={k: v for k, v in response.headers.items() if k not in hop},
            background=BackgroundTask(response.aclose),
        )

    return app


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(
    port: int, path: str, proc: subprocess.Popen, what: str, timeout: float = 15
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{_log_tail(proc)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: b\r\n{REPLICA_HEADER}\r\n"
                    "Connection: close\r\n\r\n".encode()
                )
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{what} did not answer 200 on :{port}{path}:\n{_log_tail(proc)}")


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(started):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _spawn(cmd: list, tmp: str, name: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` with its output in ``tmp/name.log`` (shown if it fails to start)."""
    path = Path(tmp, f"{name}.log")
    with open(path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log_path = path  # type: ignore[attr-defined]
    return proc


def _log_tail(proc: subprocess.Popen) -> str:
    with contextlib.suppress(OSError, AttributeError):
        return "\n".join(proc.log_path.read_text(errors="replace").splitlines()[-20:])
    return ""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _nginx_worker(master: int) -> int | None:
    for task in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == master:
                return int(task.name)
    return None


# --------------------------------------------------------------------------- wrk


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if match is None:
        raise ValueError(f"cannot read wrk's latency {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _field(pattern: str, out: str) -> str:
    match = re.search(pattern, out, re.MULTILINE)
    if match is None:
        raise SystemExit(f"cannot read wrk's output ({pattern!r}):\n{out}")
    return match.group(1)


def wrk(
    url: str, connections: int, duration: int, pid: int | None
) -> tuple[float, float, float, float | None]:
    """(requests/s, p50 ms, p99 ms, CPU µs per request of ``pid``)."""
    cpu_before = _cpu_seconds(pid) if pid else 0.0
    out = subprocess.run(
        [
            "wrk",
            "-t2",
            f"-c{connections}",
            f"-d{duration}s",
            "--latency",
            "-H",
            REPLICA_HEADER,
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu = _cpu_seconds(pid) - cpu_before if pid else None
    rps = float(_field(r"Requests/sec:\s+([\d.]+)", out))
    total = int(_field(r"(\d+) requests in", out))
    p50 = _ms(_field(r"^\s+50%\s+(\S+)", out))  # anchored: "Latency ... 75.50%" also ends so
    p99 = _ms(_field(r"^\s+99%\s+(\S+)", out))
    if re.search(r"Non-2xx or 3xx responses|Socket errors", out):
        print(f"  warning: errors against {url}:\n{out}", file=sys.stderr)
    return rps, p50, p99, (cpu * 1e6 / total if cpu is not None and total else None)


# --------------------------------------------------------------------------- main


def _check_tools() -> None:
    missing = [tool for tool in ("nginx", "wrk") if not _which(tool)]
    if missing:
        raise SystemExit(
            f"missing: {', '.join(missing)}. Install them with bench/setup "
            "(apt-get install -y nginx-light wrk; 'nginx' where nginx-light is not packaged)."
        )


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/local/sbin")


def _variants(args: argparse.Namespace) -> list[str]:
    variants = [v for v in args.proxies.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown proxy variant(s): {', '.join(sorted(unknown))}")
    return variants


def _roots(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(label suffix, checkout) of the code the proxies run: this one, and --baseline."""
    roots = [("", ROOT)]
    if args.baseline:
        roots.append((" (base)", Path(args.baseline).resolve()))
    return roots


def _start_sink(tmp: str, procs: list[subprocess.Popen]) -> str:
    """The span sink (see :func:`sink`); its URL."""
    port = _free_port()
    procs.append(_spawn([sys.executable, __file__, "--sink", str(port)], tmp, "sink"))
    return f"http://127.0.0.1:{port}"


def _start_runtime(tmp: str, procs: list[subprocess.Popen]) -> int:
    """The runtime server with the hello handler; its port."""
    fn_dir = Path(tmp, "fn")
    fn_dir.mkdir()
    (fn_dir / "hello.py").write_text(HELLO)
    upstream = _free_port()
    env = {
        **os.environ,
        "PORT": str(upstream),
        "SLESS_HOST": "127.0.0.1",
        "SLESS_ENTRYPOINT": "hello.main",
        "SLESS_FUNCTION_DIR": str(fn_dir),
        "SLESS_REPLICA_KEY": REPLICA_KEY,
    }
    runtime = _spawn([sys.executable, str(RUNTIME_SERVER)], tmp, "runtime", env=env)
    procs.append(runtime)
    _wait_http(upstream, "/health", runtime, "runtime server")
    return upstream


Runs = dict[tuple[str, int], list[Result]]  # (target, connections) -> one per round


def run(args: argparse.Namespace) -> Runs:
    _check_tools()
    connections = [int(c) for c in args.connections.split(",")]
    variants = _variants(args)
    results: dict[tuple[str, int], list[Result]] = {}
    with tempfile.TemporaryDirectory(prefix="sless-bench-") as tmp, processes() as procs:
        upstream = _start_runtime(tmp, procs)

        nginx_port, plain_port = _free_port(), _free_port()
        conf = NGINX_CONF.format(tmp=tmp, upstream=upstream, port=nginx_port, plain_port=plain_port)
        Path(tmp, "nginx.conf").write_text(conf)
        nginx_cmd = [
            _which("nginx"),
            "-p",
            tmp,
            "-c",
            f"{tmp}/nginx.conf",
            "-e",
            f"{tmp}/nginx.log",
        ]
        nginx = _spawn(nginx_cmd, tmp, "nginx")
        procs.append(nginx)
        _wait_http(nginx_port, "/", nginx, "nginx")
        worker = _nginx_worker(nginx.pid)

        targets: list[tuple[str, str, int | None]] = [
            ("direct", f"http://127.0.0.1:{upstream}/", None),
            ("nginx", f"http://127.0.0.1:{nginx_port}/", worker),
            ("nginx plain", f"http://127.0.0.1:{plain_port}/", worker),
        ]
        otlp = _start_sink(tmp, procs) if "traced" in variants else ""
        for variant in variants:
            for suffix, root in _roots(args):
                if variant == "traced" and suffix:
                    continue  # a span exporter is this checkout's own
                port = _free_port()
                serve_args = ["--serve", variant, "--port", str(port), "--upstream", str(upstream)]
                serve_args += ["--root", str(root), "--otlp", otlp]
                label = f"{variant}{suffix}"
                log_name = label.replace(" ", "").replace("(", "-").replace(")", "")
                proc = _spawn([sys.executable, __file__, *serve_args], tmp, log_name)
                procs.append(proc)
                _wait_http(port, "/fn/prod/hello/", proc, f"proxy {label}")
                url = f"http://127.0.0.1:{port}/fn/prod/hello/"
                targets.append((f"/fn/ {label}", url, proc.pid))

        for round_ in range(args.rounds):
            # Each round starts one target further on: no target always runs right after
            # the same other one (after nginx, the runtime holds its idle connections).
            turn = round_ % len(targets)
            for n in connections:
                # Interleaved, so a burst of load from elsewhere hits every target alike.
                for name, url, pid in targets[turn:] + targets[:turn]:
                    if not args.smoke:
                        wrk(url, n, 1, None)  # warm-up: open the connections, fill the pools
                    rps, p50, p99, cpu = wrk(url, n, args.duration, pid)
                    results.setdefault((name, n), []).append(Result(name, n, rps, p50, p99, cpu))
                    cpu_text = f"{cpu:.1f} µs/req" if cpu is not None else ""
                    line = f"{rps:>9.0f} req/s  p50 {p50:.2f} ms  {cpu_text}"
                    print(f"round {round_ + 1} c={n:<3} {name:<20} {line}", file=sys.stderr)
    return results


# --------------------------------------------------------------------------- instructions


def instructions(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(target, machine instructions per request) of each variant, counted by valgrind."""
    valgrind = _which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind: apt-get install -y valgrind")
    big = args.instructions
    small = big // 5
    results = []
    with tempfile.TemporaryDirectory(prefix="sless-bench-") as tmp, processes() as procs:
        upstream = _start_runtime(tmp, procs)
        otlp = _start_sink(tmp, procs) if "traced" in _variants(args) else ""
        for variant in _variants(args):
            for suffix, root in _roots(args):
                if variant == "traced" and suffix:
                    continue  # a span exporter is this checkout's own
                counts = [
                    _count(valgrind, variant, root, upstream, n, tmp, otlp) for n in (small, big)
                ]
                per_request = (counts[1] - counts[0]) / (big - small)
                target = f"/fn/ {variant}{suffix}"
                print(f"{target:<20} {per_request:>9.0f} instructions/req", file=sys.stderr)
                results.append((target, per_request))
    return results


def _count(
    valgrind: str, variant: str, root: Path, upstream: int, n: int, tmp: str, otlp: str
) -> int:
    """Instructions the proxy runs from start to exit when it serves ``n`` requests (its
    threads' too: a traced proxy's spans are encoded and sent before it exits)."""
    port = _free_port()
    out = Path(tmp, f"cachegrind-{port}.out")
    cmd = [valgrind, "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}"]
    cmd += [sys.executable, __file__, "--serve", variant, "--port", str(port)]
    cmd += ["--upstream", str(upstream), "--root", str(root), "--otlp", otlp]
    proc = _spawn(cmd, tmp, f"valgrind-{port}", env={**os.environ, "PYTHONHASHSEED": "0"})
    try:
        _wait_http(port, "/fn/prod/hello/", proc, f"proxy {variant} under valgrind", 180)
        _requests(port, 50)  # warm-up: the pools, the caches, whatever imports late
        _requests(port, n)
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn exits cleanly, valgrind writes its count
        proc.wait(180)
    summary = re.search(r"^summary: (\d+)", out.read_text(), re.MULTILINE)
    if summary is None:
        raise SystemExit(f"no instruction count from valgrind:\n{_log_tail(proc)}")
    return int(summary.group(1))


def _requests(port: int, n: int) -> None:
    """``n`` GETs, one after the other, on one keep-alive connection, as a client sends them."""
    request = (
        b"GET /fn/prod/hello/ HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"User-Agent: bench\r\nAccept: */*\r\n%s\r\n\r\n" % (port, REPLICA_HEADER.encode())
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        stream = sock.makefile("rb")
        for _ in range(n):
            sock.sendall(request)
            status = stream.readline()
            if not status.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"the proxy answered {status!r}")
            length = 0
            while (line := stream.readline()) != b"\r\n":
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            stream.read(length)


def instructions_table(results: list[tuple[str, float]]) -> str:
    by = dict(results)
    lines = ["| target | instructions/req | ÷ base |", "| --- | ---: | ---: |"]
    for target, count in results:
        base = by.get(f"{target} (base)")
        lines.append(
            f"| {target} | {count:.0f} | {count / base:.3f} |"
            if base
            else f"| {target} | {count:.0f} |  |"
        )
    return "\n".join(lines)


def _median(runs: list[Result]) -> Result:
    """The run with the median throughput (its latencies come with it)."""
    return sorted(runs, key=lambda r: r.rps)[len(runs) // 2]


def paired(runs: Runs) -> str:
    """Each variant against its (base) twin, round by round: the median of the ratios."""
    lines = [
        "| target | conns | CPU µs/req ÷ base | req/s ÷ base | ÷ nginx | ÷ nginx, base |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (target, n), ours in runs.items():
        base, nginx = runs.get((f"{target} (base)", n)), runs.get(("nginx", n))
        if not base or not nginx:
            continue
        rounds = list(zip(ours, base, nginx, strict=True))
        cpu = [a.cpu_us / b.cpu_us for a, b, _ in rounds if a.cpu_us and b.cpu_us]
        rps = statistics.median(a.rps / b.rps for a, b, _ in rounds)
        vs_nginx = statistics.median(a.rps / x.rps for a, _, x in rounds)
        base_vs_nginx = statistics.median(b.rps / x.rps for _, b, x in rounds)
        lines.append(
            f"| {target} | {n} | {statistics.median(cpu):.3f} | {rps:.3f} "
            f"| {vs_nginx:.2f} | {base_vs_nginx:.2f} |"
        )
    return "\n".join(lines)


def table(results: list[Result]) -> str:
    by = {(r.target, r.connections): r for r in results}
    lines = [
        "| target | conns | req/s | p50 ms | p99 ms | CPU µs/req | ÷ nginx | added p50 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        direct, nginx = by.get(("direct", r.connections)), by.get(("nginx", r.connections))
        ratio = f"{r.rps / nginx.rps:.2f}" if nginx and r.target != "direct" else ""
        added = f"{r.p50_ms - direct.p50_ms:+.2f}" if direct and r.target != "direct" else ""
        cpu = f"{r.cpu_us:.1f}" if r.cpu_us is not None else ""
        lines.append(
            f"| {r.target} | {r.connections} | {r.rps:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
            f"| {cpu} | {ratio} | {added} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--connections", default="16,64", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, report the median")
    parser.add_argument(
        "--proxies", default="fast,asgi,asyncio,h11", help=f"of {','.join(VARIANTS)}"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="another checkout of the project: its proxies run too, labelled (base)",
    )
    parser.add_argument(
        "--instructions",
        type=int,
        metavar="N",
        help="count instructions per request under valgrind (N requests) instead of wrk",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the whole path in seconds (figures mean nothing)"
    )
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--otlp", default="", help=argparse.SUPPRESS)
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.duration, args.connections, args.rounds = 1, "4", 1
        args.proxies = "fast,split,traced,asgi"
    if args.sink:
        sink(args.sink)
        return
    if args.serve:
        serve(args.serve, args.port, args.upstream, args.root, args.otlp)
        return
    if args.baseline and not any(
        Path(args.baseline, "gitops_sless", path).is_file()
        for path in ("proxy.py", "proxy/__init__.py")  # a module, later a package
    ):
        raise SystemExit(f"--baseline {args.baseline}: not a checkout of this project")
    if args.instructions:
        print(instructions_table(instructions(args)))
        return
    runs = run(args)
    medians = [_median(each) for each in runs.values()]
    results = sorted(medians, key=lambda r: (r.connections, r.target not in ("direct", "nginx")))
    print(table(results))
    if args.baseline:
        print("\nRound by round against --baseline (medians of the ratios):\n")
        print(paired(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
