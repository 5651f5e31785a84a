"""The local builder: real git objects, real pip and npm, no network.

Dependencies come from the function folder itself (a wheel made here, ``file:``
npm packages), and the installers are told to stay offline through their own
environment variables, which the builder passes through.
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from gitops_sless.errors import PermanentError
from gitops_sless.local.builder import (
    MARKER,
    BuildFailed,
    BuildResult,
    LocalBuilder,
    build_environment,
)
from gitops_sless.manifests import load as manifest
from gitops_sless.manifests.identity import source_id
from gitops_sless.manifests.model import Function
from gitops_sless.source.snapshot import DirectorySnapshot, Snapshot, open_snapshot

from ..gitserver import git

WHEEL_NAME = "sless_tinypkg-1.0-py3-none-any.whl"
PY_HANDLER = "import sless_tinypkg\n\ndef main(event):\n    return sless_tinypkg.ANSWER\n"


def py_manifest(name: str) -> str:
    return f"functions:\n  - name: {name}\n    runtime: python3.11\n    entrypoint: handler.main\n"


def node_manifest(name: str) -> str:
    return f"functions:\n  - name: {name}\n    runtime: nodejs20\n    entrypoint: handler.main\n"


def make_wheel() -> bytes:
    """A pure-Python wheel of ``sless_tinypkg`` (a zip pip installs without any build)."""
    files = {
        "sless_tinypkg/__init__.py": b"ANSWER = 42\n",
        "sless_tinypkg-1.0.dist-info/METADATA": (
            b"Metadata-Version: 2.1\nName: sless-tinypkg\nVersion: 1.0\n"
        ),
        "sless_tinypkg-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("sless_tinypkg-1.0.dist-info/RECORD,,")
    files["sless_tinypkg-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return buffer.getvalue()


def py_files(folder: str, name: str, requirements: str | None = None) -> dict[str, str | bytes]:
    files: dict[str, str | bytes] = {
        f"{folder}/sless.yaml": py_manifest(name),
        f"{folder}/handler.py": PY_HANDLER,
        f"{folder}/lib/util.py": "VALUE = 1\n",
    }
    if requirements is not None:
        files[f"{folder}/requirements.txt"] = requirements
        files[f"{folder}/vendored/{WHEEL_NAME}"] = make_wheel()
    return files


def node_files(folder: str, name: str) -> dict[str, str | bytes]:
    package = {
        "name": name,
        "version": "1.0.0",
        "dependencies": {"tinydep": "file:./vendored/tinydep"},
        "devDependencies": {"devonly": "file:./vendored/devonly"},
    }
    return {
        f"{folder}/sless.yaml": node_manifest(name),
        f"{folder}/handler.js": "exports.main = async () => require('tinydep').answer;\n",
        f"{folder}/package.json": json.dumps(package),
        f"{folder}/vendored/tinydep/package.json": '{"name": "tinydep", "version": "1.0.0"}',
        f"{folder}/vendored/tinydep/index.js": "exports.answer = 42;\n",
        f"{folder}/vendored/devonly/package.json": '{"name": "devonly", "version": "1.0.0"}',
        f"{folder}/vendored/devonly/index.js": "exports.dev = true;\n",
    }


def write(root: Path, files: Mapping[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def commit(root: Path, message: str = "change") -> None:
    if not (root / ".git").exists():
        git("init", "-q", "-b", "main", cwd=root)
    git("add", "-A", cwd=root)
    git("commit", "-q", "-m", message, cwd=root)


def load(snapshot: Snapshot) -> dict[str, Function]:
    state = manifest.load(snapshot)
    assert not state.invalid, state.problems
    return state.functions


def fake_python(tmp_path: Path, body: str) -> str:
    """An interpreter stand-in: a shell script the builder runs instead of ``python``."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pip and npm read these from the environment: no index, no registry, no user config."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("npm_config_offline", "true")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "state" / "artifacts"


# --- laying out and installing ------------------------------------------------------


def test_python_function_is_built_from_git_objects_with_its_dependencies(tmp_path, root):
    repo = write(tmp_path / "repo", py_files("fns/py", "py", f"./vendored/{WHEEL_NAME}\n"))
    write(repo, {"fns/py/run.sh": "#!/bin/sh\necho hi\n"})
    (repo / "fns/py/run.sh").chmod(0o755)
    os.symlink("lib/util.py", repo / "fns/py/util-link.py")
    commit(repo)
    # the work tree moves on after the commit; the build must not see it
    (repo / "fns/py/handler.py").write_text("uncommitted\n")
    (repo / "fns/py/extra.txt").write_text("uncommitted\n")
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]

    builder = LocalBuilder(root)
    result = builder.build(fn, snapshot)

    art = root / fn.build_tag
    assert result == BuildResult(fn.build_tag, art, result.log, result.duration_sec, False)
    assert builder.path(fn.build_tag) == art
    assert builder.is_built(fn.build_tag) and builder.tags() == [fn.build_tag]
    assert (art / "handler.py").read_text() == PY_HANDLER
    assert not (art / "extra.txt").exists()
    assert (art / "lib/util.py").read_text() == "VALUE = 1\n"
    assert os.stat(art / "run.sh").st_mode & stat.S_IXUSR
    assert not os.stat(art / "handler.py").st_mode & stat.S_IXUSR
    assert (art / "util-link.py").is_symlink()
    assert os.readlink(art / "util-link.py") == "lib/util.py"
    assert (art / "util-link.py").read_text() == "VALUE = 1\n"

    # the dependency is in the artifact and importable from there, not from the venv
    assert (art / ".sless-deps/sless_tinypkg/__init__.py").is_file()
    env = {**os.environ, "PYTHONPATH": str(art / ".sless-deps")}
    code = "import sless_tinypkg; print(sless_tinypkg.ANSWER, sless_tinypkg.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout
    assert out.startswith("42 " + str(art / ".sless-deps"))
    plain = subprocess.run([sys.executable, "-c", "import sless_tinypkg"], capture_output=True)
    assert plain.returncode != 0

    marker = json.loads((art / MARKER).read_text())
    assert marker["tag"] == fn.build_tag
    assert marker["runtime"] == "python3.11"
    assert marker["source_id"] == fn.source_id
    assert marker["revision"] == snapshot.revision
    assert "finished" in marker

    assert "pip install" in result.log and "exited 0" in result.log
    assert "sless_tinypkg" in result.log  # pip's own output is captured
    assert (root / f"{fn.build_tag}.log").read_text() == result.log
    assert not (art / "sless.yaml").exists()  # not part of the build: its edits build nothing
    # the artifact, its log, and the dependency cache its dependencies came from
    assert sorted(p.name for p in root.iterdir()) == [".deps", fn.build_tag, f"{fn.build_tag}.log"]
    assert [p.name for p in (root / ".deps").iterdir()] == [marker["dependencies"]]


def test_node_function_gets_its_dependencies_but_not_dev_dependencies(tmp_path, root):
    repo = write(tmp_path / "repo", node_files("fns/node", "node"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["node"]

    result = LocalBuilder(root).build(fn, snapshot)

    assert "npm install" in result.log and "exited 0" in result.log
    art = result.path
    assert (art / "node_modules/tinydep").exists()
    assert not (art / "node_modules/devonly").exists()
    out = subprocess.run(
        ["node", "-e", "console.log(require('tinydep').answer)"],
        cwd=art,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.strip() == "42"


def test_a_directory_builds_like_its_commit(tmp_path, root):
    files = py_files("fn", "plain")
    folder = write(tmp_path / "dir", files)
    repo = write(tmp_path / "repo", files)
    commit(repo)
    from_dir = load(DirectorySnapshot(folder))["plain"]
    from_git = load(open_snapshot(repo))["plain"]
    assert from_dir.build_tag == from_git.build_tag

    builder = LocalBuilder(root)
    result = builder.build(from_dir, DirectorySnapshot(folder))
    assert not result.cached
    assert (result.path / "handler.py").read_text() == PY_HANDLER
    assert not (result.path / ".sless-deps").exists()  # no requirements.txt, no pip
    assert "pip" not in result.log
    assert builder.build(from_git, open_snapshot(repo)).cached


def test_a_built_tag_is_never_built_again_also_after_a_restart(tmp_path, root):
    repo = write(tmp_path / "repo", py_files("fn", "py", f"./vendored/{WHEEL_NAME}\n"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    first = LocalBuilder(root).build(fn, snapshot)
    log_file = root / f"{fn.build_tag}.log"
    marker = (first.path / MARKER).read_text()
    stamp = log_file.stat().st_mtime_ns

    again = LocalBuilder(root).build(fn, snapshot)
    # an interpreter that cannot start proves that no installer runs
    restarted = LocalBuilder(root, python="/nonexistent/python", npm="/nonexistent/npm")
    third = restarted.build(fn, snapshot)

    for result in (again, third):
        assert result.cached and result.path == first.path
        assert result.log == first.log  # the log of the build that made the artifact
    assert log_file.stat().st_mtime_ns == stamp
    assert (first.path / MARKER).read_text() == marker
    print(f"fresh build {first.duration_sec:.3f} s, cached {third.duration_sec * 1000:.2f} ms")


# --- failures -----------------------------------------------------------------------


def test_a_failing_install_leaves_no_artifact_and_the_previous_one_alone(tmp_path, root):
    repo = write(tmp_path / "repo", py_files("fn", "py", f"./vendored/{WHEEL_NAME}\n"))
    commit(repo, "v1")
    good = load(open_snapshot(repo))["py"]
    builder = LocalBuilder(root)
    builder.build(good, open_snapshot(repo))
    good_files = sorted(str(p.relative_to(root)) for p in (root / good.build_tag).rglob("*"))

    (repo / "fn/requirements.txt").write_text("./vendored/missing-9.9-py3-none-any.whl\n")
    commit(repo, "v2")
    snapshot = open_snapshot(repo)
    bad = load(snapshot)["py"]
    with pytest.raises(BuildFailed) as caught:
        builder.build(bad, snapshot)

    exc = caught.value
    assert isinstance(exc, PermanentError)
    assert str(exc) == f"build {bad.build_tag} failed: pip install exited 1"
    assert exc.tag == bad.build_tag and exc.reason == "pip install exited 1"
    assert "missing-9.9-py3-none-any.whl" in exc.log_tail
    assert "does not exist" in exc.log_tail or "No such file" in exc.log_tail
    assert len(exc.log_tail) <= 4000
    assert not builder.is_built(bad.build_tag)
    assert not (root / bad.build_tag).exists()
    assert "FAILED: pip install exited 1" in (root / f"{bad.build_tag}.log").read_text()
    assert builder.tags() == [good.build_tag]
    assert builder.is_built(good.build_tag)
    assert sorted(str(p.relative_to(root)) for p in (root / good.build_tag).rglob("*")) == (
        good_files
    )
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


@pytest.fixture
def silent_index() -> Iterator[str]:
    """A package index that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/simple/"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_hanging_install_is_killed_at_the_deadline(tmp_path, root, monkeypatch, silent_index):
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", silent_index)
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    repo = write(tmp_path / "repo", py_files("fn", "py", "sless-never-answered==1.0\n"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    builder = LocalBuilder(root, timeout_sec=2)

    # the index never answers: only the build's own deadline ends it, and says so
    with pytest.raises(BuildFailed) as caught:
        builder.build(fn, snapshot)

    assert str(caught.value) == f"build {fn.build_tag} failed: pip install timed out after 2 s"
    assert not builder.is_built(fn.build_tag)
    assert [p for p in root.iterdir() if p.name != ".deps"] == [root / f"{fn.build_tag}.log"]
    assert list((root / ".deps").iterdir()) == []  # no half-installed dependencies
    deadline = time.monotonic() + 5
    while processes_mentioning(str(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning(str(root)) == []


@pytest.mark.parametrize(
    ("body", "outcome"),
    [
        ("sleep 7321 &\nsleep 7322", "timed out after 1 s"),  # hangs with a child
        ("sleep 7323 &\nexit 0", None),  # exits, leaving a child behind
    ],
    ids=["hangs", "leaves-a-child"],
)
def test_every_process_an_installer_started_is_gone_after_the_step(tmp_path, root, body, outcome):
    python = fake_python(tmp_path, body)
    repo = write(tmp_path / "repo", py_files("fn", "py", "anything\n"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    builder = LocalBuilder(root, timeout_sec=1, python=python)

    if outcome is None:
        assert not builder.build(fn, snapshot).cached
    else:
        with pytest.raises(BuildFailed, match=outcome):
            builder.build(fn, snapshot)

    deadline = time.monotonic() + 5
    while processes_mentioning("sleep 732") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning("sleep 732") == []


def test_a_folder_that_links_outside_itself_is_refused(tmp_path, root):
    # the loader refuses this folder too; the builder checks again on its own, so a
    # caller that skipped validation still cannot lay out a link that leaves the artifact
    folder = write(tmp_path / "dir", py_files("fn", "py"))
    os.symlink("..", folder / "fn/lib/up")
    os.symlink("lib/up/../..", folder / "fn/out")
    snapshot = DirectorySnapshot(folder)
    assert manifest.load(snapshot).invalid
    clean = write(tmp_path / "clean", py_files("fn", "py"))
    fn = replace(load(DirectorySnapshot(clean))["py"], source_id=source_id(snapshot, "fn"))

    with pytest.raises(BuildFailed, match="symlink out resolves outside the folder"):
        LocalBuilder(root).build(fn, snapshot)
    assert [p.name for p in root.iterdir()] == [f"{fn.build_tag}.log"]


# --- concurrency --------------------------------------------------------------------


def test_one_tag_asked_twice_at_once_is_built_once(tmp_path, root):
    calls = tmp_path / "calls"
    python = fake_python(tmp_path, f'echo "$$" >> {calls}\nsleep 0.5')
    repo = write(tmp_path / "repo", py_files("fn", "py", "anything\n"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    builder = LocalBuilder(root, python=python)
    barrier = threading.Barrier(2)
    results: list[BuildResult] = []

    def build() -> None:
        barrier.wait()
        results.append(builder.build(fn, snapshot))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(calls.read_text().split()) == 1
    assert sorted(r.cached for r in results) == [False, True]
    assert results[0].path == results[1].path and results[0].log == results[1].log


def test_the_waiting_caller_gets_the_same_failure(tmp_path, root):
    python = fake_python(tmp_path, "sleep 0.5\necho 'no luck' >&2\nexit 3")
    repo = write(tmp_path / "repo", py_files("fn", "py", "anything\n"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    builder = LocalBuilder(root, python=python)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def build() -> None:
        barrier.wait()
        try:
            builder.build(fn, snapshot)
        except BuildFailed as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [str(e) for e in errors] == [f"build {fn.build_tag} failed: pip install exited 3"] * 2
    assert "no luck" in errors[0].log_tail  # type: ignore[attr-defined]


def test_builds_beyond_max_concurrent_wait_for_a_slot(tmp_path, root):
    spans = tmp_path / "spans"
    stamp = "$(date +%s.%N)"
    python = fake_python(
        tmp_path, f'echo "$$ start {stamp}" >> {spans}\nsleep 0.3\necho "$$ end {stamp}" >> {spans}'
    )
    files: dict[str, str | bytes] = {}
    for i in range(3):
        files.update(py_files(f"fn{i}", f"fn{i}", f"dep{i}\n"))
    repo = write(tmp_path / "repo", files)
    commit(repo)
    snapshot = open_snapshot(repo)
    functions = load(snapshot)
    builder = LocalBuilder(root, max_concurrent=1, python=python)

    threads = [
        threading.Thread(target=builder.build, args=(fn, snapshot)) for fn in functions.values()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    times: dict[str, dict[str, float]] = {}
    for line in spans.read_text().splitlines():
        pid, what, at = line.split()
        times.setdefault(pid, {})[what] = float(at)
    spans_sorted = sorted((t["start"], t["end"]) for t in times.values())
    assert len(spans_sorted) == 3
    for (_, end), (start, _) in itertools.pairwise(spans_sorted):
        assert start >= end
    assert builder.tags() == sorted(fn.build_tag for fn in functions.values())


# --- housekeeping -------------------------------------------------------------------


def test_leftovers_of_a_crashed_process_are_removed_on_start(tmp_path, root):
    repo = write(tmp_path / "repo", py_files("fn", "py"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    LocalBuilder(root).build(fn, snapshot)
    write(root, {".tmp-python3.11-abc-x1y2/handler.py": "half", ".tmp-python3.11-abc-x1y2.out": ""})
    # renamed into place, crashed before the marker: not built, so not kept
    write(root, {"python3.11-0123456789abcdef01234567/handler.py": "half"})

    builder = LocalBuilder(root)

    assert sorted(p.name for p in root.iterdir()) == [fn.build_tag, f"{fn.build_tag}.log"]
    assert builder.tags() == [fn.build_tag]


def test_remove_deletes_an_artifact_and_its_log(tmp_path, root):
    repo = write(tmp_path / "repo", py_files("fn", "py"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]
    builder = LocalBuilder(root)
    builder.build(fn, snapshot)

    assert builder.remove(fn.build_tag) is True
    assert not builder.is_built(fn.build_tag)
    assert builder.tags() == []
    assert list(root.iterdir()) == []
    assert builder.remove(fn.build_tag) is False
    with pytest.raises(ValueError):
        builder.remove("../outside")
    assert not builder.build(fn, snapshot).cached  # removed means built again when asked


# --- environment --------------------------------------------------------------------


def test_installers_get_no_secrets_and_the_log_shows_none(tmp_path, root, monkeypatch):
    monkeypatch.setenv("SLESS_API_TOKEN", "tok-0123456789")
    monkeypatch.setenv("SLESS_STATE_DIR", "/srv/sless-state")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_abcdefghij")
    monkeypatch.setenv("DB_PASSWORD", "hunter2hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-very-secret")
    monkeypatch.setenv("https_proxy", "http://proxy.invalid:3128")
    # the installer learns a secret some other way and prints it: still scrubbed
    python = fake_python(
        tmp_path,
        "env\necho 'index https://bob:pa55word@pypi.invalid/simple'\necho 'db hunter2hunter2'",
    )
    repo = write(tmp_path / "repo", py_files("fn", "py", "anything\n"))
    commit(repo)
    snapshot = open_snapshot(repo)
    fn = load(snapshot)["py"]

    result = LocalBuilder(root, python=python).build(fn, snapshot)

    log = (root / f"{fn.build_tag}.log").read_text()
    assert log == result.log
    for secret in ("tok-0123456789", "ghp_abcdefghij", "hunter2", "aws-very-secret", "pa55word"):
        assert secret not in log
    for name in ("SLESS_", "GITHUB_TOKEN", "DB_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        assert name not in log
    assert f"PATH={os.environ['PATH']}" in log
    assert f"HOME={os.environ['HOME']}" in log
    assert "https_proxy=http://proxy.invalid:3128" in log
    assert "PIP_NO_INDEX=1" in log
    assert "https://bob:****@pypi.invalid/simple" in log
    assert "db ****" in log


def test_build_environment_rules():
    env, dropped = build_environment(
        {
            "PATH": "/bin",
            "PYTHONPATH": "/x",
            "KEYS_PATH": "/keys",
            "HOME": "/root",
            "SLESS_HOME": "/opt/sless",
            "npm_config__authToken": "t0ken",
            "SSH_PRIVATE_KEY": "k",
        }
    )
    assert env == {
        "PATH": "/bin",
        "PYTHONPATH": "/x",
        "KEYS_PATH": "/keys",
        "HOME": "/root",
        "npm_config_update_notifier": "false",
    }
    assert sorted(dropped) == ["/opt/sless", "k", "t0ken"]
