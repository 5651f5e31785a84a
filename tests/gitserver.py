"""Real git servers on loopback and a scratch working repository, for end-to-end tests.

- ``GitDaemon``: ``git daemon`` serving every repository below a folder (``git://``).
- ``SmartHttpServer``: git smart HTTP through ``git http-backend``, with optional Basic
  auth and switches to answer 503 or to hang (``http://``).
- ``WorkRepo``: a non-bare repository to write files, commit and push with plain ``git``.

Fixtures ``git_root``, ``git_daemon``, ``git_http`` and ``work_repo``: bind them in a test
module (``git_daemon = gitserver.git_daemon``) or a conftest. Everything binds 127.0.0.1 on
a free port and is stopped at the end of the test.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Literal
from urllib.parse import unquote, urlsplit

import pytest

__all__ = [
    "GitDaemon",
    "SmartHttpServer",
    "WorkRepo",
    "free_port",
    "git",
    "git_daemon",
    "git_env",
    "git_http",
    "git_root",
    "init_bare",
    "work_repo",
]

AUTHOR = ("Test Author", "author@example.com")


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment where the user's and system's git config cannot change the outcome."""
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("GIT_")]:
        del env[key]
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_AUTHOR_NAME=AUTHOR[0],
        GIT_AUTHOR_EMAIL=AUTHOR[1],
        GIT_COMMITTER_NAME=AUTHOR[0],
        GIT_COMMITTER_EMAIL=AUTHOR[1],
    )
    env.update(extra or {})
    return env


def git(*args: str | os.PathLike[str], cwd: Path | None = None, timeout: float = 30) -> str:
    """Run ``git``; return stripped stdout, or raise with stderr in the message."""
    cmd = ["git", "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", *map(str, args)]
    proc = subprocess.run(
        cmd, cwd=cwd, env=git_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip()


def init_bare(path: Path, branch: str = "main") -> Path:
    """An empty bare repository at ``path`` whose HEAD names ``branch``."""
    git("init", "--quiet", "--bare", f"--initial-branch={branch}", path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, alive: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server on port {port} exited before accepting connections")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing accepted connections on 127.0.0.1:{port} within {timeout}s")


class WorkRepo:
    """A working repository driven with plain ``git`` (files, commits, pushes)."""

    def __init__(self, path: Path, branch: str = "main") -> None:
        self.path = path
        self.branch = branch
        path.mkdir(parents=True, exist_ok=True)
        if not (path / ".git").exists():
            git("init", "--quiet", f"--initial-branch={branch}", cwd=path)

    init_bare = staticmethod(init_bare)

    def git(self, *args: str | os.PathLike[str]) -> str:
        return git(*args, cwd=self.path)

    def write(self, files: Mapping[str, str | bytes | None]) -> WorkRepo:
        """Write files (relative path -> content); ``None`` deletes the file."""
        for rel, content in files.items():
            target = self.path / rel
            if content is None:
                target.unlink()
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content, encoding="utf-8")
        return self

    def commit(
        self, message: str = "change", files: Mapping[str, str | bytes | None] | None = None
    ) -> str:
        """Write ``files``, stage everything, commit (empty commits allowed); return the id."""
        self.write(files or {})
        self.git("add", "--all")
        self.git("commit", "--quiet", "--allow-empty", "-m", message)
        return self.head()

    def head(self) -> str:
        return self.git("rev-parse", "HEAD")

    def push(self, url: str, ref: str | None = None, *, force: bool = False) -> None:
        """Push HEAD to ``ref`` (default: the branch) at ``url``."""
        target = ref or f"refs/heads/{self.branch}"
        self.git("push", "--quiet", *(["--force"] if force else []), url, f"HEAD:{target}")

    def amend(self, message: str = "rewritten") -> str:
        """Rewrite the last commit (for force-push tests); return the new id."""
        self.git("commit", "--quiet", "--amend", "--allow-empty", "-m", message)
        return self.head()


class GitDaemon:
    """``git daemon`` exporting every repository below ``base`` on 127.0.0.1 (push allowed)."""

    def __init__(self, base: Path) -> None:
        self.base = base.resolve()
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, name: str) -> str:
        return f"git://127.0.0.1:{self.port}/{name}"

    def start(self) -> GitDaemon:
        self.base.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = [
            "git",
            "daemon",
            "--reuseaddr",
            "--export-all",
            "--enable=receive-pack",
            "--informative-errors",
            f"--base-path={self.base}",
            "--listen=127.0.0.1",
            f"--port={self.port}",
            str(self.base),
        ]
        # its own process group: the daemon forks a child per connection, stop() kills all
        self._proc = subprocess.Popen(
            cmd,
            env=git_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_for_port(self.port, lambda: self._proc is not None and self._proc.poll() is None)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        stop_group(proc)

    def __enter__(self) -> GitDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


Mode = Literal["ok", "unavailable", "hang", "slow", "trickle"]


class SmartHttpServer:
    """Git smart HTTP for every repository below ``root``, via ``git http-backend``.

    ``username``/``password`` turn on Basic auth. Set ``mode`` at any time:
    ``"unavailable"`` answers 503, ``"hang"`` reads the request and never answers
    (until ``stop()``), ``"slow"`` answers POSTs (the pack) ``slow_bytes`` at a time every
    ``slow_delay`` seconds: each read is quick, the whole transfer is not; ``"trickle"``
    answers GETs (the ref list) that way instead.
    ``requests`` records ``(method, path, user)`` of each request.
    """

    def __init__(
        self,
        root: Path,
        username: str | None = None,
        password: str | None = None,
        *,
        allow_push: bool = True,
    ) -> None:
        self.root = root.resolve()
        self.username = username
        self.password = password
        self.allow_push = allow_push
        self.mode: Mode = "ok"
        self.slow_delay = 0.1
        self.slow_bytes = 64
        self.requests: list[tuple[str, str, str | None]] = []
        self._release = threading.Event()
        self._server: _QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.server_address[1]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> SmartHttpServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self._release.clear()
        handler = type("Handler", (_GitHttpHandler,), {"git_server": self})
        self._server = _QuietHTTPServer(("127.0.0.1", 0), handler)
        # a short poll interval: stop() waits up to one interval
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="git-http", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._release.set()  # lets hanging handlers return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> SmartHttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def authorized_user(self, header: str | None) -> str | None:
        """The user named by a valid ``Authorization`` header, else ``None``."""
        if not header or not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return None
        return user if (user, password) == (self.username, self.password) else None


class _QuietHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # clients that give up (timeouts under test) reset connections; that is expected
        pass


class _GitHttpHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    git_server: SmartHttpServer

    def log_message(self, format: str, *args: object) -> None:
        pass  # keeps test output clean; requests are recorded in git_server.requests

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        server = self.git_server
        user = None
        if server.username is not None:
            user = server.authorized_user(self.headers.get("Authorization"))
        server.requests.append((self.command, self.path, user))
        if server.mode == "hang":
            self._read_body()  # the client is now waiting for an answer that never comes
            server._release.wait()
            self.close_connection = True
            return
        if server.mode == "unavailable":
            self._read_body()
            self.send_response(HTTPStatus.SERVICE_UNAVAILABLE)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if server.username is not None and user is None:
            self._read_body()
            self.send_response(HTTPStatus.UNAUTHORIZED)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._run_backend(user)

    def _read_body(self) -> None:
        """Consume the request body so the client is not stuck sending it."""
        for _ in self._body_chunks():
            pass

    def _body_chunks(self) -> Iterator[bytes]:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 65536))
            if not chunk:
                return
            remaining -= len(chunk)
            yield chunk

    def _backend_env(self, user: str | None) -> dict[str, str]:
        server = self.git_server
        url = urlsplit(self.path)
        extra = {
            "GIT_PROJECT_ROOT": str(server.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": unquote(url.path),
            "QUERY_STRING": url.query,
            "REQUEST_METHOD": self.command,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "REMOTE_ADDR": self.client_address[0],
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PROTOCOL": "HTTP/1.1",
        }
        if user is not None:
            extra["REMOTE_USER"] = user
        if server.allow_push:
            # http-backend refuses pushes from anonymous users unless http.receivepack is on
            extra.update(
                GIT_CONFIG_COUNT="1",
                GIT_CONFIG_KEY_0="http.receivepack",
                GIT_CONFIG_VALUE_0="true",
            )
        if self.headers.get("Content-Encoding"):  # git gzips large requests
            extra["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):  # protocol v2
            extra["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        return git_env(extra)

    def _run_backend(self, user: str | None) -> None:
        proc = subprocess.Popen(
            ["git", "http-backend"],
            env=self._backend_env(user),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdin is not None and proc.stdout is not None
        # a writer thread: the backend may answer before it has read the whole body
        feeder = threading.Thread(target=_feed, args=(proc.stdin, self._body_chunks()))
        feeder.start()
        try:
            status, headers = _cgi_headers(proc.stdout)
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            # libgit2 does not read close-delimited bodies: stream the output in chunks
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in self._output_chunks(proc.stdout):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        finally:
            feeder.join()
            proc.stdout.close()
            proc.wait()

    def _output_chunks(self, stdout: IO[bytes]) -> Iterator[bytes]:
        server = self.git_server
        if self.command != {"slow": "POST", "trickle": "GET"}.get(server.mode):
            # read1: whatever is ready now, so progress reaches the client as it happens
            while chunk := stdout.read1(65536):  # type: ignore[attr-defined]
                yield chunk
            return
        while chunk := stdout.read(server.slow_bytes):
            yield chunk
            if server._release.wait(server.slow_delay):
                return


def _feed(stdin: IO[bytes], chunks: Iterator[bytes]) -> None:
    try:
        for chunk in chunks:
            stdin.write(chunk)
    except OSError:
        # the backend stopped reading (an error reply): still consume the body, or its
        # rest would be read as the next request on this keep-alive connection
        for _ in chunks:
            pass
    finally:
        with contextlib.suppress(OSError):
            stdin.close()


def _cgi_headers(stdout: IO[bytes]) -> tuple[int, list[tuple[str, str]]]:
    status = 200
    headers = []
    for raw in iter(stdout.readline, b""):
        line = raw.decode("latin-1").rstrip("\r\n")
        if not line:
            break
        name, _, value = line.partition(":")
        if name.lower() == "status":
            status = int(value.split()[0])
        else:
            headers.append((name, value.strip()))
    return status, headers


@pytest.fixture
def git_root(tmp_path: Path) -> Path:
    """The folder whose bare repositories the servers export."""
    root = tmp_path / "served"
    root.mkdir()
    return root


@pytest.fixture
def git_daemon(git_root: Path) -> Iterator[GitDaemon]:
    with GitDaemon(git_root) as daemon:
        yield daemon


@pytest.fixture
def git_http(git_root: Path) -> Iterator[SmartHttpServer]:
    with SmartHttpServer(git_root) as server:
        yield server


@pytest.fixture
def work_repo(tmp_path: Path) -> WorkRepo:
    return WorkRepo(tmp_path / "work")


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM a server's process group, SIGKILL it if it is still there 5 s later."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
