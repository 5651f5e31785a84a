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
The function's folder is mounted at the neutral ``/function`` (as in the
runtime images) and the runtime's at ``/runtime``: no host path of the state
folder is handed in.

Which host uid runs the code depends on who runs the reconciler:

- **as root** (the documented container, these machines): bwrap sets up the
  mounts as root, then ``setpriv`` drops to a host uid of its own for each
  sandbox (``UID_BASE`` + a random slot, never 0, never shared by two live
  sandboxes of this reconciler), with no capability, an empty bounding set and
  ``no_new_privs``, before anything of the function runs. A sandbox is thus
  never host root: ``/proc/sys``, ``/sys`` and ``/dev`` refuse it as they refuse
  any user, and ``RLIMIT_NPROC`` of that uid caps its tasks (``max_processes``,
  enforced by the kernel: a fork or thread above it fails).
- **as another user**: a user namespace maps ``nobody`` inside to that user
  (``--unshare-user --disable-userns``), who is no more privileged than the
  reconciler; the task cap is then the supervisor's count (see ``memory``).

``/proc`` is the sandbox's own and read-only; ``/tmp`` and ``/dev/shm`` are
small private tmpfs.

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
import random
import shutil
import signal
import stat
import subprocess
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import logs
from ..errors import PermanentError

# a generator of its own: the global one stays the caller's (seeded tests, hypothesis)
_random = random.Random()

__all__ = [
    "FUNCTION_DIR",
    "INSTALLER_MAX_PROCESSES",
    "MODES",
    "RUNTIME_DIR",
    "SANDBOX_PATH",
    "UID_BASE",
    "Command",
    "Sandbox",
    "SandboxUnavailable",
    "probe",
    "resolve",
    "signal_group",
]

log = logging.getLogger(__name__)

MODES = ("auto", "bubblewrap", "off")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
TMP_BYTES = 64 << 20  # the private /tmp; an installer's downloads go to its own folder
NOBODY = "65534"
FUNCTION_DIR = "/function"  # where a function's folder is, inside (the runtime images' path)
RUNTIME_DIR = "/runtime"
BUILD_DIR = "/build"  # the folder an installer writes
# host uids of sandboxes when the reconciler runs as root: far above any account's
# (useradd stops at 60000, container subordinate ranges start at 100000 and 65536 wide)
UID_BASE = 900_000_000
UID_SLOTS = 1_000_000
INSTALLER_MAX_PROCESSES = 1024  # npm and pip start helpers of their own
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
    uid: int | None = None  # the host uid it runs as, when dropped to one of its own
    owned: Path | None = None  # a folder given to that uid while it runs (an installer's)


class Uids:
    """Host uids for the sandboxes of a reconciler that runs as root: one per live sandbox.

    Random slots above ``UID_BASE``, so that two reconcilers on one machine rarely
    meet; within one, a uid is never handed out twice while it is in use.
    """

    def __init__(self, base: int = UID_BASE, slots: int = UID_SLOTS) -> None:
        self.base, self.slots = base, slots
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            while True:
                uid = self.base + _random.randrange(self.slots)
                if uid not in self._used:
                    self._used.add(uid)
                    return uid

    def claim(self, uid: int) -> None:
        """``uid`` is in use already (an adopted replica's): never hand it out."""
        with self._lock:
            self._used.add(uid)

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)


@dataclass(frozen=True)
class Sandbox:
    """How commands are wrapped: ``kind`` is ``bubblewrap`` or ``off``."""

    kind: str = "off"
    bwrap: str = "bwrap"
    tmp_bytes: int = TMP_BYTES
    # set when the reconciler runs as root: every sandbox drops to a uid of its own
    uids: Uids | None = field(default=None, compare=False)
    setpriv: str = "setpriv"
    prlimit: str = "prlimit"

    @property
    def enabled(self) -> bool:
        return self.kind == "bubblewrap"

    def function_dir(self, artifact: Path) -> Path:
        """Where the function sees its own folder: paths in its output are below this."""
        return Path(FUNCTION_DIR) if self.enabled else artifact

    def run(
        self,
        argv: list[str],
        *,
        artifact: Path,
        runtime: Path,
        env: Mapping[str, str],
        max_processes: int | None = None,
    ) -> Command:
        """A replica, job or cron run of ``artifact``, started in it.

        The runtime is PID 1 of its namespace (``--as-pid-1``): the one process
        of the sandbox, which the supervisor signals and the memory guard
        measures; both runtimes handle SIGTERM, as PID 1 must to receive it.
        ``argv`` names the runtime by its host path; inside it is below ``/runtime``.
        """
        if not self.enabled:
            return Command(argv, dict(env), artifact)
        inside = _moved(argv, runtime, RUNTIME_DIR)
        mounts = [*_ro(runtime, RUNTIME_DIR), *_ro(artifact, FUNCTION_DIR)]
        mounts += ["--chdir", FUNCTION_DIR]
        uid = self.uids.take() if self.uids else None
        wrapped = self._wrap(inside, _ETC, ["--as-pid-1", *mounts], uid, max_processes)
        environ = {**env, "PATH": SANDBOX_PATH, "SLESS_FUNCTION_DIR": FUNCTION_DIR}
        return Command(wrapped, environ, Path("/"), uid)

    def install(self, argv: list[str], *, folder: Path, env: Mapping[str, str]) -> Command:
        """The command and environment of an installer that writes only ``folder``.

        ``folder`` is ``/build`` inside (``argv`` names it by its host path). Makes the
        installer's home (and its temporary folder) in it; as root, ``folder`` belongs
        to the sandbox's uid until :meth:`release` takes it back.
        """
        if not self.enabled:
            return Command(argv, dict(env), folder)
        environ = installer_environment(env, Path(BUILD_DIR))
        _make_dirs(folder, Path(environ["TMPDIR"]).relative_to(BUILD_DIR))
        mounts = ["--bind", str(folder), BUILD_DIR, "--chdir", BUILD_DIR]
        uid = self.uids.take() if self.uids else None
        if uid is not None:
            own_tree(folder, uid)
        inside = _moved(argv, folder, BUILD_DIR)
        wrapped = self._wrap(inside, _ETC + _ETC_INSTALLERS, mounts, uid, INSTALLER_MAX_PROCESSES)
        return Command(wrapped, environ, Path("/"), uid, folder if uid is not None else None)

    def release(self, command: Command) -> None:
        """``command``'s processes have all ended: its uid is free again, and the folder
        it wrote belongs to the reconciler once more (links are not followed)."""
        if command.owned is not None:
            own_tree(command.owned, os.geteuid(), os.getegid())
        if command.uid is not None and self.uids is not None:
            self.uids.give_back(command.uid)

    def terminate(self, pid: int) -> None:
        """SIGTERM to what runs in the sandbox started as ``pid``, so that it can drain.

        Not to bwrap itself: it would die at once without passing the signal on,
        and the supervisor would stop waiting for a runtime that is still draining.
        Every process of the group but bwrap gets it; the runtime drains and
        exits, and bwrap with it.
        """
        if not self.enabled:
            signal_group(pid, signal.SIGTERM)
            return
        inside = [p for p in group_members(pid) if p != pid]
        if not inside:  # nothing started in it yet: nothing to drain
            signal_group(pid, signal.SIGKILL)
        for member in inside:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, signal.SIGTERM)

    def returncode(self, code: int | None) -> int | None:
        """The runtime's own exit status: bwrap exits 128+N for a command killed by signal N."""
        if self.enabled and code is not None and 128 < code < 128 + signal.NSIG:
            return 128 - code
        return code

    def _wrap(
        self,
        argv: list[str],
        etc: Iterable[str],
        mounts: list[str],
        uid: int | None = None,
        max_processes: int | None = None,
    ) -> list[str]:
        """bwrap around ``argv``; with ``uid``, bwrap runs as root and ``setpriv`` drops
        to ``uid`` inside, under ``prlimit``'s task cap (RLIMIT_NPROC counts per uid)."""
        tmp = ["--size", str(self.tmp_bytes), "--perms", "1777", "--tmpfs"]
        wrapped = [
            self.bwrap,
            *(_isolation() if uid is None else _isolation_as_root()),
            *_system(etc),
            "--proc",
            "/proc",
            "--remount-ro",
            "/proc",  # the sandbox's own processes; nothing of the host's to write
            "--dev",
            "/dev",
            *tmp,
            "/dev/shm",
            *tmp,
            "/tmp",  # before the binds: a folder below /tmp (a test's) is bound into it
            *mounts,
            "--remount-ro",
            "/",  # last: the folders made for the mounts above are in it
            "--",
        ]
        if uid is None:
            return [*wrapped, *argv]
        limit = [] if max_processes is None else [self.prlimit, f"--nproc={max_processes}", "--"]
        return [*limit, *wrapped, *_drop(self.setpriv, uid), *argv]


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
        "--unshare-uts",
        "--uid",
        NOBODY,
        "--gid",
        NOBODY,
        "--cap-drop",
        "ALL",
        "--disable-userns",
    ]


def _isolation_as_root() -> list[str]:
    # no user namespace: it would map the sandbox to host root; setpriv drops instead
    return ["--unshare-pid", "--unshare-ipc", "--unshare-uts"]


def _drop(setpriv: str, uid: int) -> list[str]:
    """Become ``uid`` (and its own group) for good: no capability can come back."""
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def own_tree(folder: Path, uid: int, gid: int | None = None) -> None:
    """chown ``folder`` and everything below it, never through a symlink."""
    gid = uid if gid is None else gid
    os.chown(folder, uid, gid, follow_symlinks=False)
    for parent, folders, files in os.walk(folder):  # os.walk does not descend into links
        for name in [*folders, *files]:
            with contextlib.suppress(FileNotFoundError):
                os.chown(os.path.join(parent, name), uid, gid, follow_symlinks=False)


def _make_dirs(folder: Path, below: Path) -> None:
    """mkdir -p ``folder/below`` that never follows a link an earlier step left there."""
    path = folder
    for part in below.parts:
        path = path / part
        try:
            path.mkdir(mode=0o755)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise NotADirectoryError(f"{path} is not a folder") from None


def _moved(argv: list[str], host: Path, inside: str) -> list[str]:
    """``argv`` with ``host`` (a path prefix) replaced by ``inside``."""
    prefix = str(host)
    moved = []
    for arg in argv:
        if arg == prefix or arg.startswith(prefix + "/"):
            arg = inside + arg[len(prefix) :]
        moved.append(arg)
    return moved


def _ro(path: Path, inside: str | None = None) -> list[str]:
    return ["--ro-bind", str(path), inside or str(path)]


def _system(etc: Iterable[str]) -> list[str]:
    args = _ro(Path("/usr"))
    for name in _SYSTEM_LINKS:
        path = Path("/") / name
        if path.is_symlink():  # a merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += _ro(path)
    args += ["--perms", "0755", "--dir", "/etc"]  # else made 0700: closed to a dropped uid
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


def signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group ``pid`` leads; it may have ended since it was looked at."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def probe(bwrap: str | None, interpreters: Iterable[str] = ()) -> str | None:
    """Why a sandbox cannot run a command here, or None when it can.

    Runs ``true`` in the same sandbox a replica gets, and looks for each
    interpreter in the sandbox's PATH.
    """
    if bwrap is None:
        return "bwrap is not installed (Debian: apt-get install bubblewrap)"
    sandbox = _as_user(Sandbox("bubblewrap", bwrap))
    if sandbox.uids is not None and not (sandbox.setpriv and sandbox.prlimit):
        return "setpriv and prlimit are needed to leave root (Debian: util-linux)"
    uid = sandbox.uids.take() if sandbox.uids else None
    argv = sandbox._wrap(["true"], _ETC, [], uid, 16)
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


def _as_user(sandbox: Sandbox) -> Sandbox:
    """``sandbox``, dropping to uids of its own when this process is root."""
    if os.geteuid() != 0:
        return sandbox
    path = f"{os.environ.get('PATH', '')}:{SANDBOX_PATH}:/usr/sbin:/sbin"
    return Sandbox(
        sandbox.kind,
        sandbox.bwrap,
        sandbox.tmp_bytes,
        Uids(),
        shutil.which("setpriv", path=path) or "",
        shutil.which("prlimit", path=path) or "",
    )


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
        sandbox = _as_user(Sandbox("bubblewrap", bwrap))
        who = "a uid of their own" if sandbox.uids else "this user, in a user namespace"
        logs.event(
            log, "sandbox.bubblewrap", f"function processes run in sandboxes ({bwrap}) as {who}"
        )
        return sandbox
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
