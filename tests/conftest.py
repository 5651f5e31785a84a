"""Generic helpers shared by the test modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from gitops_sless.local.units import ProcessSpec
from gitops_sless.manifests import runtimes

from .kubeapi.fixtures import fake_kube  # noqa: F401 - the test Kubernetes API server
from .oci_registry import oci_registry  # noqa: F401 - a real image registry, per test
from .s3server import s3_server  # noqa: F401 - a session fixture, started on first use

WriteRepo = Callable[..., Path]


def write_files(root: Path, files: Mapping[str, str | bytes]) -> Path:
    """Write ``files`` (relative POSIX path -> text or bytes) below ``root``; return ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return root


def is_sandbox(pid: int) -> bool:
    """Whether ``pid`` is a bubblewrap process that holds a function's process.

    Every sandboxed replica or job is two processes, bwrap and the runtime in it,
    and both name the function (bwrap's command line its artifact, its environment
    the function's): a count of what a user calls replicas leaves bwrap out.
    """
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "bwrap"
    except OSError:
        return False


def processes_under(folder: Path) -> list[int]:
    """Live pids whose working directory or command line is below ``folder``, with their groups."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (proc / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue  # a zombie is gone, only not yet reaped by its parent
            cwd = str((proc / "cwd").readlink())
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(part.startswith(str(folder)) for part in (cwd, *args)):
            found.append(int(proc.name))
    return with_their_groups(found)


def runtimes_under(folder: Path) -> list[int]:
    """The runtime processes below ``folder``: what a user counts as replicas."""
    return [pid for pid in processes_under(folder) if not is_sandbox(pid)]


def with_their_groups(pids: list[int]) -> list[int]:
    """``pids`` and every live process in their process groups.

    Inside its sandbox a function's runtime sees its folder as ``/function``: only the
    bwrap that holds it names the host folder, and the runtime is in bwrap's group.
    """
    leaders = {str(pid) for pid in pids}
    found = list(pids)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in pids:
            continue
        try:
            fields = (proc / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[2] in leaders and fields[0] != "Z":
            found.append(int(proc.name))
    return found


@pytest.fixture
def write_repo(tmp_path: Path) -> WriteRepo:
    """``write_repo(files, root=None) -> Path``: files written below ``tmp_path/repo``."""

    def write(files: Mapping[str, str | bytes], root: Path | None = None) -> Path:
        return write_files(tmp_path / "repo" if root is None else root, files)

    return write


def python_spec(
    folder: Path,
    source: str,
    *,
    name: str | None = None,
    entrypoint: str = "handler.main",
    memory_mb: int | None = None,
    env_vars: Mapping[str, str] | None = None,
) -> ProcessSpec:
    """A python3.11 function of ``prod`` in ``folder`` (made, with ``source`` as its
    handler.py), as the local backend's supervisor runs it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "handler.py").write_text(source)
    return ProcessSpec(
        env_name="prod",
        function=name or folder.name,
        runtime=runtimes.get("python3.11"),
        entrypoint=entrypoint,
        artifact=folder,
        timeout_sec=30,
        env_vars=dict(env_vars or {}),
        memory_mb=memory_mb,
    )
