"""Builds that do not repeat work: a sless.yaml edit builds nothing, dependencies install once.

Real git repositories, real pip and npm, no network: the Python dependency is a
local package built by its own in-tree PEP 517 backend (which appends a line to
a counter file each time an installer builds it, and can be told to sleep), the
Node one a packed tarball; both live outside the function folder, as a package
from an index would.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from gitops_sless.kube.backend import KubeBackend
from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.connect import connect
from gitops_sless.local.backend import LocalBackend
from gitops_sless.local.builder import BuildCancelled, BuildResult, LocalBuilder
from gitops_sless.local.gc import collect
from gitops_sless.local.secrets import SecretsDir
from gitops_sless.manifests import load as manifest
from gitops_sless.manifests.dependencies import dependencies
from gitops_sless.manifests.model import Function
from gitops_sless.source.snapshot import DirectorySnapshot, Snapshot, open_snapshot
from gitops_sless.state.routes import RouteTable

from .. import gitserver
from ..gitserver import GitDaemon, WorkRepo, init_bare
from ..kube_harness import NAMESPACE
from ..kube_harness import settings as kube_settings
from ..kubeapi import FakeKube
from ..kubeapi.kaniko import build_args, run_build
from ..local.test_local_builder import make_wheel
from ..s3server import S3Server
from ..sless_server import SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

PKG = "sless_counted"
BACKEND = '''"""An in-tree build backend: counts its builds, may sleep or wait for a gate
file, writes a pure wheel."""
import base64, hashlib, json, os, time, zipfile
from pathlib import Path

CONFIG = json.loads((Path(__file__).resolve().parent / "config.json").read_text())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = CONFIG["name"]
    with open(CONFIG["counter"], "a") as f:
        f.write(f"{os.getpid()} {os.getpgrp()}\\n")
    time.sleep(CONFIG["sleep"])
    deadline = time.time() + 300
    while CONFIG.get("gate") and not os.path.exists(CONFIG["gate"]) and time.time() < deadline:
        time.sleep(0.05)
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"ANSWER = {CONFIG['answer']}\\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\\nName: {name}\\nVersion: 1.0\\n".encode(),
        f"{dist}/WHEEL": (
            b"Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    wheel = f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as out:
        for path, data in files.items():
            out.writestr(path, data)
    return wheel
'''
PYPROJECT = '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
PY_HANDLER = f"import {PKG}\n\ndef main(event):\n    return {{'answer': {PKG}.ANSWER, 'v': %r}}\n"
NODE_HANDLER = "exports.main = async () => ({answer: require('tinydep').answer, v: %r});\n"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pip and npm read these from the environment: no index, no registry, no user config."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("npm_config_offline", "true")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))


class Package:
    """The local Python package: where it is, and how many times an installer built it."""

    def __init__(
        self, root: Path, answer: int = 42, sleep: float = 0, gate: Path | None = None
    ) -> None:
        """``gate``: builds wait until this file exists (as long as a test wants)."""
        self.path = root
        self.counter = root.parent / f"{root.name}.builds"
        root.mkdir(parents=True)
        (root / "backend.py").write_text(BACKEND)
        (root / "pyproject.toml").write_text(PYPROJECT)
        config = {"name": PKG, "counter": str(self.counter), "sleep": sleep, "answer": answer}
        if gate is not None:
            config["gate"] = str(gate)
        (root / "config.json").write_text(json.dumps(config))

    def builds(self) -> list[tuple[int, int]]:
        """(pid, process group) of each build so far."""
        if not self.counter.exists():
            return []
        return [
            (int(pid), int(pgid))
            for pid, pgid in (line.split() for line in self.counter.read_text().splitlines())
        ]


def py_manifest(name: str, *extra: str) -> str:
    lines = ["functions:", f"  - name: {name}", "    runtime: python3.11"]
    return "\n".join([*lines, "    entrypoint: handler.main", *extra]) + "\n"


def py_function(folder: str, version: str, requirements: str | None) -> dict[str, str | None]:
    return {
        f"{folder}/sless.yaml": py_manifest(folder),
        f"{folder}/handler.py": PY_HANDLER % version,
        f"{folder}/requirements.txt": requirements,
    }


def commit(repo: WorkRepo, files: dict[str, str | None]) -> Snapshot:
    repo.commit("change", {k: v for k, v in files.items() if v is not None or _exists(repo, k)})
    return open_snapshot(repo.path)


def _exists(repo: WorkRepo, rel: str) -> bool:
    return (repo.path / rel).exists()


def functions(snapshot: Snapshot) -> dict[str, Function]:
    state = manifest.load(snapshot)
    assert not state.invalid, state.problems
    return state.functions


def run_python(artifact: Path) -> dict[str, object]:
    """Call the handler of a Python artifact the way the runtime loads it."""
    code = "import handler, json; print(json.dumps(handler.main({})))"
    env = {**os.environ, "PYTHONPATH": f"{artifact}:{artifact / '.sless-deps'}"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=artifact, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "state" / "artifacts"


@pytest.fixture
def repo(tmp_path: Path) -> WorkRepo:
    return WorkRepo(tmp_path / "repo")


# --- identity: sless.yaml is not part of the build --------------------------------------


BASE = {"jobs": "    jobs: [{name: setup, runId: 1, event: {}}]", "env": "    env: {GREETING: hi}"}


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"jobs": "    jobs: [{name: setup, runId: 2, event: {}}]"}, id="runId-bump"),
        pytest.param({"env": "    env: {GREETING: 'hello again'}"}, id="env-change"),
        pytest.param({"replicas": "    replicas: 3", "memory": "    memoryMB: 256"}, id="sizes"),
        pytest.param({"cron": "    triggers: [{type: cron, schedule: '0 2 * * *'}]"}, id="trigger"),
    ],
)
def test_an_edit_of_sless_yaml_alone_keeps_the_build_tag(repo, changes):
    files = py_function("fn", "v1", None) | {"fn/sless.yaml": py_manifest("fn", *BASE.values())}
    before = functions(commit(repo, files))["fn"]
    edited = py_manifest("fn", *(BASE | changes).values())
    after = functions(commit(repo, {"fn/sless.yaml": edited}))["fn"]

    assert after != before  # the manifest did change...
    assert (after.source_id, after.build_tag) == (before.source_id, before.build_tag)


def test_a_code_change_or_a_nested_manifest_changes_the_build_tag(repo):
    before = functions(commit(repo, py_function("fn", "v1", None)))["fn"]
    code = functions(commit(repo, {"fn/handler.py": PY_HANDLER % "v2"}))["fn"]
    assert code.build_tag != before.build_tag
    # a folder inside the function folder with its own sless.yaml is a file of the outer one
    inner = py_function("fn/inner", "v1", None) | {"fn/inner/sless.yaml": py_manifest("inner")}
    nested = functions(commit(repo, inner))
    renamed = functions(commit(repo, {"fn/inner/sless.yaml": py_manifest("inner2")}))
    assert nested["fn"].build_tag != code.build_tag
    assert renamed["fn"].build_tag != nested["fn"].build_tag
    assert renamed["inner2"].build_tag == nested["inner"].build_tag


def test_a_manifest_edit_builds_nothing_and_the_artifact_has_no_manifest(repo, root):
    snapshot = commit(repo, py_function("fn", "v1", None))
    builder = LocalBuilder(root)
    first = builder.build(functions(snapshot)["fn"], snapshot)
    edited = commit(repo, {"fn/sless.yaml": py_manifest("fn", "    replicas: 2")})
    again = builder.build(functions(edited)["fn"], edited)
    assert again.cached and again.path == first.path
    assert not (first.path / "sless.yaml").exists()
    assert (first.path / "handler.py").exists()


# --- the dependency cache, Python -------------------------------------------------------


def test_a_code_change_with_the_same_requirements_installs_nothing(tmp_path, repo, root):
    package = Package(tmp_path / "pkg")
    requirements = f"{package.path}\n"
    v1 = commit(repo, py_function("fn", "v1", requirements))
    builder = LocalBuilder(root)
    first = builder.build(functions(v1)["fn"], v1)
    assert len(package.builds()) == 1
    assert "dependencies: installing python3.11-" in first.log

    v2 = commit(repo, {"fn/handler.py": PY_HANDLER % "v2"})
    fn = functions(v2)["fn"]
    second = builder.build(fn, v2)

    assert second.tag != first.tag and not second.cached
    assert len(package.builds()) == 1  # no installer ran for v2
    assert "pip install" not in second.log
    key = builder.marker(second.tag)["dependencies"]
    assert key == builder.marker(first.tag)["dependencies"] == dependencies(fn, v2).key
    assert f"dependencies: reusing {key} (installed by build {first.tag}" in second.log
    assert run_python(second.path) == {"answer": 42, "v": "v2"}
    assert run_python(first.path) == {"answer": 42, "v": "v1"}
    # the same files on disk, not a second copy
    module = Path(".sless-deps") / PKG / "__init__.py"
    assert (second.path / module).stat().st_ino == (first.path / module).stat().st_ino
    # and a restarted builder reuses them as well
    v3 = commit(repo, {"fn/handler.py": PY_HANDLER % "v3"})
    third = LocalBuilder(root).build(functions(v3)["fn"], v3)
    assert len(package.builds()) == 1 and run_python(third.path)["v"] == "v3"


def test_a_requirements_change_installs_again(tmp_path, repo, root):
    old, new = Package(tmp_path / "old", answer=1), Package(tmp_path / "new", answer=2)
    v1 = commit(repo, py_function("fn", "v1", f"{old.path}\n"))
    builder = LocalBuilder(root)
    first = builder.build(functions(v1)["fn"], v1)

    v2 = commit(repo, {"fn/requirements.txt": f"{new.path}\n"})
    second = builder.build(functions(v2)["fn"], v2)

    assert len(old.builds()) == 1 and len(new.builds()) == 1
    assert builder.marker(second.tag)["dependencies"] != builder.marker(first.tag)["dependencies"]
    assert run_python(second.path)["answer"] == 2
    assert run_python(first.path)["answer"] == 1  # the old artifact keeps its own
    assert "dependencies: installing" in second.log


def tiny_wheel(answer: int) -> bytes:
    """The wheel of ``sless_tinypkg`` whose ``ANSWER`` is ``answer``."""
    source = zipfile.ZipFile(io.BytesIO(make_wheel()))
    files = {name: source.read(name) for name in source.namelist()}
    files["sless_tinypkg/__init__.py"] = f"ANSWER = {answer}\n".encode()
    record = "sless_tinypkg-1.0.dist-info/RECORD"
    files[record] = (
        b"".join(
            f"{name},sha256={_digest(data)},{len(data)}\n".encode()
            for name, data in files.items()
            if name != record
        )
        + f"{record},,\n".encode()
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return out.getvalue()


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_a_requirement_inside_the_folder_installs_again_when_any_file_changes(repo, root):
    wheel = "vendored/sless_tinypkg-1.0-py3-none-any.whl"
    files = py_function("fn", "v1", f"./{wheel}\n") | {f"fn/{wheel}": tiny_wheel(42)}
    v1 = commit(repo, files | {"fn/handler.py": "def main(event):\n    return 1\n"})
    builder = LocalBuilder(root)
    first = builder.build(functions(v1)["fn"], v1)
    deps = dependencies(functions(v1)["fn"], v1)
    assert deps is not None
    assert deps.whole_folder == f"requirements.txt:1 names the path ./{wheel}"

    # the same requirements.txt, another wheel behind it: must not reuse the old install
    v2 = commit(repo, {f"fn/{wheel}": tiny_wheel(43)})
    second = builder.build(functions(v2)["fn"], v2)

    assert builder.marker(second.tag)["dependencies"] != builder.marker(first.tag)["dependencies"]
    assert "dependencies: installing" in second.log
    init = second.path / ".sless-deps/sless_tinypkg/__init__.py"
    assert init.read_text() == "ANSWER = 43\n"


def test_two_builds_of_the_same_dependencies_at_once_install_them_once(tmp_path, repo, root):
    package = Package(tmp_path / "pkg", sleep=1)
    requirements = f"{package.path}\n"
    files = py_function("a", "a", requirements) | py_function("b", "b", requirements)
    snapshot = commit(repo, files)
    fns = functions(snapshot)
    assert fns["a"].build_tag != fns["b"].build_tag
    builder = LocalBuilder(root)
    barrier = threading.Barrier(2)
    results: dict[str, BuildResult] = {}

    def build(name: str) -> None:
        barrier.wait()
        results[name] = builder.build(fns[name], snapshot)

    threads = [threading.Thread(target=build, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(package.builds()) == 1
    assert sorted("dependencies: installing" in r.log for r in results.values()) == [False, True]
    assert run_python(results["a"].path)["v"] == "a" and run_python(results["b"].path)["v"] == "b"


def test_a_function_without_requirements_skips_the_cache(repo, root):
    snapshot = commit(repo, py_function("fn", "v1", None))
    result = LocalBuilder(root).build(functions(snapshot)["fn"], snapshot)
    assert "dependencies" not in result.log
    assert LocalBuilder(root).marker(result.tag)["dependencies"] is None
    assert not (root / ".deps").exists()


def test_the_collector_removes_dependencies_no_artifact_uses(tmp_path, repo, root):
    old, new = Package(tmp_path / "old", answer=1), Package(tmp_path / "new", answer=2)
    v1 = commit(repo, py_function("fn", "v1", f"{old.path}\n"))
    builder = LocalBuilder(root)
    first = builder.build(functions(v1)["fn"], v1)
    v2 = commit(repo, {"fn/requirements.txt": f"{new.path}\n"})
    second = builder.build(functions(v2)["fn"], v2)
    old_key = builder.marker(first.tag)["dependencies"]
    new_key = builder.marker(second.tag)["dependencies"]

    kept = collect(builder, tmp_path / "logs", {first.tag}, set(), keep=0)
    assert kept.removed_tags == [second.tag] and kept.removed_dependencies == [new_key]
    assert builder.deps.installed() == [old_key]

    gone = collect(builder, tmp_path / "logs", set(), set(), keep=0)
    assert gone.removed_dependencies == [old_key]
    assert gone.reclaimed_bytes > 0  # counted once the last link to the files went
    assert builder.deps.installed() == [] and builder.tags() == []


def test_an_artifact_outlives_the_dependencies_it_was_linked_from(tmp_path, repo, root):
    package = Package(tmp_path / "pkg")
    snapshot = commit(repo, py_function("fn", "v1", f"{package.path}\n"))
    builder = LocalBuilder(root)
    result = builder.build(functions(snapshot)["fn"], snapshot)
    assert builder.deps.remove(builder.marker(result.tag)["dependencies"])
    assert run_python(result.path)["answer"] == 42


# --- the dependency cache, Node -----------------------------------------------------------


def npm_package(path: Path, answer: int) -> Path:
    """A packed npm package (``npm pack`` layout: everything below ``package/``)."""
    files = {
        "package/package.json": json.dumps({"name": "tinydep", "version": "1.0.0"}).encode(),
        "package/index.js": f"exports.answer = {answer};\n".encode(),
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def node_function(folder: str, version: str, tarball: Path) -> dict[str, str | None]:
    package = {"name": folder, "version": "1.0.0", "dependencies": {"tinydep": f"file:{tarball}"}}
    return {
        f"{folder}/sless.yaml": py_manifest(folder).replace("python3.11", "nodejs20"),
        f"{folder}/handler.js": NODE_HANDLER % version,
        f"{folder}/package.json": json.dumps(package),
    }


def counting(tmp_path: Path, program: str) -> tuple[str, Path]:
    """A stand-in for ``program`` that notes each run, then runs the real one."""
    counter = tmp_path / f"{program}.runs"
    script = tmp_path / f"counting-{program}"
    script.write_text(f'#!/bin/sh\necho run >> {counter}\nexec {program} "$@"\n')
    script.chmod(0o755)
    return str(script), counter


def run_node(artifact: Path) -> dict[str, object]:
    code = "require('./handler').main({}).then(r => console.log(JSON.stringify(r)))"
    out = subprocess.run(["node", "-e", code], cwd=artifact, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_node_dependencies_install_once_per_package_json(tmp_path, repo, root):
    one, two = npm_package(tmp_path / "one.tgz", 1), npm_package(tmp_path / "two.tgz", 2)
    npm, runs = counting(tmp_path, "npm")
    builder = LocalBuilder(root, npm=npm)
    v1 = commit(repo, node_function("fn", "v1", one))
    first = builder.build(functions(v1)["fn"], v1)
    assert run_node(first.path) == {"answer": 1, "v": "v1"}

    v2 = commit(repo, {"fn/handler.js": NODE_HANDLER % "v2"})
    second = builder.build(functions(v2)["fn"], v2)
    assert runs.read_text().count("run") == 1  # the code changed, package.json did not
    assert run_node(second.path) == {"answer": 1, "v": "v2"}
    assert "dependencies: reusing nodejs20-" in second.log

    v3 = commit(repo, node_function("fn", "v2", two))
    third = builder.build(functions(v3)["fn"], v3)
    assert runs.read_text().count("run") == 2
    assert run_node(third.path) == {"answer": 2, "v": "v2"}


# --- shutdown -------------------------------------------------------------------------------


def group_running(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that still run (a zombie waiting to be reaped does not)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            found.append(int(proc.name))
    return found


def wait_for(check, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_closing_the_backend_stops_a_running_install_at_once(tmp_path, repo):
    backend = LocalBackend(tmp_path / "state", RouteTable(), SecretsDir(None))
    package = Package(tmp_path / "pkg", sleep=600)
    snapshot = commit(repo, py_function("fn", "v1", f"{package.path}\n"))
    fn = functions(snapshot)["fn"]
    raised: list[BaseException] = []

    def build() -> None:
        try:
            backend.build(fn, snapshot)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    try:
        (_, pgid), *_ = wait_for(package.builds, "pip to build the package")
        assert group_running(pgid)
    finally:
        backend.close()

    # right away: nothing of the installer's process group runs, nothing half-built is left
    assert group_running(pgid) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pgid, 0)  # pip itself, the group's leader, is reaped too
    root = backend.builder.root
    assert not backend.builder.is_built(fn.build_tag)
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []
    assert not (root / fn.build_tag).exists()
    assert backend.builder.deps.installed() == []
    thread.join(10)
    assert not thread.is_alive()
    assert [type(exc) for exc in raised] == [BuildCancelled]
    # and no build starts any more
    later = commit(repo, {"fn/handler.py": "def main(event):\n    return 1\n"})
    with pytest.raises(BuildCancelled):
        backend.build(functions(later)["fn"], later)


# --- end to end: serve and git push ---------------------------------------------------------


def builds_total(server: SlessServer) -> float:
    text = server.client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sless_builds_total")
    )


SERVE_HANDLER = f"""import json, os, {PKG}

def main(event):
    return {{"greeting": os.environ["GREETING"], "answer": {PKG}.ANSWER}}

def stamp(event):
    with open(os.environ["STAMPS"], "a") as f:
        f.write(json.dumps(event) + "\\n")
    return event
"""


def serve_files(stamps: Path, greeting: str, run_id: int, requirements: str) -> dict[str, str]:
    return {
        "fn/handler.py": SERVE_HANDLER,
        "fn/requirements.txt": requirements,
        "fn/sless.yaml": (
            "functions:\n"
            "  - name: greet\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            f"    env: {{GREETING: {greeting!r}}}\n"
            "    triggers: [{type: http}]\n"
            "  - name: stamper\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.stamp\n"
            f"    env: {{STAMPS: {str(stamps)!r}}}\n"
            f"    jobs: [{{name: stamp, runId: {run_id}, event: {{run: {run_id}}}}}]\n"
        ),
    }


def test_serve_applies_a_sless_yaml_edit_without_a_build(
    tmp_path: Path, git_daemon: GitDaemon, git_root: Path
):
    package = Package(tmp_path / "pkg")
    stamps = tmp_path / "stamps"
    init_bare(git_root / "functions.git")
    url = git_daemon.url("functions.git")
    work = WorkRepo(tmp_path / "work")
    work.commit("v1", serve_files(stamps, "hello", 1, f"{package.path}\n"))
    work.git("push", "--quiet", url, "HEAD:main")
    env = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    # the package is a folder of the host, and it counts its builds in a file of the host
    server = SlessServer(url, tmp_path / "state", env=env, args=["--sandbox", "off"])
    try:
        server.start()
        server.wait(lambda: server.call("greet").status_code == 200, "greet to answer")
        assert server.call("greet").json() == {"greeting": "hello", "answer": 42}
        server.wait(lambda: stamps.exists(), "the job to run")
        before = server.function("greet")
        built = builds_total(server)
        assert built >= 1 and len(package.builds()) == 1

        # a new env value and a runId bump: both take effect, nothing is built
        work.commit("env and runId", serve_files(stamps, "hello again", 2, f"{package.path}\n"))
        work.git("push", "--quiet", url, "HEAD:main")
        server.sync()
        server.wait(
            lambda: server.call("greet").json().get("greeting") == "hello again", "the new env"
        )
        server.wait(lambda: len(stamps.read_text().splitlines()) == 2, "the job to run again")

        after = server.function("greet")
        assert after["buildTag"] == before["buildTag"]
        assert builds_total(server) == built
        assert len(package.builds()) == 1  # pip never ran again
        artifacts = tmp_path / "state" / "artifacts"
        folders = [p.name for p in artifacts.iterdir() if p.is_dir()]
        assert sorted(folders) == sorted([".deps", after["buildTag"]])
    finally:
        server.stop()


# --- what an install reads ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        pytest.param(
            {"requirements.txt": "requests==2.31\nflask>=3 ; python_version > '3'\n"},
            None,
            id="index-packages",
        ),
        pytest.param(
            {"requirements.txt": "/srv/wheels/x-1.0-py3-none-any.whl\n"}, None, id="absolute-path"
        ),
        pytest.param(
            {"requirements.txt": "-e .\n"},
            "requirements.txt:1 names the path .",
            id="the-folder-itself",
        ),
        pytest.param(
            {"requirements.txt": "-r base.txt\n", "base.txt": "requests\n"},
            "requirements.txt:1 names base.txt, a file of the folder",
            id="included-file",
        ),
        pytest.param(
            {"requirements.txt": "--find-links wheels/\nx\n", "wheels/x.whl": "w"},
            "requirements.txt:1 names wheels/, a file of the folder",
            id="find-links",
        ),
        pytest.param(
            {"requirements.txt": "x @ file:lib/x\n", "lib/x/setup.py": ""},
            "requirements.txt:1 names lib/x, a file of the folder",
            id="file-url",
        ),
        pytest.param(
            {"package.json": '{"dependencies": {"left-pad": "^1.3.0"}}'}, None, id="npm-registry"
        ),
        pytest.param(
            {"package.json": '{"dependencies": {"x": "file:/srv/x.tgz"}}'}, None, id="npm-absolute"
        ),
        pytest.param(
            {"package.json": '{"dependencies": {"x": "file:./x"}}'},
            "package.json dependencies.x is the path file:./x",
            id="npm-file",
        ),
        pytest.param(
            {"package.json": '{"devDependencies": {"x": "../x"}}'},
            "package.json devDependencies.x is the path ../x",
            id="npm-relative",
        ),
        pytest.param(
            {"package.json": '{"scripts": {"postinstall": "node build.js"}}'},
            "package.json has a postinstall script",
            id="npm-script",
        ),
        pytest.param(
            {"package.json": '{"workspaces": ["a"]}'},
            "package.json declares workspaces",
            id="npm-workspaces",
        ),
        pytest.param(
            {"package.json": "{}", "binding.gyp": "{}"},
            "the folder has a binding.gyp",
            id="node-gyp",
        ),
        pytest.param({"package.json": "{,"}, "package.json is not valid JSON", id="npm-bad-json"),
    ],
)
def test_what_an_install_may_read(tmp_path, files, reason):
    runtime = "nodejs20" if "package.json" in files else "python3.11"
    handler = "handler.js" if runtime == "nodejs20" else "handler.py"
    folder = tmp_path / "repo" / "fn"
    code = "exports.main = () => 1;\n" if runtime == "nodejs20" else "def main(e):\n    pass\n"
    for rel, text in {**files, handler: code, "sless.yaml": py_manifest("fn")}.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text.replace("python3.11", runtime))
    snapshot = DirectorySnapshot(tmp_path / "repo")
    fn = functions(snapshot)["fn"]

    deps = dependencies(fn, snapshot)

    assert deps is not None and deps.whole_folder == reason
    if reason is None:
        assert set(deps.files) == set(files) - {"binding.gyp"}
    # a change elsewhere in the folder keeps the key only when the install cannot read it
    (folder / handler).write_text(
        code + ("// changed\n" if handler == "handler.js" else "# changed\n")
    )
    changed = DirectorySnapshot(tmp_path / "repo")
    again = dependencies(functions(changed)["fn"], changed)
    assert again is not None and (again.key == deps.key) == (reason is None)


def test_the_dependency_key_follows_the_lock_file_and_npmrc(tmp_path, repo):
    first = commit(repo, node_function("fn", "v1", tmp_path / "x.tgz"))
    locked = commit(repo, {"fn/package-lock.json": '{"lockfileVersion": 3}'})
    npmrc = commit(repo, {"fn/.npmrc": "registry=https://npm.example/\n"})
    found = [dependencies(functions(s)["fn"], s) for s in (first, locked, npmrc)]
    assert len({d.key for d in found if d}) == 3
    assert found[2] is not None
    assert found[2].files == (".npmrc", "package-lock.json", "package.json")


# --- Kubernetes: the install is a layer kaniko's cache reuses ------------------------------


@pytest.fixture
def kube_backend(fake_kube: FakeKube, s3_server: S3Server) -> KubeBackend:
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    backend = connect(kube_settings(fake_kube.kubeconfig, s3_server.config()), RouteTable())
    backend.builds.poll_sec = 0.1
    return backend


RUN_PIP = "RUN if [ -f requirements.txt ]; then"


def test_kaniko_reuses_the_install_for_a_code_change_and_not_for_new_requirements(
    repo, fake_kube: FakeKube, kube_backend: KubeBackend
):
    v1 = commit(repo, py_function("fn", "v1", "requests==2.31\n"))
    first = kube_backend.build(functions(v1)["fn"], v1)
    v2 = commit(repo, {"fn/handler.py": PY_HANDLER % "v2", "fn/sless.yaml": py_manifest("fn")})
    fn = functions(v2)["fn"]
    second = kube_backend.build(fn, v2)
    v3 = commit(repo, {"fn/requirements.txt": "requests==2.32\n"})
    third = kube_backend.build(functions(v3)["fn"], v3)

    assert f"No cached layer found for cmd {RUN_PIP}" in first
    assert f"Using caching version of cmd: {RUN_PIP}" in second
    assert f"No cached layer found for cmd {RUN_PIP}" in third
    context = fake_kube.build_contexts[f"contexts/{fn.build_tag}.tar.gz"]
    assert [m for m in context if m.startswith("deps")] == [
        "deps",
        "deps/.sless-deps-key",
        "deps/requirements.txt",
    ]
    assert "function/handler.py" in context and "function/sless.yaml" not in context


def test_a_dependency_file_naming_folder_files_puts_the_folder_in_deps(
    tmp_path, repo, fake_kube: FakeKube, kube_backend: KubeBackend
):
    files = py_function("fn", "v1", "./vendored/x.whl\n") | {"fn/vendored/x.whl": "wheel"}
    snapshot = commit(repo, files)
    fn = functions(snapshot)["fn"]
    kube_backend.build(fn, snapshot)
    context = fake_kube.build_contexts[f"contexts/{fn.build_tag}.tar.gz"]
    deps = sorted(m.removeprefix("deps/") for m in context if m.startswith("deps/"))
    assert deps == [
        ".sless-deps-key",
        "handler.py",
        "requirements.txt",
        "vendored",
        "vendored/x.whl",
    ]


def _context(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize(
    ("dockerfile", "args", "error"),
    [
        pytest.param(b"FROM x\nCOPY app/ /app/\n", [], None, id="copy-present"),
        pytest.param(
            b"FROM x\nCOPY deps/ /function/\n",
            [],
            "failed to get fileinfo for /kaniko/buildcontext/deps",
            id="copy-missing",
        ),
        pytest.param(
            b"FROM x\n",
            ["--cache-layers=true"],
            "Error: unknown flag: --cache-layers",
            id="unknown-flag",
        ),
    ],
)
def test_the_kaniko_imitation_refuses_what_kaniko_refuses(
    s3_server: S3Server, dockerfile, args, error
):
    key = f"imitation/{time.monotonic_ns()}.tar.gz"
    s3_server.client().put_object(
        Bucket=s3_server.bucket, Key=key, Body=_context({"Dockerfile": dockerfile, "app/a.py": b""})
    )
    container = {"args": [f"--context=s3://{s3_server.bucket}/{key}", "--destination=r/x:1", *args]}
    build = build_args({"spec": {"containers": [container]}})
    assert build is not None
    env = {
        "S3_ENDPOINT": s3_server.endpoint,
        "AWS_REGION": s3_server.region,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    ok, log = run_build(build, env, [], {}, {})
    assert ok == (error is None), log
    if error:
        assert error in log


def test_half_installed_dependencies_of_a_crashed_process_are_removed_on_start(
    tmp_path, repo, root
):
    package = Package(tmp_path / "pkg")
    snapshot = commit(repo, py_function("fn", "v1", f"{package.path}\n"))
    fn = functions(snapshot)["fn"]
    LocalBuilder(root).build(fn, snapshot)
    key = builder_key(root, fn.build_tag)
    cache = root / ".deps"
    # an install cut short, and one renamed into place whose marker was never written
    (cache / f".tmp-{key}-x1y2" / ".sless-deps").mkdir(parents=True)
    (cache / f".tmp-{key}-x1y2.out").write_text("pip output")
    (cache / "python3.11-0123456789abcdef01234567" / ".sless-deps").mkdir(parents=True)

    builder = LocalBuilder(root)

    assert sorted(p.name for p in cache.iterdir()) == [key]
    assert builder.deps.installed() == [key]


def builder_key(root: Path, tag: str) -> str:
    """The dependency key the artifact of ``tag`` was linked from."""
    return json.loads((root / tag / ".sless-build.json").read_text())["dependencies"]


def test_stopping_serve_during_an_install_stops_the_installer(
    tmp_path: Path, git_daemon: GitDaemon, git_root: Path
):
    package = Package(tmp_path / "pkg", sleep=600)
    init_bare(git_root / "functions.git")
    url = git_daemon.url("functions.git")
    work = WorkRepo(tmp_path / "work")
    work.commit("v1", serve_files(tmp_path / "stamps", "hello", 0, f"{package.path}\n"))
    work.git("push", "--quiet", url, "HEAD:main")
    env = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    # the package is a folder of the host, and it counts its builds in a file of the host
    server = SlessServer(url, tmp_path / "state", env=env, args=["--sandbox", "off"])
    try:
        server.start(wait_for_sync=False)
        (_, pgid), *_ = wait_for(package.builds, "pip to build the package")
        assert group_running(pgid)
    finally:
        server.stop()  # SIGTERM, as systemd or kubectl would

    assert group_running(pgid) == []
    artifacts = tmp_path / "state" / "artifacts"
    assert [p.name for p in artifacts.iterdir() if p.is_dir()] in ([], [".deps"])
    assert not (artifacts / ".deps").exists() or list((artifacts / ".deps").iterdir()) == []
