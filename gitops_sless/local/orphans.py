"""Process groups this reconciler started, on disk, so a restart can stop the orphans.

A reconciler killed outright (SIGKILL, OOM) cannot stop its children: runtime
servers keep their ports and half-done installers keep running, and would
finish a build the new process also starts. Each child is started in its own
session (so its pid is its process group id) and recorded here with its
start time; the next process kills every recorded group whose leader is gone
or still the same process, and never a recycled pid that now runs something
else. (Start times, not command lines: npm and others rewrite their title.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Collection
from pathlib import Path

__all__ = ["ProcessGroups"]


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # the name in parentheses may hold spaces


class ProcessGroups:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, pid: int, command: list[str]) -> None:
        record = {"command": command, "started": _start_time(pid)}
        (self.folder / str(pid)).write_text(json.dumps(record))

    def remove(self, pid: int) -> None:
        (self.folder / str(pid)).unlink(missing_ok=True)

    def stop_orphans(self, keep: Collection[int] = ()) -> int:
        """Kill every recorded group but ``keep`` (adopted: see ``adoption``); returns how
        many were still there."""
        stopped = 0
        for entry in self.folder.iterdir():
            pid = int(entry.name) if entry.name.isdigit() else 0
            if pid in keep:
                continue
            try:
                started = json.loads(entry.read_text()).get("started")
            except (ValueError, AttributeError):
                started = None
            running = _start_time(pid) if pid else None
            # a live leader that started at another time is a recycled pid: leave it alone
            if pid and (running is None or running == started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                    stopped += 1
            entry.unlink(missing_ok=True)
        return stopped
