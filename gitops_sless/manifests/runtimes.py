"""The runtimes a function can name, read from ``runtimes/<name>/runtime.json``.

A runtime's version is the git tree id of its folder: any change to the
server, the runner or the Dockerfile's pinned base image gives new build tags,
so a stale base image can never be reused by accident.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .. import paths
from ..errors import RuntimeNotFound
from ..source.snapshot import DirectorySnapshot

__all__ = ["Runtime", "available", "get", "reload"]

CONTAINER_DIR = "/opt/sless"


@dataclass(frozen=True)
class Runtime:
    """One language runtime: how to find handler files and how to start them."""

    name: str
    folder: Path
    version: str
    extension: str
    interpreter: str
    server: str
    runner: str
    dependency_file: str

    def container_command(self, role: str) -> list[str]:
        """The command of the server (``role="server"``) or runner in the image."""
        script = self.server if role == "server" else self.runner
        return [self.interpreter, f"{CONTAINER_DIR}/{script}"]


def _load(folder: Path) -> Runtime:
    try:
        spec = json.loads((folder / "runtime.json").read_text())
        return Runtime(
            name=spec["name"],
            folder=folder,
            version=DirectorySnapshot(folder).tree_id(""),
            extension=spec["extension"],
            interpreter=spec["interpreter"],
            server=spec["server"],
            runner=spec["runner"],
            dependency_file=spec["dependencyFile"],
        )
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeNotFound(f"{folder}/runtime.json: unreadable or incomplete: {exc}") from exc


@cache
def _all(root: Path) -> dict[str, Runtime]:
    found = {}
    for runtime_json in sorted(root.glob("*/runtime.json")):
        runtime = _load(runtime_json.parent)
        found[runtime.name] = runtime
    return found


def available() -> dict[str, Runtime]:
    """Every runtime of the runtimes folder, by name."""
    return _all(paths.runtimes_dir())


def reload() -> None:
    """Read the runtimes folder again (it is read once per process otherwise)."""
    _all.cache_clear()


def get(name: str) -> Runtime:
    try:
        return available()[name]
    except KeyError:
        raise RuntimeNotFound(f"runtime {name!r} is not one of {sorted(available())}") from None
