"""Function code cannot reach the reconciler: the local backend's bubblewrap sandbox.

A hostile handler, a hostile job and a hostile installer (a PEP 517 backend
that runs while pip builds the function's dependency) try what a security
review did: read the reconciler's environ and command line, the state and
secrets folders, another function's files and environment; write their own
and another function's artifact; signal the reconciler; list its processes.
Each reports every attempt's outcome. Under the sandbox every attempt fails and
prod keeps serving its own code across a restart; with ``--sandbox off`` the
same attempts succeed, so these tests can fail.

One real ``serve`` per mode, shared by the tests of that mode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..gitserver import GitDaemon, WorkRepo, init_bare
from ..sless_server import TOKEN, SlessServer

CANARY = "canary-webhook-secret-0123456789"  # in the reconciler's environment only
VICTIM_CANARY = "victim-env-only-9876543210"  # in prod's replica's environment only
SECRET = "victim-secret-from-the-secrets-folder"
ORIGINAL = {"code": "original"}


def victim_files(mode: str) -> dict[str, str]:
    return {k: v.replace(VICTIM_CANARY, f"{VICTIM_CANARY}-{mode}") for k, v in VICTIM.items()}


VICTIM = {
    "victim/sless.yaml": (
        "functions:\n"
        "  - name: victim\n"
        "    runtime: python3.11\n"
        "    entrypoint: handler.main\n"
        "    env:\n"
        f"      VICTIM_CANARY: {VICTIM_CANARY!r}\n"
        "      DB_PASSWORD: {secret: db, key: password}\n"
        "    triggers: [{type: http}]\n"
    ),
    "victim/handler.py": (
        "import os\n\n"
        "def main(event):\n"
        "    if event['_path'] == '/who':  # which victim: tests may run beside each other\n"
        "        return {'canary': os.environ['VICTIM_CANARY']}\n"
        "    return {'code': 'original'}\n"
    ),
    "echo/sless.yaml": (
        "functions:\n"
        "  - {name: echo, runtime: nodejs20, entrypoint: handler.main, triggers: [{type: http}]}\n"
    ),
    "echo/handler.js": (
        "exports.main = async (event) => ({node: process.version, q: event._query});\n"
    ),
    "hog/sless.yaml": (
        "functions:\n"
        "  - name: hog\n"
        "    runtime: python3.11\n"
        "    entrypoint: handler.main\n"
        "    memoryMB: 64\n"
        "    triggers: [{type: http}]\n"
    ),
    "forker/sless.yaml": (
        "functions:\n"
        "  - name: forker\n"
        "    runtime: python3.11\n"
        "    entrypoint: handler.main\n"
        "    maxProcesses: 64\n"
        "    triggers: [{type: http}]\n"
    ),
    "forker/handler.py": (
        "import threading, time\n\n"
        "def main(event):\n"
        "    started = 0\n"
        "    try:\n"
        "        for _ in range(1000):\n"
        "            threading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n"
        "            started += 1\n"
        "    except RuntimeError:\n"
        "        pass\n"
        "    time.sleep(3)  # holds them: the supervisor sees them\n"
        "    return {'threads': started}\n"
    ),
    "hog/handler.py": (
        "import time\n\n"
        "def main(event):\n"
        "    hoard = [bytearray(16 << 20) for _ in range(24)]  # 384 MiB, touched\n"
        "    time.sleep(2)\n"
        "    return {'kept': len(hoard)}\n"
    ),
}

# every attempt returns "succeeded: ..." or "failed: ..."; run by the handler, the job
# and, at build time, the installer (which has no artifact of its own yet)
ATTEMPTS = r"""
import json, os, signal

HERE = os.path.dirname(os.path.abspath(__file__))


def _targets():
    with open(os.path.join(HERE, "targets.json")) as f:
        return json.load(f)


def _read(path, size=4096):
    with open(path, "rb") as f:
        return f.read(size).decode("utf-8", "replace")


def reconciler_environ(t):
    found = t["canary"] in _read(f"/proc/{t['pid']}/environ", 1 << 20)
    return "succeeded: the canary" if found else "failed: no canary in that environ"


def reconciler_cmdline(t):
    found = t["token"] in _read(f"/proc/{t['pid']}/cmdline", 1 << 20)
    return "succeeded: the API token" if found else "failed: no token in that command line"


def state_folder(t):
    return "succeeded: " + repr(_read(os.path.join(t["state"], "status.db"), 16))


def secrets_folder(t):
    return "succeeded: " + _read(os.path.join(t["secrets"], "db", "password"))


def other_function_files(t):
    return "succeeded: " + _read(os.path.join(t["victim"], "handler.py"))


def other_function_environ(t):
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if t["victim_canary"] in _read(f"/proc/{name}/environ", 1 << 20):
                    return f"succeeded: pid {name}"
            except OSError:
                continue
    return "failed: no process with the victim's environment"


def _append(path, text):
    try:
        f = open(path, "a")
    except PermissionError:  # read-only to its owner: the owner makes it writable again
        os.chmod(path, 0o644)
        f = open(path, "a")
    with f:
        f.write(text)
    return "succeeded: appended to " + path


def own_artifact(t):
    # a mark, not code: unconfined, the job would change what the hostile replica serves
    # when it runs before that replica imports this file
    return _append(os.path.join(os.environ["SLESS_FUNCTION_DIR"], "handler.py"), "\n# owned\n")


def other_artifact(t):
    code = "\n\ndef main(event):\n    return {'code': 'owned'}\n"
    return _append(os.path.join(t["victim"], "handler.py"), code)


def signal_reconciler(t):
    os.kill(t["pid"], signal.SIGCONT)  # a real signal, and a harmless one
    return "succeeded: SIGCONT delivered"


def list_processes(t):
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    if str(t["pid"]) in pids:
        return f"succeeded: the reconciler among {len(pids)} processes"
    return f"failed: {len(pids)} processes, the reconciler not among them"


def _host_uid(t):
    uid = os.getuid()
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, outside, count = map(int, line.split())
            if inside <= uid < inside + count:
                if outside == 0 and t["reconciler_uid"] != 0:
                    # one level up is a user namespace (bwrap's, under --disable-userns)
                    # whose 0 is the user who made it: a namespace maps only uids its
                    # creator holds, so the host uid is the reconciler's
                    return t["reconciler_uid"]
                return outside + uid - inside
    return None


def host_root(t):
    host = _host_uid(t)
    return "succeeded: runs as host uid 0" if host == 0 else f"failed: host uid {host}"


def host_sysctls(t):
    opened = []
    for name in ("kernel/core_pattern", "kernel/hostname", "vm/drop_caches", "net/ipv4/ip_forward"):
        try:
            os.close(os.open("/proc/sys/" + name, os.O_WRONLY))  # opened, nothing written
            opened.append(name)
        except OSError:
            continue
    return f"succeeded: {opened} opened for writing" if opened else "failed: none opened"


# what a sandbox may write in /dev: the harmless devices every process gets
_HARMLESS = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts/ptmx"}


def writable_system_files(t):
    for top in ("/proc/sys", "/sys", "/dev"):
        for parent, folders, files in os.walk(top):
            for name in files:
                path = os.path.join(parent, name)
                if top == "/dev" and (os.path.relpath(path, top) in _HARMLESS or "/shm" in path):
                    continue
                if os.path.islink(path):  # /dev/stdin and the like: the process's own fds
                    continue
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY))
                except OSError:
                    continue
                return "succeeded: " + path + " opened for writing"
    return "failed: nothing in /proc/sys, /sys or /dev opened for writing"


def direct_replica_call(t):
    # every listening loopback port, as /proc/net/tcp shows it to anyone on the host network
    import http.client
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.startswith("0100007F:"):
                ports.add(int(local.split(":")[1], 16))
    for port in sorted(ports):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/who", headers={"X-Forwarded-For": "203.0.113.66"})
            answer = conn.getresponse()
            body = answer.read(4096)
        except Exception:
            continue
        if answer.status == 200 and t["victim_canary"].encode() in body:
            return f"succeeded: the victim answered a direct call on port {port}"
    return f"failed: no replica answered a direct call ({len(ports)} ports tried)"


def run(names):
    t = _targets()
    report = {}
    for name in names:
        try:
            report[name] = globals()[name](t)
        except BaseException as exc:
            report[name] = f"failed: {type(exc).__name__}: {exc}"
    return report


EVERY = [
    "reconciler_environ", "reconciler_cmdline", "state_folder", "secrets_folder",
    "other_function_files", "other_function_environ", "own_artifact", "other_artifact",
    "signal_reconciler", "list_processes", "host_root", "host_sysctls",
    "writable_system_files", "direct_replica_call",
]
"""

# the dependency's build backend: what pip runs while it builds the function
BACKEND = r"""
import base64, hashlib, os, sys, zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attempts


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    names = [n for n in attempts.EVERY if n != "own_artifact"]  # it is being built
    report = attempts.run(names)
    wheel = "evil-1.0-py3-none-any.whl"
    dist = "evil-1.0.dist-info"
    files = {
        "evil_report.py": "REPORT = " + repr(report) + "\n",
        dist + "/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
        dist + "/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: evil\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={encoded},{len(text.encode())}\n")
    files[dist + "/RECORD"] = "".join(record) + dist + "/RECORD,,\n"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as out:
        for path, data in files.items():
            out.writestr(path, data)
    return wheel
"""

HOSTILE_HANDLER = """
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "evil"))
import attempts


def main(event):
    return attempts.run(attempts.EVERY)


def installer(event):
    import evil_report
    return evil_report.REPORT
"""


def hostile_files(targets: dict[str, object]) -> dict[str, str]:
    return {
        "hostile/sless.yaml": (
            "functions:\n"
            "  - name: hostile\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    triggers: [{type: http}]\n"
            "    jobs: [{name: hostile-job, runId: 1}]\n"
            "  - name: hostile-installer\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.installer\n"
            "    triggers: [{type: http}]\n"
        ),
        "hostile/handler.py": HOSTILE_HANDLER,
        "hostile/requirements.txt": "./evil\n",
        "hostile/evil/pyproject.toml": (
            '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        ),
        "hostile/evil/backend.py": BACKEND,
        "hostile/evil/attempts.py": ATTEMPTS,
        "hostile/evil/targets.json": json.dumps(targets),
        **grab_files("grab-relative", "../../../../secrets"),  # the state layout's neighbour
        **grab_files("grab-absolute", str(targets["secrets"])),
    }


def grab_files(name: str, link: str) -> dict[str, str]:
    """A node function whose install step makes its output folder a link to ``link``."""
    package = {
        "name": name,
        "version": "1.0.0",
        "scripts": {"preinstall": f"ln -s {link} node_modules"},
    }
    return {
        f"{name}/sless.yaml": (
            f"functions:\n  - {{name: {name}, runtime: nodejs20, entrypoint: handler.main, "
            "triggers: [{type: http}]}\n"
        ),
        f"{name}/package.json": json.dumps(package),
        f"{name}/handler.js": (
            "const fs = require('fs');\n"
            "exports.main = async () => {\n"
            "  const path = __dirname + '/node_modules/db/password';\n"
            "  try { return {got: fs.readFileSync(path, 'utf8')}; }\n"
            "  catch (e) { return {got: null, error: e.code}; }\n"
            "};\n"
        ),
    }


@dataclass
class Hostile:
    """A serve in one sandbox mode, after the hostile function was pushed and built."""

    mode: str
    server: SlessServer
    handler: dict[str, str]
    job: dict[str, str]
    installer: dict[str, str]
    victim_artifact: Path
    state: Path
    secret_file: Path


GRABS = ("grab-relative", "grab-absolute")


def _settled(server: SlessServer, name: str) -> dict | None:
    status = server.function(name)
    return status if status and status["phase"] in ("Ready", "Failed") else None


def _job_result(server: SlessServer) -> dict[str, str] | None:
    for job in server.jobs():
        if job["name"] == "hostile-job" and job["phase"] in ("Succeeded", "Failed"):
            assert job["phase"] == "Succeeded", job
            return json.loads(job["result"])
    return None


def _serve(url: str, root: Path, mode: str) -> SlessServer:
    return SlessServer(
        url,
        root / "state",
        secrets_dir=root / "secrets",
        # no index: the one dependency is built from the function's folder
        env={"SLESS_WEBHOOK_SECRET_GITEA": CANARY, "PIP_NO_INDEX": "1"},
        args=["--sandbox", mode],
    )


def _start_hostile(root: Path, mode: str) -> Iterator[Hostile]:
    (root / "secrets" / "db").mkdir(parents=True)
    (root / "secrets" / "db" / "password").write_text(SECRET)
    git_root = root / "served"
    git_root.mkdir()
    with GitDaemon(git_root) as daemon:
        init_bare(git_root / "functions.git")
        url = daemon.url("functions.git")
        work = WorkRepo(root / "work")
        work.commit("victim", victim_files(mode))
        work.push(url)
        server = _serve(url, root, mode)
        try:
            server.start()
            server.wait(lambda: server.call("victim").status_code == 200, "the victim")
            tag = server.function("victim")["buildTag"]
            assert server.process is not None
            targets = {
                "pid": server.process.pid,
                "reconciler_uid": os.geteuid(),  # serve runs as this test does
                "canary": CANARY,
                "token": TOKEN,
                "state": str(root / "state"),
                "secrets": str(root / "secrets"),
                "victim": str(root / "state" / "artifacts" / tag),
                "victim_canary": f"{VICTIM_CANARY}-{mode}",
            }
            work.commit("hostile", hostile_files(targets))
            work.push(url)
            server.sync()
            for name in ("hostile", "hostile-installer"):
                server.wait(lambda n=name: server.call(n).status_code == 200, f"{name} to serve")
            for name in GRABS:
                server.wait(lambda n=name: _settled(server, n), f"{name} to build or fail")
            job = server.wait(lambda: _job_result(server), "the hostile job")
            yield Hostile(
                mode,
                server,
                server.call("hostile").json(),
                job,
                server.call("hostile-installer").json(),
                root / "state" / "artifacts" / tag,
                root / "state",
                root / "secrets" / "db" / "password",
            )
        finally:
            server.stop()


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    yield from _start_hostile(tmp_path_factory.mktemp("bubblewrap"), "bubblewrap")


@pytest.fixture(scope="module")
def unconfined(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    yield from _start_hostile(tmp_path_factory.mktemp("off"), "off")


ACTORS = ("handler", "job", "installer")
# what --sandbox off must show possible, so that the sandboxed run proves something
SHOWN_UNCONFINED = (
    "reconciler_environ",
    "reconciler_cmdline",
    "state_folder",
    "secrets_folder",
    "other_function_files",
    "other_function_environ",
    "other_artifact",
    "signal_reconciler",
    "list_processes",
    # (not direct_replica_call: the replica key holds unconfined too)
    # what only a reconciler run as root (these machines, the documented container) shows
    *(("host_root", "host_sysctls", "writable_system_files") if os.geteuid() == 0 else ()),
)


@pytest.mark.parametrize("actor", ACTORS)
def test_every_attempt_of_hostile_code_fails_in_the_sandbox(sandboxed, actor):
    report = getattr(sandboxed, actor)
    expected = 13 if actor == "installer" else 14
    assert len(report) == expected, report
    succeeded = {name: out for name, out in report.items() if not out.startswith("failed")}
    assert succeeded == {}
    for outcome in report.values():
        assert CANARY not in outcome and TOKEN not in outcome and SECRET not in outcome


@pytest.mark.parametrize("actor", ACTORS)
def test_the_same_attempts_succeed_unconfined(unconfined, actor):
    report = getattr(unconfined, actor)
    for name in SHOWN_UNCONFINED:
        assert report[name].startswith("succeeded"), (name, report[name])
    if actor != "installer":
        assert report["own_artifact"].startswith("succeeded")


@pytest.mark.parametrize("name", GRABS)
def test_an_install_step_cannot_link_host_folders_into_its_artifact(sandboxed, unconfined, name):
    """The reconciler reads installer output outside any sandbox: a link there is refused
    (the build fails naming it), never followed into the secrets folder."""
    for hostile in (sandboxed, unconfined):
        server = hostile.server
        status = _settled(server, name)
        assert status is not None and status["phase"] == "Failed", status
        assert "symlink node_modules ->" in status["message"], status["message"]
        response = server.call(name)
        assert SECRET not in response.text
        secret = hostile.secret_file.stat()
        assert (secret.st_nlink, oct(secret.st_mode & 0o777)) == (1, oct(0o644))


def test_status_says_which_sandbox_runs_the_functions(sandboxed, unconfined):
    assert sandboxed.server.client.get("/api/v1/status").json()["sandbox"] == "bubblewrap"
    assert unconfined.server.client.get("/api/v1/status").json()["sandbox"] == "off"


def test_python_and_node_serve_and_memory_is_enforced_in_the_sandbox(sandboxed):
    server = sandboxed.server
    echo = server.call("echo", params={"x": "1"}).json()
    assert echo["node"].startswith("v") and echo["q"] == {"x": "1"}
    assert server.call("hog").status_code in (502, 503)
    status = server.wait(
        lambda: (s := server.function("hog")) and (s["lastExit"] or "").startswith("OOM") and s,
        "the hog to be OOMKilled",
        30,
    )
    assert "memoryMB=64" in status["lastExit"]


def test_a_function_that_starts_too_many_tasks_is_stopped_and_says_why(sandboxed):
    server = sandboxed.server
    assert server.call("forker").status_code in (502, 503)
    status = server.wait(
        lambda: (s := server.function("forker")) and (s["lastExit"] or "").startswith("Proc") and s,
        "the forker to be stopped for its tasks",
        30,
    )
    assert "maxProcesses=64" in status["lastExit"]


def test_a_built_artifact_is_read_only(sandboxed):
    for folder, dirs, files in os.walk(sandboxed.victim_artifact):
        for name in [*dirs, *files, "."]:
            path = Path(folder) / name
            if not path.is_symlink():
                assert path.stat().st_mode & 0o222 == 0, path


def _victim_processes(mode: str = "bubblewrap") -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{VICTIM_CANARY}-{mode}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_prod_serves_its_own_code_after_a_reconciler_killed_outright_restarts(sandboxed):
    """Last in the module: it replaces the shared server."""
    old = sandboxed.server
    assert old.call("victim").json() == ORIGINAL
    before = _victim_processes()
    assert before  # seen from the host, the sandboxed replica is there
    old.kill()  # no clean-up: the sandboxed processes are orphaned
    again = SlessServer(
        old.repo,
        sandboxed.state,
        secrets_dir=old.secrets_dir,
        args=["--sandbox", "bubblewrap"],
    )
    try:
        again.start()
        again.wait(lambda: again.call("victim").status_code == 200, "the victim again")
        assert again.call("victim").json() == ORIGINAL
        assert not set(before) & set(_victim_processes())  # the orphans were stopped
        text = (sandboxed.victim_artifact / "handler.py").read_text()
        assert "owned" not in text
    finally:
        again.stop()


# --- starting up ------------------------------------------------------------------------


def _fake_bwrap(tmp_path: Path) -> dict[str, str]:
    """A bwrap that cannot make namespaces, as where user namespaces are forbidden."""
    folder = tmp_path / "bin"
    folder.mkdir()
    fake = folder / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def _errors(stderr: str) -> list[str]:
    """The command's own error lines (the log may have said something before)."""
    return [line for line in stderr.splitlines() if line.startswith("gitops-sless serve: ")]


def _serve_once(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    command = [sys.executable, "-m", "gitops_sless", "serve", "--repo", str(tmp_path / "repo")]
    command += ["--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_bubblewrap_that_cannot_run_refuses_to_start_in_one_line(tmp_path):
    (tmp_path / "repo").mkdir()
    done = _serve_once(tmp_path, "--sandbox", "bubblewrap", env=_fake_bwrap(tmp_path))
    assert done.returncode == 2
    assert _errors(done.stderr) == [
        "gitops-sless serve: --sandbox bubblewrap: "
        f"{tmp_path}/bin/bwrap failed: bwrap: setting up uid map: Permission denied"
    ]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        pytest.param(["--sandbox", "off", "--previews"], {}, id="flag"),
        pytest.param(["--previews"], {"SLESS_SANDBOX": "off"}, id="environment"),
    ],
)
def test_previews_refuse_an_unconfined_local_backend(tmp_path, args, env):
    (tmp_path / "repo").mkdir()
    done = _serve_once(tmp_path, *args, env={**os.environ, **env})
    assert done.returncode == 2
    (line,) = _errors(done.stderr)
    assert "--previews: pull requests' code would run unconfined" in line
    assert "--preview-trust all" in line


def test_a_misspelt_sandbox_in_the_environment_is_a_usage_error(tmp_path):
    (tmp_path / "repo").mkdir()
    done = _serve_once(tmp_path, env={**os.environ, "SLESS_SANDBOX": "bwrap"})
    assert done.returncode == 2
    assert "$SLESS_SANDBOX 'bwrap': use one of auto, bubblewrap, off" in done.stderr


def test_auto_without_bubblewrap_warns_once_and_runs_unconfined(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "README").write_text("no functions yet\n")
    server = SlessServer(
        str(tmp_path / "repo"),
        tmp_path / "state",
        env={"PATH": _fake_bwrap(tmp_path)["PATH"]},
        args=["--sandbox", "auto", "--previews", "--preview-trust", "all"],
    )
    try:
        server.start()
        assert server.client.get("/api/v1/status").json()["sandbox"] == "off"
        deadline = time.monotonic() + 10
        while "UNCONFINED" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.output().count("UNCONFINED") == 1
        assert "setting up uid map: Permission denied" in server.output()
    finally:
        server.stop()
    assert server.process is not None and server.process.returncode in (0, -signal.SIGTERM)
