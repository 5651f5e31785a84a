"""A replica's log file: every line timestamped, and the reconciler's own lines in it.

Each line a replica prints (stdout or stderr, ``print()`` or a raw write) is
``<RFC 3339 UTC ms> [replica <port>] <line>``: the replicas of a function share
its log, and the id tells whose line it is. A kill for memory and a replica that ended are
lines of the log too, after the replica's last line, so the log read alone
(``gitops-sless logs``, or the file) explains why the output stops and starts
again.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import gitserver
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


CHATTY = """
import os, sys

print("imported", flush=True)

def main(event, context=None):
    what = event["_path"].strip("/")
    if what == "say":
        print("to stdout")
        print("to stderr", file=sys.stderr)
        os.write(1, b"first half, ")
        os.write(1, b"second half\\nand a line with no newline")
        return {"ok": True}
    if what == "die":
        os.write(1, b"last words\\n")
        os._exit(3)
    return {"ok": True}
"""

BROKEN = """
print("starting up")
raise RuntimeError("the config is missing")


def main(event):  # never reached: the import fails first
    return event
"""


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines()


def _text(line: str) -> str:
    """The line as printed: without its time, the replica that printed it and the ids
    of the request it was serving."""
    assert re.match(rf"{STAMP} ", line), line
    tags = r"^\[replica \d+\] (\[request_id=\S+ trace_id=[0-9a-f]{32}\] )?"
    return re.sub(tags, "", line.split(" ", 1)[1])


def _replica(line: str) -> str | None:
    found = re.match(rf"{STAMP} \[replica (\d+)\] ", line)
    return found and found.group(1)


def test_every_line_a_replica_prints_is_timestamped(served):
    server = served(
        {
            "chat/handler.py": CHATTY,
            "chat/sless.yaml": _manifest("chat", "    triggers: [{type: http}]"),
        }
    )
    assert server.call("chat", "/say").json() == {"ok": True}
    log = server.state_dir / "logs" / "prod" / "chat.log"
    # a line with no newline is written once it has waited a moment, as a line of its own
    server.wait(lambda: "and a line with no newline" in log.read_text(), "the partial line", 10)
    texts = [_text(line) for line in _lines(log)]
    assert texts[0] == "imported"
    for said in ("to stdout", "to stderr", "first half, second half", "and a line with no newline"):
        assert said in texts, texts


def test_a_replica_that_dies_leaves_its_last_line_then_why_it_ended(served):
    server = served(
        {
            "chat/handler.py": CHATTY,
            "chat/sless.yaml": _manifest("chat", "    triggers: [{type: http}]"),
        }
    )
    assert server.call("chat", "/die").status_code >= 500
    log = server.state_dir / "logs" / "prod" / "chat.log"
    server.wait(lambda: "ended: exited with code 3" in log.read_text(), "the exit in the log", 30)
    texts = [_text(line) for line in _lines(log)]
    last = texts.index("last words")
    ended = re.fullmatch(
        r"\[gitops-sless\] replica pid \d+ on port (\d+) ended: exited with code 3; "
        r"restarting in [\d.]+s",
        texts[last + 1],
    )
    assert ended, texts
    # its lines name the replica that printed them: the one the note says ended
    assert _replica(_lines(log)[last]) == ended.group(1)

    # the log goes on across the restart: the new replica's lines follow
    def restarted() -> bool:
        return "imported" in [_text(line) for line in _lines(log)][last + 2 :]

    server.wait(restarted, "the restarted replica's first line", 30)


def test_a_start_that_fails_names_its_cause_and_the_log_keeps_the_traceback(served):
    server = served(
        {
            "bad/handler.py": BROKEN,
            "bad/sless.yaml": _manifest("bad", "    triggers: [{type: http}]"),
        }
    )
    server.wait(lambda: (server.function("bad") or {}).get("phase") == "Failed", "bad to fail", 60)
    message = server.function("bad")["message"]
    assert "handler.py:3: RuntimeError: the config is missing" in message, message
    texts = [_text(line) for line in _lines(server.state_dir / "logs" / "prod" / "bad.log")]
    assert texts[0] == "starting up"
    assert "RuntimeError: the config is missing" in texts
    assert any(
        re.fullmatch(
            r"\[gitops-sless\] replica pid \d+ ended before it was healthy: "
            r"exited with code 1",
            t,
        )
        for t in texts
    ), texts
