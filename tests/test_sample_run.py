"""The README's main job as a new user runs it (issue 33 items 1 and 2): ``scripts/run``
brings every sample function to Ready on the first run (the notes functions get their
throwaway PostgreSQL, scripts/sample-db), ``gitops-sless status`` in a second shell finds
the server's token by itself and exits 0, and stopping scripts/run stops the database.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

from .gitserver import free_port
from .paths import ROOT

BANNER_END = "to redeploy, push to the repository this server follows"
ROW = re.compile(r"^  (\w+)\s+(?:curl \S+/fn/prod/([\w-]+)/|([\w-]+) \(no http trigger\))$")


def _wait(what: str, predicate, timeout: float, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout}s:\n{log.read_text(errors='replace')[-6000:]}")


def _postgres_running(state: Path) -> bool:
    moved = state / "sample-db-location"  # run as root below a folder nobody may enter
    home = Path(moved.read_text().strip()) if moved.exists() else state / "sample-db"
    pid_file = home / "data" / "postmaster.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text().split()[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_scripts_run_serves_every_sample_function_ready_and_status_exits_zero(tmp_path):
    state, port, log = tmp_path / "state", free_port(), tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    with log.open("wb") as out:
        run = subprocess.Popen(
            [str(ROOT / "scripts" / "run"), "--listen", f"127.0.0.1:{port}"],
            env={**env, "SLESS_STATE_DIR": str(state)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait("banner", lambda: BANNER_END in log.read_text(errors="replace"), 600, log)
        rows = [ROW.match(line) for line in log.read_text(errors="replace").splitlines()]
        phases = {m[2] or m[3]: m[1] for m in rows if m}
        assert len(phases) == 20, phases
        assert set(phases.values()) == {"Ready"}, phases
        assert _postgres_running(state)

        # a second shell: nothing but where the state is and where the server listens
        shell = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        shell |= {"SLESS_STATE_DIR": str(state), "SLESS_SERVER": f"http://127.0.0.1:{port}"}
        status = subprocess.run(
            [sys.executable, "-m", "gitops_sless", "status"],
            env=shell,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert "notes-py" in status.stdout and "Pending" not in status.stdout

        # the notes functions share the sample's database
        base = f"http://127.0.0.1:{port}/fn/prod"
        added = httpx.get(f"{base}/notes-py/add", params={"title": "from a test"}, timeout=30)
        assert added.status_code == 201, added.text
        listed = httpx.get(f"{base}/notes-js/list", timeout=30).json()
        assert "from a test" in [note["title"] for note in listed["notes"]]

        # the ticker streams its events (python and node alike)
        for ticker in ("ticker-py", "ticker-js"):
            events = httpx.get(f"{base}/{ticker}/", params={"n": "2"}, timeout=30)
            assert events.headers["content-type"] == "text/event-stream", ticker
            assert events.text == (
                'event: tick\nid: 1\ndata: {"n":1,"of":2}\n\n'
                'event: tick\nid: 2\ndata: {"n":2,"of":2}\n\n'
                "event: end\ndata: done\n\n"
            ), ticker

        # the echo functions answer over WebSockets, and tell one socket about another
        ws_base = base.replace("http://", "ws://")
        for echo in ("echo-py", "echo-js"):
            with connect(f"{ws_base}/{echo}/", open_timeout=30) as one:
                assert _ask(one, "hi") == "hi", echo
                with connect(f"{ws_base}/{echo}/", open_timeout=30) as two:
                    assert _ask(two, "hello all") == "said hello to 1", echo
                    assert one.recv(timeout=10).endswith(" says hello"), echo

        # SIGUSR2 to scripts/run restarts serve in place: the database and the notes stay
        run.send_signal(signal.SIGUSR2)
        _wait(
            "a second banner",
            lambda: log.read_text(errors="replace").count(BANNER_END) == 2,
            120,
            log,
        )
        assert "replica.adopted" in log.read_text(errors="replace")
        listed = httpx.get(f"{base}/notes-js/list", timeout=30).json()
        assert "from a test" in [note["title"] for note in listed["notes"]]
        assert run.poll() is None and _postgres_running(state)
    finally:
        run.send_signal(signal.SIGTERM)  # what a service manager sends: scripts/run only
        code = run.wait(timeout=60)
    assert code == 0, log.read_text(errors="replace")[-3000:]
    assert not _postgres_running(state), "scripts/run left the sample's database running"


def _ask(ws, message: str) -> str:
    ws.send(message)
    return str(ws.recv(timeout=10))


def test_sample_db_says_what_is_missing_and_how_it_is_called(tmp_path, capsys):
    """Without PostgreSQL it exits 3 and says so (scripts/run then serves without it:
    the notes functions wait for a DSN, as with a database of your own); misused, 2."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("sample_db", str(ROOT / "scripts/sample-db"))
    spec = importlib.util.spec_from_loader("sample_db", loader)
    assert spec is not None
    sample_db = importlib.util.module_from_spec(spec)
    loader.exec_module(sample_db)
    sample_db.binary = lambda name: None  # a machine with no PostgreSQL
    assert sample_db.main(["sample-db", "start", str(tmp_path)]) == 3
    assert "PostgreSQL is not installed (scripts/setup installs it)" in capsys.readouterr().err
    assert not (tmp_path / "sample-secrets").exists()  # no DSN that points nowhere
    assert sample_db.main(["sample-db", "restart", str(tmp_path)]) == 2
    assert "usage: scripts/sample-db start|stop STATE_DIR" in capsys.readouterr().err
    assert sample_db.main(["sample-db", "stop", str(tmp_path)]) == 0  # nothing running: done
