"""How the local backend confines every process it starts: a bubblewrap sandbox, or nothing.

Whoever can push a commit writes the code that replicas, jobs, cron runs and
installers run. Under ``bubblewrap`` each of them gets:

- its own user, PID and IPC namespaces, with no capability (``--cap-drop ALL``,
  no nested user namespace): the reconciler and other functions do not exist
  in its ``/proc`` and cannot be signalled;
- a read-only view of the system (``/usr`` and the ``/bin``, ``/lib*`` links,
  a short list of ``/etc`` files), of its runtime's folder, and of its own
  artifact folder, mounted read-only: nothing it does changes what a later
  start runs. Installers get the folder being built, writable, instead;
- a private ``/tmp`` (a tmpfs of ``TMP_BYTES``), a fresh ``/proc`` and
  ``/dev``; a read-only root; nothing else: not the state folder, the secrets
  folders, other artifacts, the home folder or the reconciler's files;
- only its own environment (``PATH`` is the sandbox's own: interpreters are
  the system's, under ``/usr``).

It keeps the host network: replicas listen on loopback, installers download.
Inside, the process runs as ``nobody`` but owns the files of the reconciler's
user that are mounted (a user namespace maps one uid): what is not mounted is
what is protected.

Not used, on purpose: ``--new-session`` (it would take the process out of the
process group the supervisor signals; children have no terminal anyway) and
``--die-with-parent`` (its signal follows the *thread* that started bwrap,
and the supervisor starts replicas from short-lived threads; a reconciler
killed outright leaves orphans that its next start stops, see ``orphans``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import logs
from ..errors import PermanentError

__all__ = [
    "MODES",
    "SANDBOX_PATH",
    "Command",
    "Sandbox",
    "SandboxUnavailable",
    "probe",
    "resolve",
]

log = logging.getLogger(__name__)

MODES = ("auto", "bubblewrap", "off")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
TMP_BYTES = 64 << 20  # the private /tmp; an installer's downloads go to its own folder
NOBODY = "65534"
PROBE_TIMEOUT_SEC = 10.0

# what of /etc a runtime needs: users, name resolution, TLS roots, time zone, the linker,
# Debian's alternatives and its Python's own configuration; never shadow, ssh or the like
_ETC = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "gai.conf",
    "group",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "passwd",
    "protocols",
    "python3",
    "python3.11",
    "resolv.conf",
    "services",
    "ssl",
    "timezone",
)
# the installers' own configuration, which the operator wrote for them
_ETC_INSTALLERS = ("npmrc", "pip.conf")
_SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# the parts of the reconciler's environment an installer may need: its own settings,
# proxies, language; everything else (and anything with a secret's name) stays out
_INSTALLER_ENV = ("PIP_", "NPM_CONFIG_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")
_INSTALLER_LOCALE = ("LANG", "LC_ALL", "TZ")


class SandboxUnavailable(PermanentError):
    """``--sandbox bubblewrap`` was asked for and bubblewrap cannot run here."""


@dataclass(frozen=True)
class Command:
    """What to start: the command line, its whole environment, and where bwrap itself runs."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path  # the sandbox's own folder is set inside it: bwrap holds on to nothing


@dataclass(frozen=True)
class Sandbox:
    """How commands are wrapped: ``kind`` is ``bubblewrap`` or ``off``."""

    kind: str = "off"
    bwrap: str = "bwrap"
    tmp_bytes: int = TMP_BYTES

    @property
    def enabled(self) -> bool:
        return self.kind == "bubblewrap"

    def run(
        self, argv: list[str], *, artifact: Path, runtime: Path, env: Mapping[str, str]
    ) -> Command:
        """A replica, job or cron run of ``artifact``, started in it.

        The runtime is PID 1 of its namespace (``--as-pid-1``): the one process
        of the sandbox, which the supervisor signals and the memory guard
        measures; both runtimes handle SIGTERM, as PID 1 must to receive it.
        """
        if not self.enabled:
            return Command(argv, dict(env), artifact)
        mounts = [*_ro(runtime), *_ro(artifact), "--chdir", str(artifact)]
        wrapped = self._wrap(argv, _ETC, ["--as-pid-1", *mounts])
        return Command(wrapped, {**env, "PATH": SANDBOX_PATH}, Path("/"))

    def install(self, argv: list[str], *, folder: Path, env: Mapping[str, str]) -> Command:
        """The command and environment of an installer that writes only ``folder``.

        Makes the installer's home (and its temporary folder) in ``folder``.
        """
        if not self.enabled:
            return Command(argv, dict(env), folder)
        environ = installer_environment(env, folder)
        Path(environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        mounts = ["--bind", str(folder), str(folder), "--chdir", str(folder)]
        return Command(self._wrap(argv, _ETC + _ETC_INSTALLERS, mounts), environ, Path("/"))

    def terminate(self, pid: int) -> None:
        """SIGTERM to what runs in the sandbox started as ``pid``, so that it can drain.

        Not to bwrap itself: it would die at once without passing the signal on,
        and the supervisor would stop waiting for a runtime that is still draining.
        Every process of the group but bwrap gets it; the runtime drains and
        exits, and bwrap with it.
        """
        if not self.enabled:
            _signal_group(pid, signal.SIGTERM)
            return
        inside = [p for p in group_members(pid) if p != pid]
        if not inside:  # nothing started in it yet: nothing to drain
            _signal_group(pid, signal.SIGKILL)
        for member in inside:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, signal.SIGTERM)

    def returncode(self, code: int | None) -> int | None:
        """The runtime's own exit status: bwrap exits 128+N for a command killed by signal N."""
        if self.enabled and code is not None and 128 < code < 128 + signal.NSIG:
            return 128 - code
        return code

    def _wrap(self, argv: list[str], etc: Iterable[str], mounts: list[str]) -> list[str]:
        return [
            self.bwrap,
            *_isolation(),
            *_system(etc),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(self.tmp_bytes),
            "--tmpfs",
            "/tmp",  # before the binds: a folder below /tmp (a test's) is bound into it
            *mounts,
            "--remount-ro",
            "/",  # last: the folders made for the mounts above are in it
            "--",
            *argv,
        ]


def installer_environment(env: Mapping[str, str], folder: Path) -> dict[str, str]:
    """An installer's environment: the installers' own settings, and a home in ``folder``.

    Its home, caches and temporary files go into the folder being built (the
    only place it may write, removed once its output is kept), never into a
    cache another build would read.
    """
    kept = {
        name: value
        for name, value in env.items()
        if name.upper().startswith(_INSTALLER_ENV) or name in _INSTALLER_LOCALE
    }
    home = folder / ".sless-home"
    return {
        **kept,
        "PATH": SANDBOX_PATH,
        "HOME": str(home),
        "TMPDIR": str(home / "tmp"),
        "PIP_CACHE_DIR": str(home / "pip-cache"),
        "npm_config_cache": str(home / "npm-cache"),
    }


def _isolation() -> list[str]:
    return [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--uid",
        NOBODY,
        "--gid",
        NOBODY,
        "--cap-drop",
        "ALL",
        "--disable-userns",
    ]


def _ro(path: Path) -> list[str]:
    return ["--ro-bind", str(path), str(path)]


def _system(etc: Iterable[str]) -> list[str]:
    args = _ro(Path("/usr"))
    for name in _SYSTEM_LINKS:
        path = Path("/") / name
        if path.is_symlink():  # a merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += _ro(path)
    for name in etc:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """The live processes of process group ``pgid``."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # it exited meanwhile
        # the fields after the name: state, ppid, pgrp
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def probe(bwrap: str | None, interpreters: Iterable[str] = ()) -> str | None:
    """Why a sandbox cannot run a command here, or None when it can.

    Runs ``true`` in the same sandbox a replica gets, and looks for each
    interpreter in the sandbox's PATH.
    """
    if bwrap is None:
        return "bwrap is not installed (Debian: apt-get install bubblewrap)"
    argv = Sandbox("bubblewrap", bwrap)._wrap(["true"], _ETC, [])
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_SEC,
            env={"PATH": SANDBOX_PATH},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {bwrap}: {exc}"
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"{bwrap} failed: {lines[-1] if lines else f'exit {done.returncode}'}"
    missing = sorted(i for i in set(interpreters) if not shutil.which(i, path=SANDBOX_PATH))
    if missing:
        return f"{', '.join(missing)} not found in the sandbox's PATH {SANDBOX_PATH}"
    return None


@functools.cache
def resolve(mode: str, interpreters: tuple[str, ...] = ()) -> Sandbox:
    """The sandbox of ``mode`` (one of MODES), probed once per process.

    ``auto`` falls back to ``off`` with one warning; ``bubblewrap`` raises
    SandboxUnavailable when it cannot run.
    """
    if mode not in MODES:
        raise ValueError(f"sandbox {mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        logs.event(log, "sandbox.off", "function processes run unconfined (--sandbox off)")
        return Sandbox("off")
    bwrap = shutil.which("bwrap", path=f"{os.environ.get('PATH', '')}:{SANDBOX_PATH}")
    why = probe(bwrap, interpreters)
    if why is None:
        assert bwrap is not None
        logs.event(log, "sandbox.bubblewrap", f"function processes run in sandboxes ({bwrap})")
        return Sandbox("bubblewrap", bwrap)
    if mode == "bubblewrap":
        raise SandboxUnavailable(f"--sandbox bubblewrap: {why}")
    logs.event(
        log,
        "sandbox.unavailable",
        f"function processes run UNCONFINED: bubblewrap cannot run here ({why}); "
        "function code can read the reconciler's files and tokens",
        level=logging.WARNING,
    )
    return Sandbox("off")
