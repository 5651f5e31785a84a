"""Running installers (pip, npm): a scrubbed environment, a process group each, a deadline.

Installers run the repository's own code (setup scripts, npm lifecycle
scripts), as the function itself will: they get an environment without the
reconciler's secrets, their own session (so their pid is their process group
and the whole group can be killed: compilers, node-gyp, git...), and a
deadline. Their output goes to the build log, scrubbed of secrets.

What an installer prints is read through a pipe as it comes (it never waits
on a full pipe, and nothing of it reaches the disk unread), and only its last
``OUTPUT_BYTES`` (1 MiB) are kept, from the start of a line: a preinstall
script that prints gigabytes, or one line of megabytes, costs the reconciler
time linear in what it printed and 2 MiB of memory at most. The scrubber runs
on the build's thread, never the event loop's, and in linear time (see
``gitops_sless.redact``). The build log is a log file of ``logfiles``: never
larger than its cap.

``close()`` kills every running group and refuses new installers, so a
stopping server leaves no pip writing for minutes behind it. Under a
sandbox (see ``sandbox``) an installer sees the system and the folder it
fills, nothing else, and keeps only the installers' own settings of the
environment.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from ..errors import TransientError
from ..plan.backend import BuildFailed
from ..redact import url_passwords
from . import logfiles
from .orphans import ProcessGroups
from .sandbox import Sandbox

__all__ = ["BuildCancelled", "BuildLog", "Installers", "build_environment", "group_alive"]

LOG_TAIL_CHARS = 4000
OUTPUT_BYTES = 1 << 20  # what the build log keeps of one installer's output: its end

_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")


class BuildCancelled(TransientError):
    """The builder is closing (the server is stopping): the build did not finish; ask again."""


def build_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment of an installer, and the values left out of it.

    Proxies, PATH, HOME and the installers' own settings pass; the
    reconciler's ``SLESS_*`` settings and anything named like a credential do
    not. The left-out values are returned so that the log can be scrubbed of
    them, in case they reach an installer some other way.
    """
    kept: dict[str, str] = {}
    dropped: list[str] = []
    for name, value in environ.items():
        upper = name.upper()
        secret = any(word in upper for word in _SECRET_WORDS) and not upper.endswith("PATH")
        if upper.startswith("SLESS_") or secret:
            dropped.append(value)
        else:
            kept[name] = value
    # npm otherwise asks the registry for its own newest version on every build
    kept.setdefault("npm_config_update_notifier", "false")
    return kept, dropped


class BuildLog:
    """A build log: appended to its file step by step, never past ``limit`` bytes.

    Every text passes the scrubber before it is stored, so no secret reaches
    the file, the result or the exception. The file is the log: ``text()``
    reads it back (what the status store keeps is what the API shows).
    """

    def __init__(self, path: Path, secrets: list[str], limit: int = logfiles.MAX_LOG_BYTES) -> None:
        self.path = path
        self.limit = limit
        # longest first, so a secret that contains another is replaced whole
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)
        path.write_bytes(b"")  # the log of an earlier build of this tag is replaced

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "****")
        return url_passwords(text, "****")

    def write(self, text: str) -> None:
        # written per step so the status API can show a running build's log
        data = self.scrub(text).encode("utf-8", "replace")
        logfiles.append(self.path, data, self.limit, min(logfiles.KEEP_LOG_BYTES, self.limit))

    def line(self, text: str) -> None:
        self.write(f"[{now()}] {text}\n")

    def output(self, step: str, tail: logfiles.Tail) -> None:
        """What an installer printed: the end of it, whole lines, and how much was left out."""
        data, dropped = tail.value(), tail.dropped
        if dropped:
            # from the first line that starts in it: half a line may hold half a secret
            kept = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
            left_out = dropped + len(data) - len(kept)
            self.line(
                f"{step}: {left_out} bytes of its output left out: "
                f"the log keeps the last {tail.limit} bytes, from the start of a line"
            )
            data = kept
        self.write(data.decode("utf-8", "replace"))

    def text(self) -> str:
        try:
            return self.path.read_bytes().decode("utf-8", "replace")
        except OSError as exc:
            return f"(the build log {self.path} cannot be read: {exc})"

    def tail(self) -> str:
        return self.text()[-LOG_TAIL_CHARS:]

    def close(self) -> None:
        """Nothing is held open between writes: kept for the callers' ``finally``."""


class Installers:
    """The installers of one builder: started, waited for, killed on close."""

    def __init__(self, groups: ProcessGroups, sandbox: Sandbox | None = None) -> None:
        self.groups = groups
        self.sandbox = sandbox or Sandbox()
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen[bytes]] = {}
        self._closing = False

    @property
    def closing(self) -> bool:
        return self._closing

    def check_open(self, tag: str) -> None:
        """BuildCancelled once ``close()`` was called."""
        if self._closing:
            raise BuildCancelled(f"build {tag} stopped: the builder is closing")

    def running(self) -> bool:
        with self._lock:
            return bool(self._running)

    def run(
        self,
        tag: str,
        step: str,
        command: list[str],
        cwd: Path,
        env: dict[str, str],
        deadline: float,
        timeout_sec: float,
        log: BuildLog,
    ) -> None:
        """Run ``command`` in ``cwd`` until it exits or ``deadline`` (monotonic) passes.

        ``timeout_sec`` is the build's whole allowance, for messages. BuildFailed
        when it cannot start, exits non-zero or times out; BuildCancelled when
        ``close()`` killed it.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BuildFailed(tag, f"timed out after {timeout_sec:g} s", log.tail())
        log.line(f"$ {shlex.join(command)}")
        output = logfiles.Tail(OUTPUT_BYTES)
        started = time.monotonic()
        try:
            code = self._wait_for(tag, step, command, cwd, env, output, remaining, log)
            log.output(step, output)
        except OSError as exc:
            raise BuildFailed(tag, f"{step}: {exc}", log.tail()) from exc
        self.check_open(tag)  # killed by close(): not a failure of this content
        if code is None:
            raise BuildFailed(tag, f"{step} timed out after {timeout_sec:g} s", log.tail())
        log.line(f"{step} exited {code} after {time.monotonic() - started:.1f} s")
        if code != 0:
            raise BuildFailed(tag, f"{step} exited {code}", log.tail())

    def _wait_for(
        self,
        tag: str,
        step: str,
        command: list[str],
        cwd: Path,
        env: dict[str, str],
        output: logfiles.Tail,
        timeout: float,
        log: BuildLog,
    ) -> int | None:
        """Start one installer and wait for it, keeping the end of what it prints in
        ``output``; its exit code, or None past ``timeout``.

        Once it has exited its process group is killed, so that nothing it left
        behind holds the pipe open; something that left the group too is not
        waited for (the pipe is closed under it).
        """
        run = self.sandbox.install(command, folder=cwd, env=env)
        with self._lock:  # close() either sees this installer or has refused it
            self.check_open(tag)
            try:
                proc = subprocess.Popen(
                    run.argv,
                    cwd=run.cwd,
                    env=run.env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                self.sandbox.release(run)
                raise BuildFailed(tag, f"cannot start {step}: {exc}", log.tail()) from exc
            self._running[proc.pid] = proc
        self.groups.add(proc.pid, command)
        assert proc.stdout is not None
        try:
            sinks = {proc.stdout: output.add}
            exited = logfiles.read_pipes(proc, sinks, timeout, on_exit=lambda: _kill_group(proc))
            return self.sandbox.returncode(proc.returncode) if exited else None
        finally:
            proc.stdout.close()
            _kill_group(proc)
            self.sandbox.release(run)  # nothing of it runs any more: the folder is ours again
            self.groups.remove(proc.pid)
            with self._lock:
                self._running.pop(proc.pid, None)

    def close(self) -> list[int]:
        """Refuse new installers and kill the running ones; the process groups killed."""
        with self._lock:
            self._closing = True
            running = list(self._running.values())
        for proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        return [proc.pid for proc in running]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # the group is gone when every member has exited already
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting to be reaped do not)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        # the fields after the name: state, ppid, pgrp
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
