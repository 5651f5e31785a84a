"""The commands that talk to a running server, run as a user runs them.

One real ``gitops-sless serve`` following a real git daemon serves the module
(started once: the tests only read it, call its functions, or diff copies of
its repository); the tests that push something broken get a server of their
own. The CLI runs as a subprocess wherever exit codes, standard streams or a
terminal matter.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gitops_sless import cli
from gitops_sless.cli import completion

from .. import gitserver
from ..gitserver import GitDaemon, WorkRepo, free_port, init_bare
from ..paths import ROOT
from ..sless_server import TOKEN, SlessServer
from ..test_serve import HTTP, manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

ANSI = re.compile(r"\x1b\[[0-9;]*m")

GREET = """
import json, os

def main(event, context):
    name = event.get("name") or event["_query"].get("name") or "nobody"
    print(f"greeting {name}", flush=True)
    return {
        "message": f"{os.environ['GREETING']}, {name}",
        "path": event["_path"],
        "query": event["_query"],
        "method": event["_method"],
    }
"""

WORKER = """
import json, os

def stamp(event):
    return {"mark": event["mark"]}

def show(event):
    return {"seen": json.loads(os.environ["STAMP"])["mark"]}
"""


def repository(greeting: str = "hello", run_id: int = 1) -> dict[str, str]:
    return {
        "greet/handler.py": GREET,
        "greet/sless.yaml": manifest(
            "greet", HTTP, "    env: {GREETING: " + json.dumps(greeting) + "}"
        ),
        "worker/handler.py": WORKER,
        "worker/sless.yaml": (
            "functions:\n"
            "  - name: worker\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.stamp\n"
            "    jobs:\n"
            f"      - {{name: stamp, runId: {run_id}, event: {{mark: run-{run_id}}}}}\n"
            "  - name: shower\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.show\n"
            "    env: {STAMP: {job: stamp}}\n"
            "    triggers: [{type: http}]\n"
            "  - name: resting\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.show\n"
            "    enabled: false\n"
        ),
    }


@dataclass
class Stack:
    server: SlessServer
    work: WorkRepo

    def copy(self, tmp_path: Path) -> Path:
        """The pushed repository as a plain folder to change and diff."""
        target = tmp_path / "copy"
        shutil.copytree(self.work.path, target, ignore=shutil.ignore_patterns(".git"))
        return target


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("cli-server")
    with GitDaemon(base / "served") as daemon:
        init_bare(base / "served" / "functions.git")
        url = daemon.url("functions.git")
        work = WorkRepo(base / "work")
        work.commit("functions", repository())
        work.push(url)
        server = SlessServer(url, base / "state")
        try:
            server.start()
            server.wait(lambda: server.function("shower"), "shower")
            yield Stack(server, work)
        finally:
            server.stop()


def run(
    *args: str,
    server: SlessServer | str | None = None,
    token: str | None = TOKEN,
    cwd: Path = ROOT,
    stdin: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env.pop("NO_COLOR", None)
    if token:
        env["SLESS_API_TOKEN"] = token
    if server is not None:
        env["SLESS_SERVER"] = server if isinstance(server, str) else server.base
    return subprocess.run(
        [sys.executable, "-m", "gitops_sless", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        input=stdin,
        timeout=timeout,
    )


def in_process(capsys, monkeypatch, server: SlessServer, *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("SLESS_SERVER", server.base)
    monkeypatch.setenv("SLESS_API_TOKEN", TOKEN)
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def in_a_terminal(*args: str, server: SlessServer, timeout: float = 60) -> str:
    """Run the CLI with stdout and stderr on a pseudo-terminal; return what it showed."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env.pop("NO_COLOR", None)
    env.update(SLESS_SERVER=server.base, SLESS_API_TOKEN=TOKEN, TERM="xterm", COLUMNS="200")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gitops_sless", *args],
        stdout=follower,
        stderr=follower,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    os.close(follower)
    shown = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the terminal closed: the process is done
                    break
                if not data:
                    break
                shown += data
            elif proc.poll() is not None:
                break
        proc.wait(10)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return shown.decode(errors="replace")


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- status ---------------------------------------------------------------------------------------


def test_status_lists_every_function_and_exits_zero_when_all_are_ready_or_disabled(stack):
    result = run("status", server=stack.server)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "\x1b[" not in result.stdout  # no colour into a pipe
    rows = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[3:]}
    assert rows == {
        "NAME": "PHASE",
        "greet": "Ready",
        "resting": "Disabled",
        "shower": "Ready",
        "worker": "Ready",
    }
    assert "prod: last sync Succeeded" in result.stdout

    as_json = json.loads(run("status", "-o", "json", server=stack.server).stdout)
    assert as_json["ok"] is True
    assert (as_json["server"], as_json["status"]["branch"]) == (stack.server.base, "main")
    (prod,) = as_json["environments"]
    assert prod["name"] == "prod"
    assert prod["jobs"] == []  # stamp run 1 succeeded: nothing to show
    assert "JOB" not in result.stdout
    assert {fn["name"]: fn["phase"] for fn in prod["functions"]}["resting"] == "Disabled"


def test_status_of_an_unknown_environment_says_which_there_are(stack):
    result = run("status", "--env", "staging", server=stack.server)
    assert result.returncode == 2
    assert one_line_error(result) == (
        "gitops-sless status: the server has no environment 'staging' (it has: prod)"
    )


def test_status_colours_phases_on_a_terminal_only(stack):
    shown = in_a_terminal("status", server=stack.server)
    assert "\x1b[32mReady" in shown
    assert "greet" in ANSI.sub("", shown)


# --- diff -----------------------------------------------------------------------------------------


def test_diff_of_what_the_server_runs_is_empty(stack, tmp_path):
    folder = stack.copy(tmp_path)
    result = run("diff", str(folder), server=stack.server)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "no changes: 4 functions up to date"

    at_head = run("diff", str(stack.work.path), "--ref", "HEAD", server=stack.server)
    assert at_head.returncode == 0, at_head.stdout + at_head.stderr
    assert f"commit {stack.work.head()}" in at_head.stdout


def test_diff_names_each_change_without_showing_literal_values(stack, tmp_path):
    folder = stack.copy(tmp_path)
    greet = folder / "greet" / "sless.yaml"
    greet.write_text(
        manifest(
            "greet",
            HTTP,
            '    env: {GREETING: "a very secret greeting", EXTRA: "x"}',
            "    replicas: 2",
            "    memoryMB: 256",
        )
    )
    (folder / "greet" / "handler.py").write_text(GREET + "\n# changed\n")
    worker = folder / "worker" / "sless.yaml"
    worker.write_text(
        worker.read_text()
        .replace("runId: 1, event: {mark: run-1}", "runId: 2, event: {mark: run-2}")
        .replace("  - name: resting\n", "  - name: resting-renamed\n")
    )
    (folder / "added").mkdir()
    (folder / "added" / "handler.py").write_text(GREET)
    (folder / "added" / "sless.yaml").write_text(manifest("added", HTTP))

    result = run("diff", str(folder), server=stack.server)

    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "a very secret greeting" not in out
    assert "~ changed greet" in out
    assert re.search(r"image: python3\.11-\w+ -> python3\.11-\w+", out)
    assert "replicas: 1 -> 2" in out
    assert "memoryMB: 128 -> 256" in out
    assert "env.GREETING: value changed (literal values are not shown)" in out
    assert "env.EXTRA: added (literal)" in out
    assert "+ added   added  python3.11-" in out
    assert "- removed resting" in out
    # a runId bump alone is no build: the tag leaves sless.yaml out
    assert re.search(r"^job +stamp run 2 of worker$", out, re.M)
    assert "env.STAMP: result of job stamp -> result of job stamp run 2" in out
    assert re.search(r"^build +python3\.11-\w+  greet: greet$", out, re.M)
    # worker's own spec is the same (a runId is not part of it), shower takes the new result;
    # added has greet's old files, so its build exists already
    assert "~ changed worker" not in out and "~ changed shower" in out
    assert out.splitlines()[-1] == (
        "changes: 1 build, 2 added, 2 changed, 1 removed, 1 job run; 1 unchanged"
    )

    as_json = json.loads(run("diff", str(folder), "-o", "json", server=stack.server).stdout)
    assert as_json["hasChanges"] is True
    assert as_json["removed"] == ["resting"]
    assert [(job["name"], job["runId"]) for job in as_json["jobs"]] == [("stamp", 2)]
    assert sorted(fn["name"] for fn in as_json["added"]) == ["added", "resting-renamed"]


def test_diff_reports_an_invalid_manifest_as_a_change_with_its_problems(stack, tmp_path):
    folder = stack.copy(tmp_path)
    (folder / "greet" / "sless.yaml").write_text(manifest("greet", HTTP, "    memoryMB: -10"))
    result = run("diff", str(folder), server=stack.server)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "! invalid greet/sless.yaml: keeps the last good version of greet (Invalid)\n"
        "    greet/sless.yaml:6: functions[0].memoryMB: -10 is less than the minimum of 64\n"
    ) in result.stdout
    assert "removed" not in result.stdout  # greet keeps running
    assert result.stdout.splitlines()[-1] == "changes: 1 invalid manifest; 3 unchanged"


def test_diff_against_an_unknown_environment_is_exit_two_with_the_known_ones(stack):
    result = run("diff", "sample-repo", "--env", "nope", server=stack.server)
    assert result.returncode == 2, result.stdout  # never a diff that adds every function
    assert result.stdout == ""
    assert one_line_error(result) == (
        "gitops-sless diff: the server has no environment 'nope' (it has: prod)"
    )


def test_diff_of_a_folder_that_is_not_there_is_an_error(stack, tmp_path):
    result = run("diff", str(tmp_path / "missing"), server=stack.server)
    assert result.returncode == 2
    assert "no such file or directory" in one_line_error(result)


# --- logs -----------------------------------------------------------------------------------------


def test_logs_of_a_replica_show_what_the_function_printed(stack, capsys, monkeypatch):
    marker = uuid.uuid4().hex[:8]
    assert stack.server.call("greet", params={"name": marker}).status_code == 200
    code, out, _ = in_process(capsys, monkeypatch, stack.server, "logs", "prod/greet")
    assert code == 0
    assert f"greeting {marker}\n" in out
    assert "serving handler.main" in out  # the runtime's own start-up line

    code, out, err = in_process(capsys, monkeypatch, stack.server, "logs", "prod/nope")
    assert code == 1
    assert err == "gitops-sless logs: no function 'nope' in environment 'prod'\n"


def test_logs_of_a_build_and_of_a_job(stack, capsys, monkeypatch):
    code, out, _ = in_process(capsys, monkeypatch, stack.server, "logs", "greet", "--build")
    tag = stack.server.function("greet")["buildTag"]
    assert code == 0
    assert f"build {tag}: folder greet (python3.11): function greet at " in out
    assert f"built {tag} in" in out

    code, out, _ = in_process(
        capsys, monkeypatch, stack.server, "logs", "prod/worker", "--job", "stamp"
    )
    assert code == 0
    head, *result = out.splitlines()
    assert head.startswith("stamp run 1: Succeeded (attempt 1, ")
    assert json.loads("\n".join(result)) == {"mark": "run-1"}

    code, _, err = in_process(
        capsys, monkeypatch, stack.server, "logs", "prod/greet", "--job", "stamp"
    )
    assert (code, err) == (
        1,
        "gitops-sless logs: job 'stamp' belongs to function 'worker', not 'greet'\n",
    )


def test_logs_of_a_function_without_replicas_say_so_and_show_its_job_runs(
    stack, capsys, monkeypatch
):
    code, out, err = in_process(capsys, monkeypatch, stack.server, "logs", "prod/worker")
    assert code == 0
    assert err == (
        "gitops-sless logs: prod/worker has no replicas (no http trigger), so no replica log; "
        "its job runs follow (--job JOB for one of them, --build for its build log)\n"
    )
    head, *result = out.splitlines()
    assert head.startswith("stamp run 1: Succeeded (attempt 1, ")
    assert json.loads("\n".join(result)) == {"mark": "run-1"}

    code, out, err = in_process(capsys, monkeypatch, stack.server, "logs", "prod/resting")
    assert (code, out) == (0, "")
    assert err.endswith(
        "so no replica log; it has no job runs either (--build shows its build log)\n"
    )


def test_a_build_log_shared_by_a_folder_names_the_folder_and_every_function(
    stack, capsys, monkeypatch
):
    tag = stack.server.function("shower")["buildTag"]
    assert stack.server.function("worker")["buildTag"] == tag  # one folder, one build
    code, out, _ = in_process(capsys, monkeypatch, stack.server, "logs", "prod/shower", "--build")
    assert code == 0
    first = out.splitlines()[0].split("] ", 1)[-1]  # after the line's timestamp
    assert first == (
        f"build {tag}: folder worker (python3.11): functions resting, shower, worker "
        f"at {stack.work.head()}"
    )


def test_logs_need_the_token_the_server_has(stack, tmp_path):
    # from a folder without a .sless-state (the checkout has one once scripts/run ran)
    result = run("logs", "prod/greet", server=stack.server, token=None, cwd=tmp_path)
    assert result.returncode == 2
    assert one_line_error(result).endswith(": set SLESS_READ_TOKEN or SLESS_API_TOKEN")
    wrong = run("logs", "prod/greet", server=stack.server, token="wrong")
    assert wrong.returncode == 2
    assert (
        "set SLESS_READ_TOKEN or SLESS_API_TOKEN to a token the server was started with"
        in one_line_error(wrong)
    )


def test_logs_follow_picks_up_new_lines(stack):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env.update(SLESS_SERVER=stack.server.base, SLESS_API_TOKEN=TOKEN)
    follower = subprocess.Popen(
        [sys.executable, "-m", "gitops_sless", "logs", "prod/greet", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert follower.stdout is not None
    try:
        first = uuid.uuid4().hex[:8]
        stack.server.call("greet", params={"name": first})
        seen = read_until(follower.stdout, f"greeting {first}\n".encode())
        assert seen  # the existing log, then the new line
        later = uuid.uuid4().hex[:8]
        stack.server.call("greet", params={"name": later})
        assert read_until(follower.stdout, f"greeting {later}\n".encode())
        assert follower.poll() is None  # still following
    finally:
        follower.terminate()
        follower.wait(10)
        follower.stdout.close()
        assert follower.stderr is not None
        follower.stderr.close()


def read_until(stream, wanted: bytes, timeout: float = 20) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    while wanted not in data:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {wanted!r} in {data[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"the stream ended before {wanted!r}: {data[-2000:]!r}"
            data += chunk
    return data


# --- invoke ---------------------------------------------------------------------------------------


def test_invoke_sends_the_body_to_the_sub_path_and_prints_the_answer(stack, tmp_path):
    result = run(
        "invoke",
        "prod/greet",
        "--data",
        '{"name": "Ada"}',
        "--path",
        "/sub/x?lang=en",
        server=stack.server,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "message": "hello, Ada",
        "path": "/sub/x",
        "query": {"lang": "en"},
        "method": "POST",
    }
    assert re.fullmatch(r"200 OK in \d+ ms, request id \S+\n", result.stderr)
    assert result.stdout.endswith("}\n")  # JSON ends its line, for the shell's prompt

    body = tmp_path / "body.json"
    body.write_text('{"name": "Grace"}')
    from_file = run("invoke", "greet", "-d", f"@{body}", "-X", "PUT", server=stack.server)
    assert json.loads(from_file.stdout)["message"] == "hello, Grace"
    assert json.loads(from_file.stdout)["method"] == "PUT"
    from_stdin = run(
        "invoke", "prod/greet", "-d", "@-", stdin='{"name": "Lin"}', server=stack.server
    )
    assert json.loads(from_stdin.stdout)["message"] == "hello, Lin"


def test_invoke_exits_one_on_an_error_answer_and_never_sends_the_token(stack):
    missing = run("invoke", "prod/nobody", server=stack.server)
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"]
    assert missing.stderr.startswith("404 Not Found")
    uncallable = run("invoke", "prod/resting", server=stack.server)  # no http trigger
    assert uncallable.returncode == 1
    assert "no http trigger" in json.loads(uncallable.stdout)["error"]
    assert uncallable.stderr.startswith("404 ")


# --- sync -----------------------------------------------------------------------------------------


def test_sync_waits_for_the_pass_and_exits_zero_when_it_succeeds(stack):
    result = run("sync", "--wait", "60", server=stack.server)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"Succeeded at {stack.work.head()[:12]}\n"
    assert result.stderr == ""  # no progress line into a pipe

    shown = in_a_terminal("sync", "--wait", "60", server=stack.server)
    assert "syncing…" in shown
    assert "\x1b[32mSucceeded\x1b[0m at" in shown


def test_sync_without_the_token_says_to_set_it(stack, tmp_path):
    # from a folder without a .sless-state (the checkout has one once scripts/run ran)
    result = run("sync", server=stack.server, token=None, cwd=tmp_path)
    assert result.returncode == 2
    assert one_line_error(result) == (
        "gitops-sless sync: this needs the server's API token (a valid 'Authorization: "
        "Bearer <token>' header is required): set SLESS_API_TOKEN"
    )


# --- a server that is not there -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["sync"],
        ["logs", "prod/greet"],
        ["invoke", "prod/greet"],
        ["diff", "sample-repo"],
    ],
    ids=lambda args: args[0],
)
def test_a_server_that_cannot_be_reached_is_one_line_and_exit_two(args):
    nowhere = f"http://127.0.0.1:{free_port()}"
    result = run(*args, server=nowhere, timeout=60)
    assert result.returncode == 2
    line = one_line_error(result)
    assert line.startswith(f"gitops-sless {args[0]}: cannot reach the server at {nowhere} (")
    assert "SLESS_SERVER" in line


def test_a_server_url_that_is_not_http_is_a_usage_error():
    result = run("status", "--server", "ftp://example", timeout=30)
    assert result.returncode == 2
    assert one_line_error(result) == (
        "gitops-sless status: --server 'ftp://example' is not an http:// or https:// URL"
    )


# --- a broken push, on a server of its own --------------------------------------------------------


def test_a_broken_push_fails_sync_and_status_and_shows_in_diff(setup, tmp_path):
    setup.push(
        {
            "ok/handler.py": GREET,
            "ok/sless.yaml": manifest("ok", HTTP, "    env: {GREETING: hi}"),
            "needs/handler.py": GREET,
            "needs/sless.yaml": manifest(
                "needs", HTTP, "    env: {DSN: {secret: db, key: dsn}, GREETING: hi}"
            ),
        }
    )
    server = setup.serve()

    status = run("status", server=server)
    assert status.returncode == 1, status.stdout
    (needs,) = [line for line in status.stdout.splitlines() if line.startswith("needs ")]
    assert needs.split()[1] == "Pending"  # waits for its secret
    assert "secret 'db' key 'dsn'" in needs
    assert json.loads(run("status", "-o", "json", server=server).stdout)["ok"] is False

    setup.push({"ok/sless.yaml": manifest("ok", HTTP, "    replicas: many")})
    synced = run("sync", "--wait", "60", server=server)
    assert synced.returncode == 1
    assert synced.stdout.startswith(f"Invalid at {setup.work.head()[:12]}: ")
    assert "ok/sless.yaml:6: functions[0].replicas" in synced.stdout

    status = run("status", server=server)
    assert status.returncode == 1
    assert re.search(r"^ok +Invalid +", status.stdout, re.M)

    diff = run("diff", str(setup.work.path), server=server)
    assert diff.returncode == 1
    assert "! invalid ok/sless.yaml: keeps the last good version of ok (Invalid)" in diff.stdout


FAILING_JOB = """
def main(event):
    raise RuntimeError("the table cannot be created: " + event["table"])
"""


def test_status_shows_a_job_run_that_failed_and_exits_one(setup):
    setup.push(
        {
            "ok/handler.py": GREET,
            "ok/sless.yaml": manifest("ok", HTTP, "    env: {GREETING: hi}"),
            "db/handler.py": FAILING_JOB,
            "db/sless.yaml": manifest(
                "db", "    jobs: [{name: create-table, runId: 1, event: {table: notes}}]"
            ),
        }
    )
    server = setup.serve()
    server.wait(lambda: any(run["phase"] == "Failed" for run in server.jobs()), "the job to fail")

    status = run("status", server=server)
    assert status.returncode == 1, status.stdout
    lines = status.stdout.splitlines()
    assert re.search(r"^db +Ready +", status.stdout, re.M)  # the function itself serves
    header = lines.index(next(line for line in lines if line.startswith("JOB ")))
    assert lines[header].split() == ["JOB", "RUN", "FUNCTION", "PHASE", "MESSAGE"]
    failed = lines[header + 1]
    assert failed.split()[:4] == ["create-table", "1", "db", "Failed"]
    assert "the table cannot be created: notes" in failed

    as_json = json.loads(run("status", "-o", "json", server=server).stdout)
    assert as_json["ok"] is False
    (prod,) = as_json["environments"]
    assert [(r["name"], r["runId"], r["phase"]) for r in prod["jobs"]] == [
        ("create-table", 1, "Failed")
    ]


# --- shell completion ----------------------------------------------------------------------------


def bash_complete(
    line: str, server: SlessServer | None = None, read_token: str | None = None
) -> list[str]:
    """What the bash completion offers for ``line`` (completing its last word)."""
    script = completion.bash_script(cli.parser())  # what `gitops-sless completion bash` prints
    words = line.split(" ")
    program = (
        script
        + f"\nCOMP_LINE={json.dumps(line)}\nCOMP_WORDS=({' '.join(json.dumps(w) for w in words)})"
        + f"\nCOMP_CWORD={len(words) - 1}\n_gitops_sless\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    if server is not None:
        env.update(SLESS_SERVER=server.base, SLESS_API_TOKEN=TOKEN)
    if read_token is not None:
        env["SLESS_READ_TOKEN"] = read_token
    result = subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return sorted(filter(None, result.stdout.splitlines()))


def test_bash_completes_commands_options_choices_and_names_from_the_server(stack):
    assert run("completion", "bash").stdout == completion.bash_script(cli.parser())
    assert bash_complete("gitops-sless s") == ["serve", "status", "sync"]
    assert bash_complete("gitops-sless logs --") == [
        "--build",
        "--follow",
        "--help",
        "--job",
        "--request",
        "--server",
        "--state-dir",
        "--token",
        "--trace",
    ]
    assert bash_complete("gitops-sless status -o ") == ["json", "table"]
    assert bash_complete("gitops-sless completion ") == ["bash", "zsh"]
    assert bash_complete("gitops-sless logs prod/g", server=stack.server) == ["prod/greet"]
    line = f"gitops-sless invoke --server {stack.server.base} prod/s"
    assert bash_complete(line, read_token=stack.server.read_token) == ["prod/shower"]
    assert bash_complete("gitops-sless status --env ", server=stack.server) == ["prod"]
    assert bash_complete("gitops-sless diff sample-repo/gr") == ["sample-repo/greeting"]


def test_the_zsh_script_declares_every_command_and_option():
    script = run("completion", "zsh").stdout
    assert script.startswith("#compdef gitops-sless\n")
    parser = cli.parser()
    for name, sub in completion.commands_of(parser).items():
        assert f"\n    '{name}:" in script
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in script, (name, flag)
    assert "'1:ENV/NAME:_gitops_sless_functions'" in script
    assert "'(-o --output)'{-o,--output}'[(default: table)]:output:(table json)'" in script
