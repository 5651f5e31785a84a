"""Process groups this reconciler started, on disk, so a restart can stop the orphans.

A reconciler killed outright (SIGKILL, OOM) cannot stop its children: runtime
servers keep their ports and half-done installers keep running, and would
finish a build the new process also starts. Each child is started in its own
session (so its pid is its process group id) and recorded here; the next
process kills every recorded group whose leader is gone or still the same
program, and never a recycled pid that now runs something else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

__all__ = ["ProcessGroups"]


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


class ProcessGroups:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, pid: int, command: list[str]) -> None:
        (self.folder / str(pid)).write_text(json.dumps(command))

    def remove(self, pid: int) -> None:
        (self.folder / str(pid)).unlink(missing_ok=True)

    def stop_orphans(self) -> int:
        """Kill every recorded group; returns how many were still there."""
        stopped = 0
        for entry in self.folder.iterdir():
            pid = int(entry.name) if entry.name.isdigit() else 0
            try:
                command = json.loads(entry.read_text() or "[]")
            except ValueError:
                command = None
            running = _cmdline(pid) if pid else None
            # a live leader running another program is a recycled pid: leave it alone
            if pid and (running is None or running == command):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                    stopped += 1
            entry.unlink(missing_ok=True)
        return stopped
