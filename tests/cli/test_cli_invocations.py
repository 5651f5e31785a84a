"""``gitops-sless invocations list|show|redrive`` against a real server and its queue.

One server (SQLite queue, the sandbox) serves the module: every test makes invocations
of its own and looks only at those, so none depends on another's. The CLI runs as a
subprocess, as a user runs it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from gitops_sless import cli
from gitops_sless.cli import invocations

from ..gitserver import GitDaemon, WorkRepo, free_port, init_bare
from ..invocations.test_async_serve import FLAKY
from ..sless_server import SlessServer
from ..test_serve import HTTP, manifest
from .test_cli_server import bash_complete, in_a_terminal, in_process, one_line_error, run

ASYNC = "    async: {retries: 2, backoff: 1s}"
GIVE_UP = 99  # ok_from: every attempt fails, the invocation dies after 3
DIED = "HTTP 500: not yet 3 (after 3 attempts: retries spent)"


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlessServer]:
    base = tmp_path_factory.mktemp("cli-invocations")
    with GitDaemon(base / "served") as daemon:
        init_bare(base / "served" / "functions.git")
        url = daemon.url("functions.git")
        work = WorkRepo(base / "work")
        files = {}
        for name in ("orders", "bulk"):
            files[f"{name}/sless.yaml"] = manifest(name, HTTP, ASYNC)
            files[f"{name}/handler.py"] = FLAKY
        work.commit("functions", files)
        work.push(url)
        server = SlessServer(url, base / "state")
        try:
            server.start()
            server.wait(lambda: server.function("bulk"), "bulk")
            yield server
        finally:
            server.stop()


def submit(server: SlessServer, function: str, ok_from: int) -> str:
    answer = server.client.post(f"/async/prod/{function}/", json={"ok_from": ok_from})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def ended(server: SlessServer, invocation_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        found = server.client.get(f"/api/v1/invocations/{invocation_id}").json()
        return found if found["status"] in ("succeeded", "failed", "dead") else None

    return server.wait(done, f"invocation {invocation_id} to end", 60)


@pytest.fixture(scope="module")
def two(queue: SlessServer) -> dict[str, str]:
    """One invocation of orders that succeeded at once, one that died."""
    made = {"succeeded": submit(queue, "orders", 1), "dead": submit(queue, "orders", GIVE_UP)}
    for status, one in made.items():
        assert ended(queue, one)["status"] == status
    return made


# --- list -----------------------------------------------------------------------------------------


def test_list_shows_each_invocation_with_its_status_and_exits_one_for_a_dead_one(queue, two):
    result = run("invocations", "list", "--function", "orders", server=queue)
    assert result.returncode == 1, result.stdout + result.stderr  # one is dead
    assert "\x1b[" not in result.stdout  # no colour into a pipe
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "FUNCTION", "STATUS", "ATTEMPTS", "WHEN", "ERROR"]
    (ok,) = [line for line in lines if line.startswith(two["succeeded"])]
    assert re.fullmatch(
        rf"{two['succeeded']} +prod/orders +succeeded +1 +ended (just now|\d+s ago)", ok
    )
    (dead,) = [line for line in lines if line.startswith(two["dead"])]
    assert re.fullmatch(
        rf"{two['dead']} +prod/orders +dead +3 +ended (just now|\d+s ago) +{re.escape(DIED)}", dead
    )

    succeeded = run("invocations", "list", "--status", "succeeded", server=queue)
    assert succeeded.returncode == 0, succeeded.stderr  # none of those listed failed
    assert two["succeeded"] in succeeded.stdout and two["dead"] not in succeeded.stdout


def test_list_as_json_is_the_apis_records(queue, two, capsys, monkeypatch):
    result = run("invocations", "list", "--env", "prod", "-o", "json", server=queue)
    assert result.returncode == 1
    found = {inv["id"]: inv for inv in json.loads(result.stdout)}
    assert found[two["succeeded"]]["status"] == "succeeded"
    assert (found[two["dead"]]["status"], found[two["dead"]]["error"]) == ("dead", DIED)
    # in pages of one, the listing goes on after the last id seen
    monkeypatch.setattr(invocations, "PAGE", 1)
    code, out, _ = in_process(capsys, monkeypatch, queue, "invocations", "list", "--limit", "2")
    assert (code, len(out.splitlines())) == (1, 3)  # the head, then two
    code, out, _ = in_process(
        capsys, monkeypatch, queue, "invocations", "list", "-o", "json", "--limit", "1000"
    )
    assert (code, [inv["id"] for inv in json.loads(out)]) == (1, list(found))


def test_list_of_nothing_says_so_and_exits_zero(queue):
    result = run("invocations", "list", "--env", "staging", server=queue)
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == "no invocations (env staging)\n"


def test_list_colours_statuses_on_a_terminal(queue, two):
    shown = in_a_terminal("invocations", "list", "--function", "orders", server=queue)
    assert "\x1b[31mdead" in shown
    assert "\x1b[32msucceeded" in shown


# --- show -----------------------------------------------------------------------------------------


def test_show_prints_every_attempt_its_error_and_the_response(queue, two):
    result = run("invocations", "show", two["dead"], server=queue)
    assert result.returncode == 1, result.stderr  # it died
    out = result.stdout
    assert out.startswith(f"{two['dead']} prod/orders: dead (3 attempts)\n")
    assert re.search(r"^request:   POST /, \d+ bytes$", out, re.M)
    assert f"error:     {DIED}\n" in out
    attempts = re.findall(r"^  (\d)  (\S+Z)  (\d{3})  (.*)$", out, re.M)
    assert [(n, code, error) for n, _, code, error in attempts] == [
        ("1", "500", "HTTP 500: not yet 1"),
        ("2", "500", "HTTP 500: not yet 2"),
        ("3", "500", "HTTP 500: not yet 3"),
    ]
    assert "response:  500\n  not yet 3\n" in out

    good = run("invocations", "show", two["succeeded"], server=queue)
    assert good.returncode == 0, good.stderr
    body = good.stdout.split("response:  200\n", 1)[1]
    assert json.loads(body)["attempt"] == 1

    as_json = json.loads(run("invocations", "show", two["dead"], "-o", "json", server=queue).stdout)
    assert [a["statusCode"] for a in as_json["attemptLog"]] == [500, 500, 500]


def test_an_unknown_id_is_one_clear_line_and_exit_one(queue):
    for action in ("show", "redrive"):
        result = run("invocations", action, "a" * 26, server=queue)
        assert result.returncode == 1, (action, result.stderr)
        assert one_line_error(result) == f"gitops-sless invocations: no invocation '{'a' * 26}'"


@pytest.mark.parametrize(
    ("response", "shown"),
    [
        pytest.param(None, ["response:  none"], id="none"),
        pytest.param(
            {"statusCode": 200, "body": "AAEC", "bodyEncoding": "base64", "truncated": False},
            ["response:  200", "  <3 bytes, base64>"],
            id="bytes",
        ),
        pytest.param(
            {"statusCode": 502, "body": "a\nb", "bodyEncoding": "utf-8", "truncated": True},
            ["response:  502, cut: only the first bytes are kept", "  a", "  b"],
            id="text-cut",
        ),
    ],
)
def test_a_response_shows_as_text_or_its_size(response, shown):
    assert invocations._response(response) == shown


# --- redrive --------------------------------------------------------------------------------------


def test_redrive_queues_a_dead_invocation_again_and_refuses_one_that_is_not(queue):
    one = submit(queue, "orders", 4)  # dies after 3 attempts; the 4th succeeds
    assert ended(queue, one)["status"] == "dead"
    result = run("invocations", "redrive", one, server=queue)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{one} prod/orders: dead -> queued\n"
    record = ended(queue, one)
    assert (record["status"], record["attempts"]) == ("succeeded", 4)

    again = run("invocations", "redrive", one, server=queue)
    assert again.returncode == 1
    assert one_line_error(again) == (
        f"gitops-sless invocations: invocation {one} is succeeded: only a dead or failed "
        "one is queued again"
    )


def test_redrive_dead_queues_every_dead_one_of_a_function(queue):
    made = [submit(queue, "bulk", 4) for _ in range(2)]
    assert [ended(queue, one)["status"] for one in made] == ["dead", "dead"]
    result = run("invocations", "redrive", "--dead", "--function", "bulk", server=queue)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "2 dead invocations of prod/bulk queued again\n"
    assert [ended(queue, one)["status"] for one in made] == ["succeeded", "succeeded"]

    none_left = run(
        "invocations", "redrive", "--dead", "--env", "prod", "--function", "bulk", server=queue
    )
    assert (none_left.returncode, none_left.stdout) == (
        0,
        "0 dead invocations of prod/bulk queued again\n",
    )


# --- arguments, and a server that is not there ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        pytest.param(
            ["redrive"], "which invocation? give its ID, or --dead --function NAME", id="no-id"
        ),
        pytest.param(
            ["redrive", "abc", "--dead", "--function", "f"],
            "either ID or --dead, not both (got 'abc' and --dead)",
            id="both",
        ),
        pytest.param(
            ["redrive", "--dead"],
            "--dead needs --function NAME (and --env, else the server's)",
            id="dead-alone",
        ),
        pytest.param(
            ["redrive", "abc", "--function", "f"],
            "--env and --function go with --dead; ID alone names one invocation",
            id="id-and-function",
        ),
        pytest.param(["list", "--limit", "0"], "--limit 0: must be at least 1", id="limit"),
        pytest.param(
            ["list", "--env", "Prod"],
            "--env 'Prod': must be a DNS-1123 label of at most 40 characters",
            id="env",
        ),
    ],
)
def test_bad_arguments_exit_two_before_asking_the_server(args, said, capsys, monkeypatch):
    monkeypatch.setenv("SLESS_SERVER", f"http://127.0.0.1:{free_port()}")  # never reached
    assert cli.main(["invocations", *args]) == 2
    assert capsys.readouterr().err == f"gitops-sless invocations: {said}\n"


def test_a_server_that_cannot_be_reached_is_exit_two():
    nowhere = f"http://127.0.0.1:{free_port()}"
    result = run("invocations", "list", server=nowhere, timeout=60)
    assert result.returncode == 2
    assert one_line_error(result).startswith(
        f"gitops-sless invocations: cannot reach the server at {nowhere} ("
    )


def test_bash_completes_the_actions_their_flags_and_function_names(queue):
    assert bash_complete("gitops-sless invocations ") == ["list", "redrive", "show"]
    assert bash_complete("gitops-sless invocations list --st") == ["--state-dir", "--status"]
    assert bash_complete("gitops-sless invocations list --status d") == ["dead"]
    assert bash_complete("gitops-sless invocations redrive --d") == ["--dead"]
    assert bash_complete("gitops-sless import terraform --f") == ["--force"]
    # --function takes a NAME alone; the ENV/NAME of logs and invoke are unchanged
    assert bash_complete("gitops-sless invocations list --function b", server=queue) == ["bulk"]
    assert bash_complete("gitops-sless logs prod/o", server=queue) == ["prod/orders"]
