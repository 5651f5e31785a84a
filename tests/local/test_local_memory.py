"""``memoryMB`` on the local backend: a runtime process over its limit is killed (OOMKilled).

With real python3.11 runtime processes: through the supervisor with the way this
machine enforces limits (cgroup v2 where it may, else the RSS watchdog) and with
the watchdog itself, and end to end through ``serve``. Allocations touch their
pages (a filled bytearray) so resident memory really grows; each is 400 MiB at most.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gitops_sless.local import memory
from gitops_sless.local.processes import Supervisor
from gitops_sless.local.units import ProcessSpec
from gitops_sless.plan.backend import JobFailed

from .. import gitserver
from ..conftest import python_spec
from ..gitserver import GitDaemon, WorkRepo, init_bare
from ..sless_server import SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

HOG = """
import time

def main(event, context=None):
    if event.get("_path") == "/alloc" or event.get("alloc"):
        hog = bytearray(b"x") * (400 << 20)  # filled: every page is resident
        time.sleep(10)  # held long enough for any way of enforcing the limit to see it
        return {"kept": len(hog)}
    return {"ok": True}
"""

MODEST = """
import time

def main(event, context=None):
    block = bytearray(b"x") * (40 << 20)
    time.sleep(0.3)
    return {"held": len(block)}
"""


def _spec(tmp_path: Path, name: str, source: str, memory_mb: int | None = 128) -> ProcessSpec:
    return python_spec(tmp_path / "artifacts" / name, source, memory_mb=memory_mb)


class Recorder:
    """What the supervisor publishes: routes (upstreams, last exit) and replica events."""

    def __init__(self) -> None:
        self.routes: dict[str, list[tuple[tuple[tuple[str, int], ...], str | None]]] = {}
        self.events: list[tuple[str, str, str, str | None]] = []
        self.keys: dict[str, str] = {}

    def upstreams(
        self, env: str, name: str, ups: tuple[tuple[str, int], ...], last: str | None, key: str
    ) -> None:
        self.routes.setdefault(name, []).append((ups, last))
        self.keys[name] = key

    def headers(self, name: str) -> dict[str, str]:
        """What the proxy adds: a runtime answers only calls that carry its replica key."""
        return {"x-sless-replica": self.keys[name]}

    def event(self, env: str, name: str, kind: str, reason: str | None) -> None:
        self.events.append((env, name, kind, reason))

    def url(self, name: str) -> str | None:
        ups = self.routes[name][-1][0]
        return f"http://{ups[0][0]}:{ups[0][1]}" if ups else None


Guards = {
    "detected": memory.detect,  # cgroup v2 where this machine allows it, else the watchdog
    "watchdog": memory.RssWatchdog,
}


@pytest.fixture(params=sorted(Guards))
def guard(request) -> memory.MemoryGuard:
    return Guards[request.param]()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def supervisor(tmp_path, recorder, guard) -> Iterator[Supervisor]:
    sup = Supervisor(
        tmp_path / "state",
        recorder.upstreams,
        on_replica_event=recorder.event,
        memory_guard=guard,
    )
    yield sup
    sup.close()


def _wait(predicate: Callable[[], object], what: str, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _pids_in(folder: Path) -> set[int]:
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cwd").readlink() == folder:
                    found.add(int(proc.name))
            except OSError:
                continue
    return found


def test_a_replica_over_its_limit_is_killed_and_restarted_and_others_keep_answering(
    tmp_path, supervisor, recorder
):
    hog, calm = _spec(tmp_path, "hog", HOG), _spec(tmp_path, "calm", HOG)
    supervisor.apply(hog, "h1", 1)
    supervisor.apply(calm, "c1", 1)
    calm_pids = _pids_in(calm.artifact)
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        url = recorder.url("calm")
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                statuses.append(client.get(f"{url}/", headers=recorder.headers("calm")).status_code)
                time.sleep(0.01)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        with pytest.raises(httpx.TransportError):  # the replica dies under the call
            httpx.get(f"{recorder.url('hog')}/alloc", headers=recorder.headers("hog"), timeout=30)
        oom = _wait(lambda: [r for r in recorder.routes["hog"] if r[1]], "the OOM kill")
        upstreams, last_exit = oom[0]
        assert upstreams == ()  # out of the route at once
        assert last_exit.startswith("OOMKilled")
        assert "memoryMB=128 (MiB)" in last_exit
        _wait(lambda: recorder.url("hog"), "the hog to be restarted")
        response = httpx.get(f"{recorder.url('hog')}/", headers=recorder.headers("hog"), timeout=10)
        assert response.json() == {"ok": True}
        assert recorder.routes["hog"][-1][1] == last_exit  # the route still says why
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
    assert len(statuses) > 20 and set(statuses) == {200}
    assert _pids_in(calm.artifact) == calm_pids  # never restarted
    assert [e for e in recorder.events if e[1] == "calm"] == []
    assert [e for e in recorder.events if e[1] == "hog"] == [
        ("prod", "hog", "exited", last_exit),
        ("prod", "hog", "recovered", None),
    ]


def test_a_job_over_its_limit_fails_with_oomkilled(tmp_path, supervisor):
    spec = _spec(tmp_path, "batch", HOG)
    with pytest.raises(JobFailed, match=r"batch: OOMKilled: .*memoryMB=128 \(MiB\)"):
        supervisor.run_once(spec, {"alloc": True}, 30)
    assert json.loads(supervisor.run_once(spec, {}, 30)) == {"ok": True}


def test_a_handler_under_its_limit_is_never_killed(tmp_path, supervisor, recorder):
    spec = _spec(tmp_path, "modest", MODEST)
    supervisor.apply(spec, "m1", 1)
    pids = _pids_in(spec.artifact)
    with httpx.Client(timeout=10) as client:
        for _ in range(6):  # ~2 s of holding 40 MiB: several samples of any watchdog
            assert client.get(
                f"{recorder.url('modest')}/", headers=recorder.headers("modest")
            ).json() == {"held": 40 << 20}
    assert json.loads(supervisor.run_once(spec, {}, 30)) == {"held": 40 << 20}
    assert _pids_in(spec.artifact) == pids
    assert recorder.routes["modest"][-1][1] is None
    assert recorder.events == []


def test_without_a_limit_nothing_is_watched(tmp_path, supervisor):
    spec = _spec(tmp_path, "free", HOG.replace("time.sleep(10)", "pass"), memory_mb=None)
    assert json.loads(supervisor.run_once(spec, {"alloc": True}, 30)) == {"kept": 400 << 20}


# ----------------------------------------------------------------------------- the watchdog

FAMILY = """
import os, sys, time
block = bytearray(b"x") * ({parent} << 20)
if os.fork() == 0:
    del block  # the inherited copy: unmapped, so the two are counted apart
    os.setsid()  # out of the session and the process group: still a descendant
    block = bytearray(b"x") * ({child} << 20)
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(30)
    os._exit(0)
time.sleep(30)
"""


def _family(tmp_path: Path, parent_mb: int, child_mb: int) -> tuple[subprocess.Popen, int]:
    marker = tmp_path / f"child-{parent_mb}-{child_mb}"
    process = subprocess.Popen(
        [sys.executable, "-c", FAMILY.format(parent=parent_mb, child=child_mb), str(marker)],
        start_new_session=True,
    )
    _wait(lambda: marker.exists() and marker.read_text(), "the child to allocate")
    return process, int(marker.read_text())


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_the_watchdog_kills_a_process_whose_family_is_over_the_limit(tmp_path):
    watchdog = memory.RssWatchdog(interval=0.05)
    process, child = _family(tmp_path, 80, 80)  # each under 128 MiB, together over
    limit = watchdog.limit(128)
    limit.started(process.pid)
    try:
        assert process.wait(10) == -signal.SIGKILL
        _wait(lambda: not _alive(child), "the setsid child to be killed too", 10)
        assert limit.reason() == "OOMKilled: resident memory exceeded memoryMB=128 (MiB)"
    finally:
        limit.release()
        watchdog.close()
        for pid in (process.pid, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def test_the_watchdog_leaves_a_family_under_the_limit_alone(tmp_path):
    watchdog = memory.RssWatchdog(interval=3600)  # sampled by hand below
    process, child = _family(tmp_path, 20, 20)
    limit = watchdog.limit(128)
    limit.started(process.pid)
    try:
        for _ in range(5):
            assert watchdog.sample() == []
        assert process.poll() is None and _alive(child)
        assert limit.reason() is None
        other = watchdog.limit(32)  # the same family under a smaller limit is killed
        other.started(process.pid)
        assert watchdog.sample() == [process.pid]
        assert process.wait(10) == -signal.SIGKILL
        assert other.reason() == "OOMKilled: resident memory exceeded memoryMB=32 (MiB)"
    finally:
        watchdog.close()
        for pid in (process.pid, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait()


# ----------------------------------------------------------------------------- cgroup v2


def _fake_cgroup_tree(tmp_path: Path, controllers: str) -> tuple[Path, Path, Path]:
    """A cgroup2 mount as files: what the kernel would show this process."""
    mount = tmp_path / "cgroup"
    mount.mkdir()
    (mount / "cgroup.controllers").write_text(controllers + "\n")
    (mount / "cgroup.subtree_control").write_text("memory\n")
    (mount / "gitops-sless").mkdir()
    (mount / "gitops-sless" / "cgroup.subtree_control").write_text("memory\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "25 1 0:22 / / rw - ext4 /dev/root rw\n"
        f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n"
    )
    own = tmp_path / "self-cgroup"
    own.write_text("0::/\n")
    return mount, mountinfo, own


def test_cgroup_limits_join_before_running_and_read_oom_kills(tmp_path):
    mount, mountinfo, own = _fake_cgroup_tree(tmp_path, "cpu io memory pids")
    guard = memory.CgroupMemory.setup(mountinfo, own)
    assert guard.base == mount / "gitops-sless"
    limit = guard.limit(128)
    cgroup = Path(limit.command(["x"])[3]).parent
    assert cgroup.parent == guard.base
    assert (cgroup / "memory.max").read_text() == str(128 << 20)
    pid = subprocess.run(
        limit.command([sys.executable, "-c", "import os; print(os.getpid())"]),
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert (cgroup / "cgroup.procs").read_text().strip() == pid  # the runtime itself joined
    assert limit.reason() is None
    (cgroup / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert limit.reason() == "OOMKilled: memory use exceeded memoryMB=128 (MiB)"


def test_no_cgroup_memory_controller_means_the_watchdog(tmp_path):
    _, mountinfo, own = _fake_cgroup_tree(tmp_path, "cpu io pids")
    with pytest.raises(memory.CgroupUnavailable, match="no memory controller"):
        memory.CgroupMemory.setup(mountinfo, own)
    own.write_text("1:memory:/x\n")  # cgroup v1 only
    with pytest.raises(memory.CgroupUnavailable, match="no cgroup v2"):
        memory.CgroupMemory.setup(mountinfo, own)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture
def served(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[Callable]:
    init_bare(git_root / "functions.git")
    url = git_daemon.url("functions.git")
    work = WorkRepo(tmp_path / "work")
    servers: list[SlessServer] = []

    def serve(files: dict[str, str]) -> SlessServer:
        work.commit("functions", files)
        work.push(url)
        server = SlessServer(url, tmp_path / "state")
        servers.append(server)
        return server.start()

    yield serve
    for server in servers:
        server.stop()


def _manifest(name: str, *extra: str) -> str:
    lines = ["functions:", f"  - name: {name}", "    runtime: python3.11", "    memoryMB: 128"]
    return "\n".join([*lines, "    entrypoint: handler.main", *extra]) + "\n"


def test_serve_kills_and_restarts_a_function_over_its_memory_and_fails_such_a_job(served):
    server = served(
        {
            "hog/handler.py": HOG,
            "hog/sless.yaml": _manifest("hog", "    triggers: [{type: http}]"),
            "calm/handler.py": HOG,
            "calm/sless.yaml": _manifest("calm", "    triggers: [{type: http}]"),
            "batch/handler.py": HOG,
            "batch/sless.yaml": _manifest(
                "batch", "    jobs: [{name: big, runId: 1, event: {alloc: true}}]"
            ),
        }
    )
    assert server.call("hog").json() == {"ok": True}
    assert server.call("hog", "/alloc").status_code >= 500  # killed under the call
    assert server.call("calm").json() == {"ok": True}
    server.wait(lambda: server.call("hog").status_code == 200, "the hog to be back", 30)
    assert server.call("hog").json() == {"ok": True}
    assert "replica.exited" in server.output() and "OOMKilled" in server.output()
    (job,) = server.jobs()
    assert job["phase"] == "Failed"
    assert "OOMKilled" in job["error"] and "memoryMB=128" in job["error"]
