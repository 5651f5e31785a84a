"""A real ``gitops-sless serve`` process for end-to-end tests, driven over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .gitserver import GitDaemon, WorkRepo, free_port, init_bare

TOKEN = "test-api-token"
READ_TOKEN = "test-read-token"
WEBHOOK_SECRET = "test-webhook-secret"


class ReadAuth(httpx.Auth):
    """The read token on every read that carries no Authorization of its own.

    A test reads the way a dashboard or a CI check would; a write, or a call through
    ``/fn/`` (a function must never see the server's token), gets only what the test gives.
    """

    def __init__(self, token: str | Callable[[], str | None] | None) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Any:
        path = request.url.path
        reads = request.method in ("GET", "HEAD") or path.endswith("/diff")
        token = self.token() if callable(self.token) else self.token
        if token and reads and not path.startswith("/fn/"):
            request.headers.setdefault("Authorization", f"Bearer {token}")
        yield request


class SlessServer:
    def __init__(
        self,
        repo: str,
        state_dir: Path,
        *,
        secrets_dir: Path | None = None,
        poll_interval: float = 3600,
        fetch_timeout: float = 10,
        env: dict[str, str] | None = None,
        token: str | None = TOKEN,
        read_token: str | None = None,
        args: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        """``read_token``: default READ_TOKEN when the server has an API token, else none;
        "" for none. With no token at all, the server generates its API token in
        ``state_dir/api-token``: :meth:`api_token` reads it, and the client sends it.
        ``port``: where it listens (default: a free one)."""
        self.repo = repo
        self.state_dir = state_dir
        self.secrets_dir = secrets_dir
        self.poll_interval = poll_interval
        self.fetch_timeout = fetch_timeout
        self.extra_env = env or {}
        self.token = token
        self.read_token = (READ_TOKEN if token else None) if read_token is None else read_token
        self.extra_args = list(args or [])
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = state_dir.parent / f"serve-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(
            base_url=self.base,
            timeout=30,
            auth=ReadAuth(lambda: self.read_token or self.api_token()),
        )

    def api_token(self) -> str | None:
        """The API token: the one given, else the one the server generated (if it did)."""
        if self.token:
            return self.token
        path = self.state_dir / "api-token"
        return path.read_text().strip() if path.exists() else None

    def command(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "gitops_sless",
            "serve",
            "--repo",
            self.repo,
            "--state-dir",
            str(self.state_dir),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--poll-interval",
            str(self.poll_interval),
            "--fetch-timeout",
            str(self.fetch_timeout),
            "--webhook-secret",
            WEBHOOK_SECRET,
        ]
        if self.token:
            args += ["--api-token", self.token]
        if self.read_token:
            args += ["--read-token", self.read_token]
        if self.secrets_dir:
            args += ["--secrets-dir", str(self.secrets_dir)]
        if "--sandbox" not in self.extra_args and "SLESS_SANDBOX" not in self.extra_env:
            # never "auto": where bubblewrap cannot start, the test fails instead of quietly
            # running its functions unconfined
            args += ["--sandbox", "bubblewrap"]
        return args + self.extra_args

    def start(self, wait_for_sync: bool = True) -> SlessServer:
        env = {**os.environ, **self.extra_env}
        env.pop("SLESS_API_TOKEN", None)
        env.pop("SLESS_READ_TOKEN", None)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited {self.process.returncode}:\n{self.output()}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            raise AssertionError(f"serve never answered /healthz:\n{self.output()}")
        if wait_for_sync:
            # /readyz: a pass of this process ran (the history may hold an earlier one's)
            self.wait(lambda: self.client.get("/readyz").status_code == 200, "a first pass")
            self.wait(lambda: self.syncs(), "a first sync")
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.client.close()

    def kill(self) -> None:
        """SIGKILL: the reconciler gets no chance to clean up (its children are orphaned)."""
        assert self.process
        self.process.kill()
        self.process.wait()

    # --- the API --------------------------------------------------------------------

    def sync(self, timeout: float = 90) -> dict[str, Any]:
        response = self.client.post(
            "/api/v1/sync",
            params={"wait": timeout},
            headers={"Authorization": f"Bearer {self.api_token()}"},
            timeout=timeout + 10,
        )
        assert response.status_code == 202, response.text
        body = response.json()
        assert body["finished"], f"sync did not finish in {timeout}s:\n{self.output()}"
        return body["lastSync"]

    def syncs(self) -> list[dict[str, Any]]:
        return [s for s in self.client.get("/api/v1/syncs").json() if s["finished"]]

    def function(self, name: str, env: str = "prod") -> dict[str, Any] | None:
        response = self.client.get(f"/api/v1/environments/{env}/functions/{name}")
        return response.json() if response.status_code == 200 else None

    def jobs(self, env: str = "prod") -> list[dict[str, Any]]:
        return self.client.get(f"/api/v1/environments/{env}/jobs").json()

    def call(
        self, name: str, path: str = "/", method: str = "GET", **kwargs: Any
    ) -> httpx.Response:
        return self.client.request(method, f"/fn/prod/{name}{path}", **kwargs)

    def wait(self, predicate: Any, what: str, timeout: float = 90) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-4000:]}")


class ServedRepo:
    """A bare repository served by a git daemon, a work tree to push from, and the
    ``serve`` processes started on it (one state folder); closing stops them all and
    kills whatever a failed test left running below the state folder."""

    def __init__(self, tmp_path: Path, daemon: GitDaemon, git_root: Path) -> None:
        init_bare(git_root / "functions.git")
        self.url = daemon.url("functions.git")
        self.work = WorkRepo(tmp_path / "work")
        self.state = tmp_path / "state"
        self.servers: list[SlessServer] = []

    def push(self, files: dict[str, str | None]) -> None:
        self.work.commit("change", files)
        self.work.push(self.url)

    def server(self, args: list[str] | None = None) -> SlessServer:
        server = SlessServer(self.url, self.state, args=args)
        self.servers.append(server)
        return server

    def close(self) -> None:
        from .conftest import processes_under

        for server in self.servers:
            server.stop()
        for pid in processes_under(self.state):
            os.kill(pid, signal.SIGKILL)
