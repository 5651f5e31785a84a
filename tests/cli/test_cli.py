"""The command line, run as a user runs it: a real process, real exit codes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import gitops_sless
from gitops_sless import cli, logs
from gitops_sless.cli import completion
from gitops_sless.cli.common import EXIT_CODES

from ..gitserver import WorkRepo, git, git_env
from ..paths import ROOT

SAMPLE = ROOT / "sample-repo"


def _cli(
    *args: str, cwd: Path = ROOT, home: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``home``: run with that HOME and no git config but the repository's own."""
    env = None
    if home is not None:
        home.mkdir(exist_ok=True)
        env = git_env({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")})
    return subprocess.run(
        [sys.executable, "-m", "gitops_sless", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
    )


def _git(repo: Path, *args: str) -> str:
    return git(*args, cwd=repo)


def test_validate_sample_repo_exits_zero():
    result = _cli("validate", str(SAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("20 functions in 16 valid manifests, 0 invalid")
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
    # time-display-js waits for get-time-js's result: rendered without it, so not 0
    assert result.returncode == 1, result.stderr
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


def test_render_exits_zero_only_when_every_function_rendered():
    results = ["--job-result", 'get-time-py={"utc": "now"}']
    results += ["--job-result", 'get-time-js={"utc": "now"}']
    result = _cli("render", str(SAMPLE), "--env", "prod", "--no-builds", *results)
    assert result.returncode == 0, result.stderr
    names = {o["metadata"]["name"] for o in yaml.safe_load_all(result.stdout)}
    assert {"time-display-py", "time-display-js"} <= names
    assert "not rendered" not in result.stderr


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


HANDLER = "def main(e):\n    return e\n"


def _fn(folder: str, name: str, entrypoint: str = "h.main", extra: str = "") -> dict[str, str]:
    manifest = (
        f"functions:\n  - name: {name}\n    runtime: python3.11\n"
        f"    entrypoint: {entrypoint}\n{extra}"
    )
    return {f"{folder}/sless.yaml": manifest, f"{folder}/h.py": HANDLER}


def _validate(tmp_path: Path, path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _cli("validate", str(path), *extra, home=tmp_path / "home")


def _on_disk(path: Path) -> str:
    return f"files on disk in the git work tree {path.resolve()}: uncommitted changes included"


def test_validate_checks_the_files_on_disk_and_ref_checks_a_commit(tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("valid", _fn("hello", "hello"))
    repo.write(_fn("hello", "hello", extra="    memoryMB: -5\n"))  # not committed
    on_disk = _validate(tmp_path, repo.path)
    assert on_disk.returncode == 1, on_disk.stderr
    assert on_disk.stderr.splitlines() == [
        "hello/sless.yaml:5: functions[0].memoryMB: -5 is less than the minimum of 64"
    ]
    assert on_disk.stdout == (
        f"0 functions in 0 valid manifests, 1 invalid ({_on_disk(repo.path)}, "
        "ignored files left out)\n"
    )
    committed = _validate(tmp_path, repo.path, "--ref", "HEAD")
    assert committed.returncode == 0, committed.stderr
    assert committed.stdout == (
        f"1 functions in 1 valid manifests, 0 invalid (commit {repo.head()}, --ref HEAD)\n"
    )


def test_validate_counts_untracked_functions_and_leaves_out_ignored_files(tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("valid", {**_fn("hello", "hello"), ".gitignore": "scratch/\n"})
    repo.write(
        {
            **_fn("new", "new-fn"),  # untracked, not ignored: validated
            **_fn("broken-new", "broken-new", extra="    timeoutSec: 0\n"),
            "scratch/sless.yaml": "functions: [{name: BAD}]\n",  # ignored: not a manifest
        }
    )
    result = _validate(tmp_path, repo.path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "broken-new/sless.yaml:5: functions[0].timeoutSec: 0 is less than the minimum of 1"
    ]
    assert result.stdout.startswith("2 functions in 2 valid manifests, 1 invalid (")
    repo.write({"broken-new/sless.yaml": None, "broken-new/h.py": None})
    fixed = _validate(tmp_path, repo.path)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stderr == ""


def test_nested_gitignore_files_and_negations_decide_what_a_folder_holds(tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.write(
        {
            "fns/.gitignore": "wip-*/\n!wip-done/\n",
            **_fn("fns/wip-broken", "wip-broken", extra="    replicas: lots\n"),
            **_fn("fns/wip-done", "wip-done"),
            "fns/web/.gitignore": "*.py\n!main.py\n",
            **_fn("fns/web", "web-main", entrypoint="main.main"),
            "fns/web/main.py": HANDLER,
        }
    )
    repo.write(
        {
            # a second function of another folder whose handler is ignored
            **_fn("fns/gen", "gen", entrypoint="generated.main"),
            "fns/gen/.gitignore": "generated.py\n",
            "fns/gen/generated.py": HANDLER,
        }
    )
    result = _validate(tmp_path, repo.path)
    assert result.returncode == 1
    # the ignored handler does not count; the ignored wip-broken manifest is not read
    assert result.stderr.splitlines() == [
        "fns/gen/sless.yaml:4: functions[0].entrypoint: fns/gen/generated.py does not exist "
        "(runtime python3.11)"
    ]
    assert result.stdout.startswith("2 functions in 2 valid manifests, 1 invalid")
    # the same from a folder of the work tree: the work tree's rules still apply
    sub = _validate(tmp_path, repo.path / "fns")
    assert sub.stderr.splitlines() == [
        "gen/sless.yaml:4: functions[0].entrypoint: gen/generated.py does not exist "
        "(runtime python3.11)"
    ]
    assert (
        f"(files on disk in {(repo.path / 'fns').resolve()}, in the git work tree "
        f"{repo.path.resolve()}: uncommitted changes included" in sub.stdout
    )


def test_a_plain_folder_honours_its_gitignore(tmp_path):
    plain = tmp_path / "plain"
    for rel, text in {
        **_fn("ok", "ok"),
        **_fn("drafts/bad", "bad", extra="    memoryMB: 1\n"),
        ".gitignore": "drafts/\n",
    }.items():
        (plain / rel).parent.mkdir(parents=True, exist_ok=True)
        (plain / rel).write_text(text)
    result = _validate(tmp_path, plain)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "1 functions in 1 valid manifests, 0 invalid (files on disk in "
        f"{plain.resolve()}, a plain directory: ignored files left out)\n"
    )
    (plain / ".gitignore").unlink()
    assert _validate(tmp_path, plain).returncode == 1


def test_ref_needs_the_root_of_a_git_repository(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    result = _validate(tmp_path, plain, "--ref", "main")
    assert result.returncode == 2
    assert result.stderr == (
        f"gitops-sless validate: {plain}: --ref main given, but this is not a git repository\n"
    )
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("valid", _fn("hello", "hello"))
    inside = _cli("render", str(repo.path / "hello"), "--ref", "HEAD", home=tmp_path / "home")
    assert inside.returncode == 2 and inside.stdout == ""
    assert f"give the root of the git work tree, {repo.path.resolve()}" in inside.stderr


def test_version():
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"gitops-sless {gitops_sless.__version__}\n"


SECRET = "s3cr3t-token-value"


class ServeRun:
    """``cli.main(["serve", ...])`` in this process; the server and log setup are recorded."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.started: list[object] = []  # ServeConfig of each server started
        self.configured: list[tuple[str, str, str]] = []  # format, level, SECRET as logged

    def __call__(self, *extra: str) -> int:
        return cli.main(["serve", "--repo", str(SAMPLE), "--state-dir", str(self.state), *extra])


@pytest.fixture
def serve_main(monkeypatch, tmp_path) -> ServeRun:
    import gitops_sless.serve

    run = ServeRun(tmp_path / "state")

    class FakeServer:
        def __init__(self, config: object) -> None:
            run.started.append(config)

        def run(self) -> None:
            pass

    def configure(fmt: str, level: str) -> None:
        run.configured.append((fmt, level, logs.redact(SECRET)))

    monkeypatch.setattr(gitops_sless.serve, "Server", FakeServer)
    monkeypatch.setattr(logs, "configure", configure)
    monkeypatch.setattr(logs, "_secrets", frozenset())  # the registered ones go with the test
    for name in ("SLESS_LOG_FORMAT", "SLESS_LOG_LEVEL", "SLESS_TRUSTED_PROXIES"):
        monkeypatch.delenv(name, raising=False)
    return run


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        (["--log-format", "xml"], {}, "--log-format: invalid choice: 'xml'"),
        (["--log-level", "verbose"], {}, "--log-level: invalid choice: 'verbose'"),
        ([], {"SLESS_LOG_FORMAT": "yaml"}, "$SLESS_LOG_FORMAT 'yaml': use one of text, json"),
        ([], {"SLESS_LOG_LEVEL": "trace"}, "$SLESS_LOG_LEVEL 'trace': use one of debug, info"),
        (["--keep-builds", "-1"], {}, "--keep-builds -1: must be 0 or more"),
        (["--keep-builds", "two"], {}, "--keep-builds: invalid int value: 'two'"),
        (["--gc-interval", "0"], {}, "--gc-interval 0: must be greater than 0"),
        (
            ["--trusted-proxies", "10.0.0.0/8,not-a-net"],
            {},
            "--trusted-proxies 'not-a-net': not an IP network (CIDR)",
        ),
        (
            [],
            {"SLESS_TRUSTED_PROXIES": "10.0.0.0/33"},
            "--trusted-proxies '10.0.0.0/33': not an IP network",
        ),
        (["--queue", "redis://q:6379"], {}, "--queue redis://q:6379: expected sqlite or nats://"),
        ([], {"SLESS_QUEUE": "kafka"}, "--queue kafka: expected sqlite or nats://HOST:PORT"),
        (["--callback-allow", "10.0.0.0/8,x"], {}, "--callback-allow 'x': not an IP network"),
        (["--invocation-retention", "0"], {}, "--invocation-retention '0': expected a positive"),
    ],
)
def test_serve_flag_errors_exit_two_before_the_server_starts(
    serve_main, monkeypatch, capsys, extra, env, message
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = serve_main(*extra)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert serve_main.started == [] and serve_main.configured == []
    assert not serve_main.state.exists()


def test_serve_flags_reach_the_server_and_secrets_are_hidden_before_logging(
    serve_main, monkeypatch
):
    monkeypatch.setenv("SLESS_LOG_FORMAT", "json")
    monkeypatch.setenv("SLESS_TRUSTED_PROXIES", "10.1.2.3/8, ::1")
    monkeypatch.setenv("SLESS_GIT_PASSWORD", "git-password-value")
    code = serve_main(
        "--log-level", "debug", "--keep-builds", "0", "--gc-interval", "60",
        "--api-token", SECRET,
    )  # fmt: skip
    assert code == 0
    (config,) = serve_main.started
    assert config.log_format == "json" and config.log_level == "debug"
    assert config.keep_builds == 0 and config.gc_interval == 60.0
    assert config.trusted_proxies == ("10.0.0.0/8", "::1/128")
    # logging was set up once, after the token was registered: no line can show it
    assert serve_main.configured == [("json", "debug", "***")]
    assert logs.redact("clone with git-password-value") == "clone with ***"


@pytest.mark.parametrize("extra", [(), ("--listen", "not-an-address")])
def test_serve_leaves_sigusr2_as_it_found_it(serve_main, extra):
    """An ignored SIGUSR2 would be inherited by every process this one starts later, and a
    shell cannot even trap it (scripts/run's restart stopped working after such a run)."""
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    serve_main(*extra)  # a server that ran and stopped, or a refused start
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_serve_flag_defaults(serve_main):
    assert serve_main() == 0
    (config,) = serve_main.started
    assert (config.log_format, config.log_level) == ("text", "info")
    assert (config.keep_builds, config.gc_interval, config.trusted_proxies) == (3, 3600.0, ())


def _documented_exit_codes() -> dict[str, dict[int, str]]:
    """The exit-code table of docs/operating.md: verb -> code -> text (no backticks)."""
    text = (ROOT / "docs" / "operating.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    codes = [int(cell.removeprefix("exit ")) for cell in header[1:]]
    table: dict[str, dict[int, str]] = {}
    for row in rows[1:]:
        verb, *cells = (cell.strip().replace("`", "") for cell in row.strip("|").split("|"))
        table[verb] = {code: cell for code, cell in zip(codes, cells, strict=True) if cell != "—"}
    return table


def test_the_exit_code_table_has_every_verb_with_the_codes_its_code_returns():
    documented = _documented_exit_codes()
    verbs = set(completion.commands_of(cli.parser()))
    assert set(documented) == verbs  # one row per verb, none missing, none left over
    assert documented == EXIT_CODES  # the same codes, said the same way


def test_each_verbs_help_ends_with_its_exit_codes():
    for verb, codes in EXIT_CODES.items():
        shown = " ".join(_cli(verb, "--help").stdout.split())
        assert f"exit codes: 0 {codes[0]}" in shown, verb
        assert "130 interrupted (Ctrl-C)" in shown, verb


@pytest.mark.parametrize("repo", ["sample", "empty"])
def test_serve_on_a_port_in_use_exits_three(tmp_path, repo):
    # empty: a first pass that ends at once, before the listener has failed
    folder = SAMPLE if repo == "sample" else tmp_path / "empty"
    if repo == "empty":
        folder.mkdir()
        (folder / "README.md").write_text("nothing to serve yet\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _cli(
            "serve", "--repo", str(folder), "--state-dir", str(tmp_path / "state"),
            "--listen", f"127.0.0.1:{port}", "--sandbox", "off", "--poll-interval", "3600",
        )  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    assert "address already in use" in result.stderr.lower()
    # a server that cannot listen never says where it serves
    assert "is serving" not in result.stderr and "curl http" not in result.stderr
