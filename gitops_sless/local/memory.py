"""``memoryMB`` on the local backend: a runtime process above its limit is killed, as on Kubernetes.

Two ways, chosen once per reconciler process by :func:`detect`:

- **cgroup v2**, where this process may create cgroups with the memory
  controller: every replica and job run gets its own cgroup below
  ``<own cgroup>/gitops-sless/`` with ``memory.max`` = memoryMB (no swap,
  ``memory.oom.group``), so the kernel's OOM killer stops it exactly as the
  kubelet's would, and ``memory.events`` (``oom_kill``) says it was that.
  A process joins its cgroup before it runs anything: it is started through
  ``sh -c 'echo $$ > …/cgroup.procs && exec "$@"'``.
- **RSS watchdog**, everywhere else: a thread samples, every 200 ms, the
  resident memory of every limited process together with its descendants
  and everything in its session (``/proc/PID/stat``, the VmRSS count; shared
  pages are counted once per process) and SIGKILLs them all when the sum is
  above the limit. A burst faster than one sample can overshoot; the
  process is still killed at the next sample.

Either way the supervisor asks the :class:`Limit` of an exited process whether
memory killed it, and reports ``OOMKilled: …`` instead of "killed by signal 9".

The same limit holds ``maxProcesses``, the tasks (processes and threads) a
sandbox may have: ``pids.max`` in the cgroup where the pids controller is
delegated, else the watchdog counts the family's threads at each sample and
kills it above the cap, reported as ``ProcessLimit: …``. (A reconciler run as
root also has the kernel refuse a fork above the cap: each sandbox runs as a
uid of its own under ``RLIMIT_NPROC``, see ``sandbox``.)
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import logs

__all__ = [
    "CgroupMemory",
    "Limit",
    "MemoryGuard",
    "RssWatchdog",
    "detect",
    "oom_reason",
]

log = logging.getLogger(__name__)

SAMPLE_SEC = 0.2
CGROUP_DIR = "gitops-sless"  # below this process's own cgroup
SERVE_LEAF = "gitops-sless.serve"  # where this process moves to free its own cgroup
_PAGE = os.sysconf("SC_PAGE_SIZE")


def oom_reason(memory_mb: int, what: str = "resident memory") -> str:
    """What a replica killed for its memory says, in the route and the status store."""
    return f"OOMKilled: {what} exceeded memoryMB={memory_mb} (MiB)"


def tasks_reason(max_tasks: int, tasks: int | None = None) -> str:
    """What a replica killed for its number of processes and threads says."""
    seen = f"{tasks} tasks" if tasks is not None else "tasks"
    return f"ProcessLimit: {seen} reached maxProcesses={max_tasks}"


class Limit:
    """The memory limit of one process (and whatever it starts); this base one is none."""

    def command(self, argv: list[str]) -> list[str]:
        """The command to start instead of ``argv`` (the cgroup way joins the cgroup first)."""
        return argv

    def started(self, pid: int) -> None:
        """``pid`` runs: watch it. Never raises."""

    def reason(self) -> str | None:
        """``OOMKilled: …`` once the process was killed for its memory, else None."""
        return None

    def release(self) -> None:
        """The process has exited and was waited for: forget it (safe to call twice)."""

    @property
    def cgroup(self) -> str | None:
        """The cgroup folder the process runs in, for a restart in place to adopt."""
        return None


class MemoryGuard(ABC):
    """Hands out limits; one per reconciler process."""

    kind: str
    description: str
    # called with (pid, reason) just before the guard kills a process, so whoever routes
    # calls to it can stop at once and say why (the kernel's OOM killer gives no warning)
    on_kill: Callable[[int, str], None] | None = None

    @abstractmethod
    def limit(self, memory_mb: int | None, name: str = "", max_tasks: int | None = None) -> Limit:
        """The limit for one process; ``name`` (``env/function``) is for log lines."""

    def adopt(
        self,
        pid: int,
        memory_mb: int | None,
        name: str = "",
        max_tasks: int | None = None,
        cgroup: str | None = None,
    ) -> Limit:
        """The limit of ``pid``, started under one before this process re-executed itself
        (``cgroup``: the folder it runs in, if it was put in one)."""
        limit = self.limit(memory_mb, name, max_tasks) if cgroup is None else Limit()
        limit.started(pid)
        return limit

    def close(self) -> None:  # noqa: B027 - most guards hold nothing
        pass


# --- the watchdog ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Watched(Limit):
    guard: RssWatchdog
    memory_mb: int | None
    name: str
    max_tasks: int | None = None
    pid: int = 0
    killed: str | None = None

    def started(self, pid: int) -> None:
        self.pid = pid
        self.guard._watch(self)

    def reason(self) -> str | None:
        return self.killed

    def release(self) -> None:
        self.guard._forget(self)


@dataclass
class _Proc:
    ppid: int
    session: int
    rss: int  # bytes
    threads: int
    children: list[int] = field(default_factory=list)


def _processes(proc: Path) -> dict[int, _Proc]:
    """Every process of the machine: parent, session and resident bytes (one read each)."""
    found: dict[int, _Proc] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(proc / name / "stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it exited meanwhile
        # fields after the name in parentheses (which may hold spaces and parentheses):
        # state ppid pgrp session ... num_threads is field 20 of the line, rss field 24, in
        # pages (the VmRSS count)
        fields = stat.rpartition(b")")[2].split()
        try:
            found[int(name)] = _Proc(
                int(fields[1]), int(fields[3]), int(fields[21]) * _PAGE, int(fields[17])
            )
        except (IndexError, ValueError):
            continue
    for pid, info in found.items():
        parent = found.get(info.ppid)
        if parent is not None:
            parent.children.append(pid)
    return found


def _family(pid: int, table: dict[int, _Proc]) -> set[int]:
    """``pid``, every process in its session (it leads one), and all their descendants."""
    stack = [p for p, info in table.items() if info.session == pid]
    if pid in table:
        stack.append(pid)
    members: set[int] = set()
    while stack:
        current = stack.pop()
        if current not in members:
            members.add(current)
            stack.extend(table[current].children)
    return members


class RssWatchdog(MemoryGuard):
    """Samples resident memory every ``interval`` seconds; SIGKILLs what is over its limit."""

    kind = "watchdog"

    def __init__(self, interval: float = SAMPLE_SEC, proc: Path = Path("/proc"), why: str = ""):
        self.interval = interval
        self.proc = proc
        self.description = f"RSS watchdog every {interval:g}s" + (f" ({why})" if why else "")
        self._watched: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def limit(self, memory_mb: int | None, name: str = "", max_tasks: int | None = None) -> Limit:
        if not memory_mb and not max_tasks:
            return Limit()
        return _Watched(self, memory_mb, name, max_tasks)

    def _watch(self, limit: _Watched) -> None:
        with self._lock:
            self._watched[limit.pid] = limit
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="sless-memory-watchdog", daemon=True
                )
                self._thread.start()

    def _forget(self, limit: _Watched) -> None:
        with self._lock:
            if self._watched.get(limit.pid) is limit:
                del self._watched[limit.pid]

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> list[int]:
        """One look at every watched process; returns the pids killed for their memory."""
        with self._lock:
            watched = list(self._watched.values())
        if not watched:
            return []
        table = _processes(self.proc)
        killed = []
        for limit in watched:
            if limit.killed:
                continue
            members = _family(limit.pid, table)
            why = _over(limit, members, table)
            if why is None:
                continue
            # the reason first: whoever sees the exit must find it
            limit.killed, event, said = why
            logs.event(log, event, f"{limit.name or 'pid'} (pid {limit.pid}): {said}: killed")
            if self.on_kill is not None:
                self.on_kill(limit.pid, limit.killed)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(limit.pid, signal.SIGKILL)
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed.append(limit.pid)
        return killed


def _over(
    limit: _Watched, members: set[int], table: dict[int, _Proc]
) -> tuple[str, str, str] | None:
    """(reason, event, what was seen) when ``members`` are over ``limit``, else None."""
    if limit.memory_mb:
        resident = sum(table[p].rss for p in members)
        if resident > limit.memory_mb << 20:
            said = f"{resident >> 20} MiB resident in {len(members)} processes"
            return oom_reason(limit.memory_mb), "memory.exceeded", said
    if limit.max_tasks:
        # the sandbox's own bwrap is one of them and none of the function's: >, not >=
        tasks = sum(table[p].threads for p in members)
        if tasks > limit.max_tasks:
            said = f"{tasks} tasks in {len(members)} processes"
            return tasks_reason(limit.max_tasks, tasks), "tasks.exceeded", said
    return None


# --- cgroup v2 ------------------------------------------------------------------------------


class CgroupUnavailable(Exception):
    """Why this process cannot limit memory with cgroup v2."""


@dataclass(eq=False)
class _Cgroup(Limit):
    path: Path
    memory_mb: int | None
    max_tasks: int | None = None
    oom: str | None = None

    def command(self, argv: list[str]) -> list[str]:
        # joins the cgroup, then becomes the runtime: nothing runs outside the limit
        procs = str(self.path / "cgroup.procs")
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def reason(self) -> str | None:
        if self.oom is None and _events(self.path).get("oom_kill", 0) > 0:
            self.oom = oom_reason(self.memory_mb or 0, "memory use")
        if self.oom is None and self.max_tasks and _events(self.path, "pids").get("max", 0):
            self.oom = tasks_reason(self.max_tasks)  # forks were refused at the cap
        return self.oom

    def release(self) -> None:
        self.reason()  # read before the cgroup (and its counters) are gone
        _remove_cgroup(self.path)

    @property
    def cgroup(self) -> str | None:
        return str(self.path)


def _events(path: Path, controller: str = "memory") -> dict[str, int]:
    try:
        lines = (path / f"{controller}.events").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _remove_cgroup(path: Path, wait_sec: float = 2.0) -> None:
    if not path.is_dir():
        return
    with contextlib.suppress(OSError):
        (path / "cgroup.kill").write_text("1")  # anything that escaped the process group
    deadline = time.monotonic() + wait_sec
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                log.debug("cannot remove cgroup %s: %s", path, exc)
                return
            time.sleep(0.02)


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class CgroupMemory(MemoryGuard):
    """One cgroup per limited process, below ``base`` (which has the memory controller)."""

    kind = "cgroup"

    def __init__(self, base: Path) -> None:
        self.base = base
        self.description = f"cgroup v2 memory.max below {base}"
        self._seq = itertools.count()
        self._fallback = RssWatchdog(why="a cgroup could not be set up")

    @classmethod
    def setup(
        cls,
        mountinfo: Path = Path("/proc/self/mountinfo"),
        own: Path = Path("/proc/self/cgroup"),
        shell: str = "/bin/sh",
    ) -> CgroupMemory:
        """Find this process's cgroup v2 folder, delegate ``gitops-sless/`` below it, and
        check a process can be put in a child with a memory limit; or raise why not."""
        folder = _own_cgroup(mountinfo, own)
        if folder.name == SERVE_LEAF:  # moved there by this process before a restart in place
            folder = folder.parent
        controllers = _read(folder / "cgroup.controllers").split()
        if "memory" not in controllers:
            raise CgroupUnavailable(f"no memory controller in {folder} (cgroup v1 may hold it)")
        if not os.access(folder, os.W_OK):
            raise CgroupUnavailable(f"{folder} is not writable")
        _enable_memory(folder)
        base = folder / CGROUP_DIR
        try:
            base.mkdir(exist_ok=True)
            if "memory" not in _read(base / "cgroup.subtree_control").split():
                _write(base / "cgroup.subtree_control", "+memory")
        except OSError as exc:
            raise CgroupUnavailable(f"cannot set up {base}: {exc}") from exc
        guard = cls(base)
        guard._remove_stale()
        guard._try(shell)
        return guard

    def adopt(
        self,
        pid: int,
        memory_mb: int | None,
        name: str = "",
        max_tasks: int | None = None,
        cgroup: str | None = None,
    ) -> Limit:
        if cgroup is not None and Path(cgroup).is_dir():
            return _Cgroup(Path(cgroup), memory_mb, max_tasks)
        # in no cgroup of its own: the watchdog limited it, and goes on doing so
        return self._fallback.adopt(pid, memory_mb, name, max_tasks)

    def limit(self, memory_mb: int | None, name: str = "", max_tasks: int | None = None) -> Limit:
        if not memory_mb and not max_tasks:
            return Limit()
        path = self.base / f"{os.getpid()}-{next(self._seq)}"
        try:
            while True:  # the same pid after a restart in place: its cgroups are adopted
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    path = self.base / f"{os.getpid()}-{next(self._seq)}"
            if memory_mb:
                _write(path / "memory.max", str(memory_mb << 20))
            for file, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if memory_mb and (path / file).exists():
                    _write(path / file, value)
            if max_tasks and not (path / "pids.max").exists():
                _remove_cgroup(path)  # no pids controller here: the watchdog counts them
                return self._fallback.limit(memory_mb, name, max_tasks)
            if max_tasks:
                _write(path / "pids.max", str(max_tasks + 1))  # the sandbox's bwrap is one
        except OSError as exc:
            log.warning("%s: cannot set up %s (%s): the RSS watchdog limits it", name, path, exc)
            _remove_cgroup(path)
            return self._fallback.limit(memory_mb, name, max_tasks)
        return _Cgroup(path, memory_mb, max_tasks)

    def close(self) -> None:
        self._fallback.close()

    def _try(self, shell: str) -> None:
        probe = self.limit(64)
        if not isinstance(probe, _Cgroup):
            raise CgroupUnavailable(f"cannot create a cgroup in {self.base}")
        try:
            done = subprocess.run(
                [shell, *probe.command(["true"])[1:]],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CgroupUnavailable(f"cannot start a process in {probe.path}: {exc}") from exc
        finally:
            probe.release()
        if done.returncode != 0:
            stderr = done.stderr.decode(errors="replace").strip()
            raise CgroupUnavailable(f"cannot move a process into {probe.path}: {stderr}")

    def _remove_stale(self) -> None:
        """Cgroups an earlier reconciler left (it was killed outright)."""
        for entry in self.base.iterdir():
            owner = entry.name.partition("-")[0]
            if entry.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                _remove_cgroup(entry)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read {path}: {exc}") from exc


def _own_cgroup(mountinfo: Path, own: Path) -> Path:
    """The folder of this process's cgroup v2, from mountinfo and /proc/self/cgroup."""
    relative = None
    for line in _read(own).splitlines():
        if line.startswith("0::"):
            relative = line[3:]
    if relative is None:
        raise CgroupUnavailable("this process is in no cgroup v2 hierarchy")
    for line in _read(mountinfo).splitlines():
        before, _, after = line.partition(" - ")
        if after.split()[:1] != ["cgroup2"]:
            continue
        fields = before.split()
        root, mount_point = fields[3], fields[4]
        if relative == root or relative.startswith(root.rstrip("/") + "/"):
            inner = relative[len(root.rstrip("/")) :].lstrip("/")
            return Path(mount_point) / inner if inner else Path(mount_point)
    raise CgroupUnavailable("no cgroup2 file system is mounted where this process's cgroup is")


def _enable_memory(folder: Path) -> None:
    """Turn on the memory controller for ``folder``'s children, and pids where it can be."""
    _enable_memory_only(folder)
    subtree = folder / "cgroup.subtree_control"
    with contextlib.suppress(OSError):  # without it, the watchdog counts tasks
        if "pids" not in _read(subtree).split():
            _write(subtree, "+pids")


def _enable_memory_only(folder: Path) -> None:
    """Turn on the memory controller for ``folder``'s children.

    cgroup v2 allows that only in a cgroup with no processes of its own (but the
    root). When this process is alone in its cgroup (a container, a delegated
    systemd scope), it moves into a leaf first, as container init systems do.
    """
    subtree = folder / "cgroup.subtree_control"
    if "memory" in _read(subtree).split():
        return
    try:
        _write(subtree, "+memory")
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise CgroupUnavailable(f"cannot enable memory in {subtree}: {exc}") from exc
    members = set(_read(folder / "cgroup.procs").split())
    if members != {str(os.getpid())}:
        raise CgroupUnavailable(f"{folder} holds other processes; memory cannot be delegated")
    leaf = folder / SERVE_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", str(os.getpid()))
    except OSError as exc:
        raise CgroupUnavailable(f"cannot move into {leaf}: {exc}") from exc
    try:
        _write(subtree, "+memory")
    except OSError as exc:
        with contextlib.suppress(OSError):
            _write(folder / "cgroup.procs", str(os.getpid()))  # back where it was
        raise CgroupUnavailable(f"cannot enable memory in {subtree}: {exc}") from exc


def detect(interval: float = SAMPLE_SEC) -> MemoryGuard:
    """cgroup v2 where this process may delegate one, else the RSS watchdog."""
    try:
        guard: MemoryGuard = CgroupMemory.setup()
    except CgroupUnavailable as exc:
        guard = RssWatchdog(interval, why=f"no cgroup v2: {exc}")
    logs.event(log, "memory.limits", f"memoryMB enforced by {guard.description}")
    return guard
