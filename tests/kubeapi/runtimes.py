"""Real runtime servers for the pods of chosen Deployments, and the pod proxy that reaches them.

Pods of the fake cluster do not run, except those of a Deployment named with
``FakeKube.run_runtime(namespace, deployment, folder)``: each of its pods that
the kubelet starts runs ``runtimes/<runtime>/server.py`` as a process on
127.0.0.1 (a port of its own), with the container's environment and the
function's code from ``folder``; it is stopped when the pod goes. The API
server's pod proxy (``pods/{name}:{port}/proxy/...``) forwards to that
process, and answers 503 for a pod that runs none, as a real one does when
nothing listens.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_SEC = 20.0

Obj = dict[str, Any]


class PodRuntimes:
    """The runtime processes of the pods of registered Deployments, by pod uid."""

    def __init__(self) -> None:
        self._folders: dict[tuple[str, str], tuple[Path, str]] = {}
        self._running: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        self._logs: dict[str, Path] = {}  # pod uid -> what its process printed
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # one start at a time: a pod gets one process

    def serve(self, namespace: str, deployment: str, folder: Path, runtime: str) -> None:
        with self._lock:
            self._folders[(namespace, deployment)] = (Path(folder), runtime)

    def start(self, pod: Obj, deployment: str, env: dict[str, str]) -> None:
        """The pod's process, started once (it is serving when this returns)."""
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._starting:
            with self._lock:
                found = self._folders.get((meta["namespace"], deployment))
                if found is None or uid in self._running:
                    return
            folder, runtime = found
            log = Path(tempfile.mkstemp(prefix="sless-pod-", suffix=".log")[1])
            process, port = _spawn(folder, runtime, env, log)
            with self._lock:
                self._running[uid] = (process, port)
                self._logs[uid] = log

    def log(self, uid: str) -> str | None:
        """What the pod's process printed (stdout and stderr), if it runs one."""
        with self._lock:
            path = self._logs.get(uid)
        return None if path is None else path.read_text("utf-8", "replace")

    def port(self, uid: str) -> int | None:
        with self._lock:
            running = self._running.get(uid)
        return running[1] if running is not None and running[0].poll() is None else None

    def stop(self, uid: str) -> None:
        with self._lock:
            running = self._running.pop(uid, None)
            log = self._logs.pop(uid, None)
        if running is not None:
            _end(running[0])
        if log is not None:
            log.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            running, self._running = list(self._running.values()), {}
        logs, self._logs = list(self._logs.values()), {}
        for process, _ in running:
            _end(process)
        for log in logs:
            log.unlink(missing_ok=True)


def _spawn(
    folder: Path, runtime: str, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    read_fd, write_fd = os.pipe()
    environment = {
        **env,
        "PATH": os.environ.get("PATH", ""),
        "PORT": "0",
        "SLESS_HOST": "127.0.0.1",
        "SLESS_FUNCTION_DIR": str(folder),
        "SLESS_READY_FD": str(write_fd),
        "PYTHONUNBUFFERED": "1",  # as the runtime's image sets it (runtimes/*/Dockerfile)
    }
    server = ROOT / "runtimes" / runtime / "server.py"
    try:
        with log.open("ab") as out:  # the container's log: stdout and stderr, as a kubelet's
            process = subprocess.Popen(
                [sys.executable, str(server)],
                env=environment,
                pass_fds=(write_fd,),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        line = ready.readline()  # EOF: it could not start (its error is on stderr)
    if not line:
        _end(process)
        raise RuntimeError(f"the {runtime} runtime did not start for {folder}")
    return process, int(json.loads(line)["port"])


def _end(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def forward(
    port: int, method: str, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, bytes, str]:
    """One request to a pod's process: (status, body, content type)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        ctype = response.getheader("Content-Type") or "application/octet-stream"
        return response.status, response.read(), ctype
    finally:
        connection.close()
