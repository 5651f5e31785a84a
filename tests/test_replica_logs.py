"""A replica's log file says when the reconciler killed it for its memory.

The kill is a line of the log, timestamped, so the log read alone (``gitops-sless logs``,
or the file) explains why the output stops and starts again.
"""

from __future__ import annotations

import re

from . import gitserver
from .test_local_memory import HOG, _manifest, served

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["served"]  # the fixture, shared with test_local_memory

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_an_oom_kill_is_a_timestamped_line_of_the_replicas_log(served):
    server = served(
        {"hog/handler.py": HOG, "hog/sless.yaml": _manifest("hog", "    triggers: [{type: http}]")}
    )
    assert server.call("hog", "/alloc").status_code >= 500  # killed under the call
    log = server.state_dir / "logs" / "prod" / "hog.log"
    server.wait(lambda: "killed" in log.read_text(), "the kill in the replica's log", 30)
    line = next(line for line in log.read_text().splitlines() if "killed" in line)
    assert re.fullmatch(
        rf"{STAMP} \[gitops-sless\] replica pid \d+ killed: OOMKilled: .*memoryMB=128 \(MiB\)",
        line,
    ), line
