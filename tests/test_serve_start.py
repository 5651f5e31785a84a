"""``gitops-sless serve`` refuses what it cannot follow at start: one line, exit code 2.

Each case runs the real command line in its own process; a server that started by
mistake would keep running and fail the test by its timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .gitserver import free_port

EXPECTED = "expected a git repository, a folder of functions, or a URL"


def serve(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "gitops_sless",
        "serve",
        "--state-dir",
        str(tmp_path / "state"),
        "--listen",
        f"127.0.0.1:{free_port()}",
        *args,
    ]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    environ.update(env or {})
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environ)


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert "serving" not in proc.stdout + proc.stderr
    return lines[0]


def test_a_path_that_does_not_exist_is_refused(tmp_path):
    missing = tmp_path / "nonexistent"
    proc = serve(tmp_path, "--repo", str(missing))
    line = assert_refused(proc, f"--repo {missing}", "no such file or directory", EXPECTED)
    assert line.startswith("gitops-sless serve: ")
    assert not (tmp_path / "state").exists()  # refused before anything was written


def test_a_file_is_neither_a_repository_nor_a_folder(tmp_path):
    file = tmp_path / "functions.tar"
    file.write_bytes(b"not a repository")
    proc = serve(tmp_path, "--repo", str(file))
    assert_refused(proc, f"--repo {file}", "not a directory", EXPECTED)


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it would block: the check must only look
    proc = serve(tmp_path, "--repo", str(fifo))
    assert_refused(proc, f"--repo {fifo}", "not a directory")


@pytest.mark.parametrize(
    ("args", "env", "shown"),
    [
        pytest.param(["--fetch-timeout", "0"], {}, "--fetch-timeout 0", id="zero"),
        pytest.param(["--fetch-timeout", "-5"], {}, "--fetch-timeout -5", id="negative"),
        pytest.param(["--fetch-timeout", "inf"], {}, "--fetch-timeout inf", id="infinite"),
        pytest.param([], {"SLESS_FETCH_TIMEOUT": "0"}, "$SLESS_FETCH_TIMEOUT 0", id="env-zero"),
        pytest.param(
            [], {"SLESS_FETCH_TIMEOUT": "-1"}, "$SLESS_FETCH_TIMEOUT -1", id="env-negative"
        ),
    ],
)
def test_a_fetch_deadline_that_is_not_positive_is_refused(tmp_path, args, env, shown):
    proc = serve(tmp_path, "--repo", str(tmp_path), *args, env=env)
    assert_refused(proc, shown, "must be a number of seconds greater than 0")


def test_a_fetch_deadline_that_is_not_a_number_is_refused(tmp_path):
    proc = serve(tmp_path, "--repo", str(tmp_path), env={"SLESS_FETCH_TIMEOUT": "2m"})
    assert_refused(proc, "$SLESS_FETCH_TIMEOUT '2m': not a number of seconds")


def test_the_flag_wins_over_the_environment(tmp_path):
    # the environment's bad value is not read when the flag is given
    proc = serve(
        tmp_path, "--repo", str(tmp_path), "--fetch-timeout", "-1", env={"SLESS_FETCH_TIMEOUT": "x"}
    )
    assert_refused(proc, "--fetch-timeout -1")


def test_an_ssh_key_file_that_does_not_exist_is_refused(tmp_path):
    key = tmp_path / "id_ed25519"
    proc = serve(
        tmp_path,
        "--repo",
        "git@git.example.com:team/functions.git",
        env={"SLESS_GIT_SSH_KEY": str(key)},
    )
    assert_refused(proc, f"$SLESS_GIT_SSH_KEY {key}: no such file")
