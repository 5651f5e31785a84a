"""One fetch at a time in a child process the mirror can kill, so every fetch has a deadline.

libgit2's fetch is blocking C code. Its callbacks run while a pack streams in, so
a slow transfer can be stopped from one of them; but none runs while libgit2
connects or reads the server's ref list. Measured here: a server trickling its
ref list one byte a second kept a fetch with a 2 s deadline for as long as the
trickle lasted (12 s for 12 bytes), with no callback called. Only a process can be
stopped at any point, so ``FetchWorker`` runs fetches in a long-lived child
(this file, run as a script: it imports nothing but pygit2 and the standard
library, and starts in about 0.15 s) and kills it once the deadline has passed.
The next fetch starts a new child.

The protocol is one JSON request per line on the child's stdin and one JSON
answer per line on its stdout. Credentials travel through that pipe only.

An ``ssh://`` server's host key is checked against the request's known-hosts file
(``known_hosts.check``) from libgit2's certificate callback, during the handshake,
before any credential is offered or any ref read: the key checked is the key of the
connection the fetch uses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any
from urllib.parse import urlsplit

import pygit2
from pygit2.enums import CredentialType, FetchPrune, Option, RepositoryOpenFlag
from pygit2.remotes import TransferProgress


def _sibling(name: str) -> ModuleType:
    """A module of this package by its file: the child runs this file as a script (-P)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if __package__:
    from . import known_hosts
else:
    known_hosts = _sibling("known_hosts")

__all__ = ["Credentials", "FetchRequest", "FetchWorker", "WorkerFailed"]

# the child ends itself this long after its deadline when libgit2 holds it (an orphan
# included); the parent kills it a little later still, if even that did not happen
_CHILD_GRACE_SEC = 0.5
_PARENT_GRACE_SEC = 2.0
_EXIT_DEADLINE = 124  # as timeout(1) does
_STOP_SEC = 2.0


@dataclass(frozen=True)
class Credentials:
    """How to authenticate to the remote: user and password/token (HTTP), or an SSH key."""

    username: str | None = None
    password: str | None = None
    ssh_key: str | None = None
    ssh_pubkey: str | None = None
    passphrase: str | None = None

    def __repr__(self) -> str:
        hidden = {"password": self.password, "passphrase": self.passphrase}
        shown = ", ".join(
            [f"username={self.username!r}"]
            + [f"{name}={'***' if value else None}" for name, value in hidden.items()]
            + [f"ssh_key={self.ssh_key!r}", f"ssh_pubkey={self.ssh_pubkey!r}"]
        )
        return f"Credentials({shown})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Credentials | None:
        """Credentials from ``SLESS_GIT_*`` variables, or ``None`` when none is set."""
        env = os.environ if environ is None else environ
        values = {
            "username": env.get("SLESS_GIT_USERNAME") or None,
            "password": env.get("SLESS_GIT_PASSWORD") or None,
            "ssh_key": env.get("SLESS_GIT_SSH_KEY") or None,
            "ssh_pubkey": env.get("SLESS_GIT_SSH_PUBKEY") or None,
            "passphrase": env.get("SLESS_GIT_SSH_PASSPHRASE") or None,
        }
        return cls(**values) if any(values.values()) else None

    def secrets(self) -> list[str]:
        """The values that must never be shown (password, passphrase)."""
        return [s for s in (self.password, self.passphrase) if s]


@dataclass(frozen=True)
class FetchRequest:
    """One fetch: into the bare repository at ``path``, from ``url`` (no password in it)."""

    path: str
    url: str
    refspecs: list[str]
    message: str
    credentials: Credentials | None
    timeout_sec: float
    known_hosts: str | None = None  # the SSH host keys an ssh:// server may present


class _Deadline(Exception):
    """The fetch ran out of time (raised from a callback, or the child was stopped)."""


class _AuthFailed(Exception):
    """Raised from the credentials callback instead of letting libgit2 replay bad credentials."""


class WorkerFailed(Exception):
    """The fetch failed in the child (libgit2's message), or the child itself failed."""


_OFFERED = {
    CredentialType.SSH_KEY: " with the keys of the SSH agent",
    CredentialType.USERPASS_PLAINTEXT: " with the configured password",
}


def _ssh_port(url: str) -> int:
    # scp-like user@host:path has no port: OpenSSH's 22
    return (urlsplit(url).port or 22) if "://" in url else 22


def _is_ssh(url: str) -> bool:
    scheme, sep, _ = url.partition("://")
    if sep:
        return scheme.lower() in ("ssh", "ssh+git", "git+ssh")
    head, colon, _ = url.partition(":")  # git's rule: host:path when no slash comes first
    return bool(colon and "/" not in head)


class _Callbacks(pygit2.RemoteCallbacks):
    """Credentials for one fetch, the deadline checked each time libgit2 calls back, and
    the SSH host key checked against ``known_hosts`` (``None``: every SSH key is refused)."""

    def __init__(
        self,
        credentials: Credentials | None,
        deadline: float,
        known_hosts: str | None = None,
        url: str = "",
    ) -> None:
        super().__init__()
        self._creds = credentials
        self._deadline = deadline
        self._known_hosts = Path(known_hosts) if known_hosts else None
        self._port = _ssh_port(url)
        self._unchecked = _is_ssh(url)  # until check_host_key accepts the server's key
        self._offered: set[CredentialType] = set()

    def check_host_key(self, key: Any, host: str) -> None:
        """Raise ``HostKeyRefused`` unless the known-hosts file holds ``key`` for ``host``."""
        if key is None:
            raise known_hosts.HostKeyRefused(
                f"ssh host key of {host}: libgit2 {pygit2.LIBGIT2_VERSION} gave no key to check"
            )
        known_hosts.check(self._known_hosts, host, self._port, key)
        self._unchecked = False

    def _require_checked_host(self) -> None:
        # libgit2 checks the key before it authenticates or reads anything: a transport
        # that never asked (another SSH backend, a pygit2 that ignores our callback) is
        # refused here, before a credential or an object goes through it
        if self._unchecked:
            raise known_hosts.HostKeyRefused(
                f"ssh host key not checked: libgit2 {pygit2.LIBGIT2_VERSION} did not hand it over"
            )

    def _check_deadline(self) -> None:
        # libgit2 reports progress about twice a second while a pack streams in, so
        # this ends a trickling transfer cleanly, about half a second after the deadline
        if time.monotonic() > self._deadline:
            raise _Deadline

    def sideband_progress(self, string: str) -> None:
        self._check_deadline()

    def transfer_progress(self, stats: TransferProgress) -> None:
        self._require_checked_host()
        self._check_deadline()

    def credentials(
        self, url: str, username_from_url: str | None, allowed_types: CredentialType
    ) -> object:
        self._require_checked_host()
        self._check_deadline()
        creds = self._creds or Credentials()
        username = creds.username or username_from_url
        kind, cred = self._choose(creds, username, allowed_types)
        if kind in self._offered:
            # libgit2 asks again only when the server refused what we gave
            offered = _OFFERED.get(kind, "")
            if kind == CredentialType.SSH_KEY and creds.ssh_key:
                offered = f" with the SSH key {creds.ssh_key}"
            raise _AuthFailed(f"authentication failed for user {username!r}{offered}")
        self._offered.add(kind)
        return cred

    def _choose(
        self, creds: Credentials, username: str | None, allowed: CredentialType
    ) -> tuple[CredentialType, object]:
        if allowed & CredentialType.USERNAME:
            return CredentialType.USERNAME, pygit2.Username(username or "git")
        if allowed & CredentialType.SSH_KEY and creds.ssh_key:
            key = pygit2.Keypair(
                username or "git", creds.ssh_pubkey, creds.ssh_key, creds.passphrase or ""
            )
            return CredentialType.SSH_KEY, key
        if allowed & CredentialType.USERPASS_PLAINTEXT and creds.password is not None:
            return CredentialType.USERPASS_PLAINTEXT, pygit2.UserPass(
                username or "git", creds.password
            )
        if allowed & CredentialType.SSH_KEY:
            return CredentialType.SSH_KEY, pygit2.KeypairFromAgent(username or "git")
        raise _AuthFailed(
            "the server asks for credentials and none are configured"
            " (SLESS_GIT_USERNAME/SLESS_GIT_PASSWORD or SLESS_GIT_SSH_KEY)"
        )


# -- the child ------------------------------------------------------------------------------


def _host_key_reader() -> Any:
    """``git_cert_hostkey`` as libgit2 (1.2 and later) lays it out; pygit2 declares its
    first fields only. Loaded in the child, where the certificate callback runs."""
    import cffi  # pygit2's own dependency

    abi = cffi.FFI()
    abi.cdef(
        "typedef struct { int cert_type; int type; unsigned char hash_md5[16];"
        " unsigned char hash_sha1[20]; unsigned char hash_sha256[32]; int raw_type;"
        " const char *hostkey; size_t hostkey_len; } git_cert_hostkey_full;"
    )
    return abi


_CERT_SSH_RAW = 1 << 3  # GIT_CERT_SSH_RAW: the raw key is filled in


def _host_key(abi: Any, cert: Any) -> Any:
    """The server's key from libgit2's certificate, or ``None`` if it carries none."""
    full = abi.cast("git_cert_hostkey_full *", int(pygit2.ffi.cast("uintptr_t", cert)))
    if not full.type & _CERT_SSH_RAW or full.hostkey == abi.NULL:
        return None
    return known_hosts.HostKey(bytes(abi.buffer(full.hostkey, full.hostkey_len)))


def _check_host_keys() -> None:
    """Replace pygit2's certificate callback, in the child, with one that checks SSH keys.

    pygit2 (1.21) passes ``RemoteCallbacks.certificate_check`` no certificate (its
    docstring: "currently always None") and lets every SSH host key through unless
    that method refuses on the host name alone. libgit2 hands the callback the key
    itself, so this redefines pygit2's ``extern "Python"`` callback: TLS keeps
    libgit2's verdict, as pygit2 gives it; an SSH key goes to ``check_host_key`` of
    the fetch's callbacks, whose refusal pygit2 raises from ``fetch()``.
    """
    from pygit2.callbacks import libgit2_callback
    from pygit2.ffi import C, ffi

    abi = _host_key_reader()

    @libgit2_callback
    def _certificate_check_cb(cert: Any, valid: int, host: Any, data: Any) -> int:
        if cert.cert_type != C.GIT_CERT_HOSTKEY_LIBSSH2:
            return 0 if valid else C.GIT_ECERTIFICATE
        data.check_host_key(_host_key(abi, cert), ffi.string(host).decode())
        return 0


def _set_server_timeouts(timeout_sec: float) -> None:
    # process-wide libgit2 settings: the child's process holds one fetch at a time
    ms = max(1, int(timeout_sec * 1000))
    pygit2.option(Option.SET_SERVER_CONNECT_TIMEOUT, ms)
    pygit2.option(Option.SET_SERVER_TIMEOUT, ms)


def _fetch(request: FetchRequest) -> int:
    """Fetch as asked; the number of objects received."""
    deadline = time.monotonic() + request.timeout_sec
    _set_server_timeouts(request.timeout_sec)
    repo = pygit2.Repository(request.path, RepositoryOpenFlag.NO_SEARCH)
    remote = repo.remotes.create_anonymous(request.url)
    stats = remote.fetch(
        request.refspecs,
        message=request.message,
        callbacks=_Callbacks(request.credentials, deadline, request.known_hosts, request.url),
        prune=FetchPrune.PRUNE,  # PR refs deleted on the remote go; the branch is staged
    )
    return stats.received_objects


def _parse(line: str) -> FetchRequest:
    fields = json.loads(line)
    creds = fields.pop("credentials")
    return FetchRequest(**fields, credentials=Credentials(**creds) if creds else None)


def _answer(request: FetchRequest) -> dict[str, Any]:
    # a fetch libgit2 holds past every callback: the child ends itself, as an orphan would
    watchdog = threading.Timer(request.timeout_sec + _CHILD_GRACE_SEC, os._exit, (_EXIT_DEADLINE,))
    watchdog.daemon = True
    watchdog.start()
    try:
        return {"received": _fetch(request)}
    except _Deadline:
        return {"error": "deadline", "message": ""}
    except _AuthFailed as exc:
        return {"error": "auth", "message": str(exc)}
    except known_hosts.HostKeyRefused as exc:
        return {"error": "git", "message": str(exc)}
    except (pygit2.GitError, OSError, KeyError, ValueError) as exc:
        return {"error": "git", "message": str(exc) or type(exc).__name__}
    finally:
        watchdog.cancel()


def _serve(requests: IO[str], answers: IO[str]) -> None:
    for line in requests:  # ends when the parent closes the pipe, or exits
        answers.write(json.dumps(_answer(_parse(line))) + "\n")
        answers.flush()


# -- the parent -----------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Close the child's stdin (it ends by itself), or kill it if it does not."""
    with contextlib.suppress(OSError):
        assert proc.stdin is not None
        proc.stdin.close()
    try:
        proc.wait(_STOP_SEC)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


class FetchWorker:
    """The parent's side: runs each request in the child, which it starts when needed.

    ``fetch()`` returns the number of objects received, or raises ``_Deadline``,
    ``_AuthFailed`` or ``WorkerFailed``; after a deadline the child is gone and
    ``killed`` says so (it may have left lock files behind). One fetch at a time.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, FetchWorker] | None = None
        self._busy = False
        self.killed = False

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()
        # -P: the script's folder (this package) is not put on sys.path, where its
        # module names could shadow the standard library's
        proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._proc = proc
        self._finalizer = weakref.finalize(self, _stop, proc)
        return proc

    def fetch(self, request: FetchRequest) -> int:
        proc = self._start()
        self.killed = False
        line = json.dumps(asdict(request)) + "\n"  # credentials included: a dict or None
        try:
            assert proc.stdin is not None
            proc.stdin.write(line.encode())
        except OSError as exc:
            self.close()
            raise WorkerFailed(f"the fetch process is gone ({exc})") from None
        self._busy = True
        try:
            deadline = time.monotonic() + request.timeout_sec + _PARENT_GRACE_SEC
            answer = self._read_answer(proc, deadline)
        finally:
            self._busy = False
        if "received" in answer:
            return int(answer["received"])
        if answer["error"] == "deadline":
            raise _Deadline
        if answer["error"] == "auth":
            raise _AuthFailed(answer["message"])
        raise WorkerFailed(answer["message"])

    def _read_answer(self, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
        assert proc.stdout is not None
        fd, data = proc.stdout.fileno(), b""
        # poll, not select: a server with many functions may hold fds past FD_SETSIZE
        waiting = select.poll()
        waiting.register(fd, select.POLLIN)
        while not data.endswith(b"\n"):
            ready = waiting.poll(max(0, int((deadline - time.monotonic()) * 1000)))
            chunk = os.read(fd, 65536) if ready else None
            if chunk is None:
                self._kill()
                raise _Deadline
            if not chunk:
                return self._ended(proc)
            data += chunk
        return json.loads(data)

    def _ended(self, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        code = proc.wait()
        self.killed = True  # whatever it was writing is left half done
        self.close()
        if code == _EXIT_DEADLINE:
            raise _Deadline
        if code < 0:
            raise WorkerFailed(f"the fetch process was stopped (signal {-code})")
        raise WorkerFailed(f"the fetch process ended with exit code {code}")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self.killed = True
        self.close()

    def close(self) -> None:
        """Stop the child, if one runs (safe to call twice, from any thread)."""
        proc, finalizer, self._finalizer, self._proc = self._proc, self._finalizer, None, None
        if proc is not None and self._busy:
            proc.kill()  # a fetch under way is ended, not waited for
        if finalizer is not None:
            finalizer()


if __name__ == "__main__":
    _check_host_keys()
    _serve(sys.stdin, sys.stdout)
