"""The command line, run as a user runs it: a real process, real exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from .gitserver import git

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample-repo"


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gitops_sless", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def _git(repo: Path, *args: str) -> str:
    return git(*args, cwd=repo)


def test_validate_sample_repo_exits_zero():
    result = _cli("validate", str(SAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("16 functions in 12 valid manifests, 0 invalid")
    assert result.stderr == ""


def test_validate_reports_each_problem_on_one_line_and_exits_one(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok/h.py").write_text("def main(e):\n    return e\n")
    (tmp_path / "ok/sless.yaml").write_text(
        "functions:\n  - {name: ok, runtime: python3.11, entrypoint: h.main}\n"
    )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/h.py").write_text("def main(e):\n    return e\n")
    (tmp_path / "bad/sless.yaml").write_text(
        "functions:\n"
        "  - name: bad\n"
        "    runtime: python3.11\n"
        "    entrypoint: h.main\n"
        "    memoryMB: -10\n"
        "    env: {PORT: 8080}\n"
    )
    result = _cli("validate", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "bad/sless.yaml:5: functions[0].memoryMB: -10 is less than the minimum of 64",
        "bad/sless.yaml:6: functions[0].env.PORT: 8080 is a number; expected a string (quote it)",
    ]
    assert "1 functions in 1 valid manifests, 1 invalid" in result.stdout


def test_validate_reads_a_git_ref_not_the_work_tree(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "fn").mkdir()
    (repo / "fn/h.js").write_text("exports.main = async () => 1;\n")
    (repo / "fn/sless.yaml").write_text(
        "functions:\n  - {name: fn, runtime: nodejs20, entrypoint: h.main}\n"
    )
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "good")
    (repo / "fn/sless.yaml").write_text("functions: []\n")
    _git(repo, "commit", "-qam", "bad")
    assert _cli("validate", str(repo)).returncode == 1
    good = _cli("validate", str(repo), "--ref", "HEAD~1")
    assert good.returncode == 0, good.stderr
    missing = _cli("validate", str(repo), "--ref", "no-such-branch")
    assert missing.returncode == 2
    assert "cannot resolve no-such-branch to a commit" in missing.stderr


def test_usage_errors_exit_two(tmp_path):
    assert _cli().returncode == 2
    assert _cli("validate").returncode == 2
    missing = _cli("validate", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    assert _cli("validate", str(tmp_path), "--ref", "main").returncode == 2
    bad_env = _cli("render", str(SAMPLE), "--env", "Prod_1")
    assert bad_env.returncode == 2 and "--env 'Prod_1'" in bad_env.stderr
    bad_result = _cli("render", str(SAMPLE), "--job-result", "get-time-py={not json")
    assert bad_result.returncode == 2 and "is not JSON" in bad_result.stderr


def test_render_prints_multi_document_yaml_for_the_environment():
    result = _cli(
        "render",
        str(SAMPLE),
        "--env",
        "pr-3",
        "--registry",
        "reg.test/x",
        "--job-result",
        'get-time-py={"utc": "now"}',
        "--no-builds",
    )
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {"sless-pr-3"}
    assert not any(o["metadata"]["name"].startswith("build-") for o in objects)
    names = {f"{o['kind']}/{o['metadata']['name']}" for o in objects}
    assert "Deployment/time-display-py" in names
    assert "Deployment/time-display-js" not in names
    assert result.stderr.splitlines() == [
        "# time-display-js: not rendered, waits for the result of job get-time-js"
    ]


def test_serve_usage_errors_exit_two_before_anything_starts(tmp_path):
    cases = [
        (["--listen", "8080"], "--listen '8080': expected HOST:PORT"),
        (["--listen", "127.0.0.1:99999"], "expected HOST:PORT"),
        (["--poll-interval", "0"], "--poll-interval 0: must be greater than 0"),
        (["--env", "Prod"], "--env 'Prod': must be a DNS-1123 label"),
        (["--max-builds", "-1"], "--max-builds -1: must be greater than 0"),
    ]
    for extra, message in cases:
        state = tmp_path / "state"
        result = _cli("serve", "--repo", str(SAMPLE), "--state-dir", str(state), *extra)
        assert result.returncode == 2, (extra, result.stderr)
        assert message in result.stderr, (extra, result.stderr)
        assert not state.exists()
