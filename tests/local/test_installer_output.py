"""What an install step prints cannot freeze the reconciler or grow its build log.

A ``package.json`` ``preinstall`` script can print anything. One line of
256 KiB stopped ``/fn/`` and ``/healthz`` for 58 s: the scrubber's regex
backtracked over it while holding the GIL (see tests/test_redact.py). Here a
preinstall prints a single line of 6 MiB (letters only: the old scrubber's
worst case), a password in a URL, and a last line, through a real ``serve``
and its sandbox. The reconciler must answer ``/healthz`` while the build runs
and after the output was handled, keep a bounded build log that ends with
the last line (the password masked), and finish the build.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from gitops_sless.local.installers import OUTPUT_BYTES

from .. import gitserver
from .test_local_memory import served

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["served"]  # the fixture, shared with test_local_memory

MiB = 1 << 20

# run by npm in the install folder (the sandbox's, bound to one below the state folder)
FLOOD = """
const fs = require('fs');
process.stdout.write('FIRST-BYTES' + 'a'.repeat(6 << 20) + '\\n');
process.stdout.write('index https://bob:hunter2-pw@registry.invalid/ used\\n');
process.stdout.write('the last line of the preinstall\\n');
fs.writeFileSync('printed', '');
let waited = 0;
const timer = setInterval(() => {
  if (fs.existsSync('go')) { clearInterval(timer); return; }
  if (++waited > 3000) { process.exit(7); }  // nobody said go: fail the build
}, 100);
"""

FILES = {
    "flood/sless.yaml": (
        "functions:\n"
        "  - {name: flood, runtime: nodejs20, entrypoint: handler.main, "
        "triggers: [{type: http}]}\n"
    ),
    "flood/package.json": json.dumps(
        {"name": "flood", "version": "1.0.0", "scripts": {"preinstall": "node flood.js"}}
    ),
    "flood/flood.js": FLOOD,
    "flood/handler.js": "exports.main = async () => ({ok: true});\n",
}


def _install_folder(state: Path, name: str) -> Path | None:
    found = list((state / "artifacts").rglob(name))
    return found[0].parent if found else None


class _Health:
    """Asks ``/healthz`` again and again from its own thread; every answer is kept."""

    def __init__(self, server) -> None:
        self.server = server
        self.answers: list[int | str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.answers.append(self.server.client.get("/healthz").status_code)
            except Exception as exc:  # a timeout: the reconciler did not answer
                self.answers.append(repr(exc))
            self._stop.wait(0.05)

    def stop(self) -> list[int | str]:
        self._stop.set()
        self._thread.join()
        return self.answers


def test_a_preinstall_printing_one_line_of_megabytes_freezes_nothing(served):
    server = served(FILES)
    state = server.state_dir
    folder = server.wait(lambda: _install_folder(state, "printed"), "the preinstall to print")
    # the whole line went through the pipe (the preinstall wrote its marker after it)
    assert server.client.get("/healthz").status_code == 200
    function = server.function("flood")
    assert function is None or function["phase"] != "Ready"  # still building
    health = _Health(server)
    try:
        (folder / "go").write_text("")
        server.wait(lambda: server.call("flood").status_code == 200, "the build to finish", 300)
    finally:
        answers = health.stop()
    # ordering: the reconciler answered while the output was handled and the build ended
    assert answers and all(a == 200 for a in answers), answers
    assert server.call("flood").json() == {"ok": True}
    tag = server.function("flood")["buildTag"]
    log = (state / "artifacts" / f"{tag}.log").read_text()
    assert len(log.encode()) <= OUTPUT_BYTES + 64 * 1024
    assert "FIRST-BYTES" not in log and "a" * 1024 not in log  # the huge line was cut whole
    assert "bytes of its output left out" in log
    assert "index https://bob:****@registry.invalid/ used" in log and "hunter2" not in log
    assert "the last line of the preinstall" in log
    # the API serves the same bounded log
    size = server.client.get(f"/api/v1/builds/{tag}/log").json()["size"]
    assert size == len(log.encode())
    end = server.client.get(f"/api/v1/builds/{tag}/log", params={"offset": max(0, size - 4096)})
    assert "the last line of the preinstall" in end.json()["text"]
