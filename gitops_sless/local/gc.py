"""Garbage collection of the state folder: artifacts, build logs and replica logs.

Kept: every artifact an environment uses or a replica runs, every build in
progress, and the newest ``keep`` builds of each function folder (so a revert
to a recent version starts without a build). Everything else goes: older
artifacts with their build logs, logs of failed builds nobody uses, installed
dependencies no artifact links to any more (nor a build in progress), and the
replica logs of functions no environment has any more. (A log never passes
its cap: its writer rotates it, see ``logfiles``.)
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .. import logs
from .builder import LocalBuilder

__all__ = ["Collected", "collect"]

log = logging.getLogger(__name__)


@dataclass
class Collected:
    removed_tags: list[str] = field(default_factory=list)
    removed_dependencies: list[str] = field(default_factory=list)
    removed_logs: list[str] = field(default_factory=list)
    reclaimed_bytes: int = 0


def collect(
    builder: LocalBuilder,
    logs_dir: Path,
    in_use: set[str],
    live_functions: set[tuple[str, str]],
    keep: int,
) -> Collected:
    """Delete what nothing uses; ``in_use`` tags and ``live_functions`` (env, name) stay."""
    out = Collected()
    protected = in_use | builder.building()
    for tag in _unwanted_tags(builder, protected, keep):
        size = _size(builder.path(tag)) + _size(builder.log_path(tag))
        try:
            if builder.remove(tag):
                out.removed_tags.append(tag)
                out.reclaimed_bytes += size
        except RuntimeError:  # its build started meanwhile
            continue
    _dependencies(builder, out)
    for stray in _stray_build_logs(builder, protected):
        out.reclaimed_bytes += _size(stray)
        stray.unlink(missing_ok=True)
        out.removed_logs.append(str(stray))
    out.reclaimed_bytes += _replica_logs(logs_dir, live_functions, out)
    if out.removed_tags or out.removed_dependencies or out.removed_logs:
        logs.event(
            log,
            "gc.finished",
            f"removed {len(out.removed_tags)} artifacts, "
            f"{len(out.removed_dependencies)} installed dependencies and "
            f"{len(out.removed_logs)} logs, {out.reclaimed_bytes} bytes reclaimed",
        )
    return out


def _unwanted_tags(builder: LocalBuilder, protected: set[str], keep: int) -> list[str]:
    groups: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for tag in builder.tags():
        marker = builder.marker(tag)
        # artifacts built before markers named their folder form one group per source
        folder = marker.get("folder", "?" + str(marker.get("source_id")))
        groups[(str(marker.get("runtime")), str(folder))].append(
            (str(marker.get("finished", "")), tag)
        )
    unwanted = []
    for builds in groups.values():
        newest_first = [tag for _, tag in sorted(builds, reverse=True)]
        unwanted += [tag for tag in newest_first[keep:] if tag not in protected]
    return sorted(unwanted)


def _dependencies(builder: LocalBuilder, out: Collected) -> None:
    """Remove installed dependencies that no remaining artifact was built with."""
    linked = {builder.marker(tag).get("dependencies") for tag in builder.tags()}
    for key in builder.deps.installed():
        if key in linked:
            continue
        size = _size(builder.deps.path(key))
        try:
            if builder.deps.remove(key):
                out.removed_dependencies.append(key)
                out.reclaimed_bytes += size
        except RuntimeError:  # a build started using them meanwhile
            continue


def _stray_build_logs(builder: LocalBuilder, protected: set[str]) -> Iterable[Path]:
    built = set(builder.tags())
    for path in builder.root.glob("*.log"):
        tag = path.name.removesuffix(".log")
        if tag not in built and tag not in protected:
            yield path


def _replica_logs(logs_dir: Path, live: set[tuple[str, str]], out: Collected) -> int:
    reclaimed = 0
    for path in logs_dir.glob("*/*.log"):
        key = (path.parent.name, path.name.removesuffix(".log"))
        size = _size(path)
        if key not in live:
            path.unlink(missing_ok=True)
            out.removed_logs.append(str(path))
            reclaimed += size
    return reclaimed


def _size(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            # a file hard-linked elsewhere too (installed dependencies) frees
            # nothing yet; it counts when its last link goes
            if st.st_nlink <= 1:
                total += st.st_size
    return total
