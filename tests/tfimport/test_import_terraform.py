"""gitops-sless import terraform: the sless provider's .tf files become a repository serve runs."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gitops_sless import cli

from ..conftest import write_files
from ..paths import DATA as TEST_DATA
from ..paths import ROOT
from ..sless_server import SlessServer

DATA = TEST_DATA / "terraform"
EXAMPLE = ROOT / "examples" / "terraform" / "hello-node"  # docs/migrating.md's worked example
DSN = "postgres://notes:tf-fixture-pw-4a7c@db.internal:5432/notes"
TOKEN = "tok-fixture-9f3e"


def _import(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["import", "terraform", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _assert_no_secret_below(root: Path) -> None:
    for path in _files(root):
        data = path.read_bytes()
        for secret in (DSN, TOKEN):
            assert secret.encode() not in data, f"{secret!r} written to {path}"


def _valid(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    assert cli.main(["validate", str(repo)]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_the_provider_layout_is_served_with_its_jobs_results_and_secrets(tmp_path, capsys):
    out, secrets = tmp_path / "functions", tmp_path / "secrets"
    code, printed, err = _import(
        capsys, str(EXAMPLE), "--out", str(out), "--secrets-dir", str(secrets)
    )
    assert code == 0, printed + err
    _valid(capsys, out)
    _assert_no_secret_below(out)
    assert (secrets / "time-display" / "DB_DSN").read_text() == DSN
    assert (secrets / "notes-sql" / "API_TOKEN").read_text() == TOKEN
    # two functions that shared a source_dir share one folder and one sless.yaml
    assert sorted(p.relative_to(out).as_posix() for p in _files(out / "code" / "time")) == [
        "code/time/display.js",
        "code/time/getter.js",
        "code/time/sless.yaml",
    ]
    server = SlessServer(str(out), tmp_path / "state", secrets_dir=secrets).start()
    try:
        hello = server.wait(
            lambda: (r := server.call("hello-node", "/?name=Ada")).status_code == 200 and r.json(),
            "hello-node to answer",
            timeout=180,
        )
        assert hello == {"message": "hi, world: Ada", "retries": "3"}
        shown = server.wait(
            lambda: (r := server.call("time-display")).status_code == 200 and r.json(),
            "time-display to answer with the job's result",
            timeout=180,
        )
        assert shown["job"]["event"] == {
            "label": "hi from terraform",
            "tags": ["import", "fixture"],
            "zone": "UTC",
        }
        assert shown["dsnSha256"] == hashlib.sha256(DSN.encode()).hexdigest()
        runs = server.wait(
            lambda: (
                (jobs := {j["name"]: j for j in server.jobs() if j["phase"] == "Succeeded"}).keys()
                >= {"get-time", "notes-create-table", "notes-seed"}
                and jobs
            ),
            "every job to succeed",
            timeout=180,
        )
        seeded = json.loads(runs["notes-seed"]["result"])
        assert seeded == {"would_run": ["INSERT INTO notes DEFAULT VALUES"], "has_dsn": True}
    finally:
        server.stop()
    _assert_no_secret_below(out)


def test_without_a_secrets_dir_it_says_how_to_create_each_secret(tmp_path, capsys):
    out = tmp_path / "functions"
    code, printed, _ = _import(capsys, str(EXAMPLE), "--out", str(out))
    assert code == 0
    assert DSN not in printed and TOKEN not in printed
    assert "secrets/time-display/DB_DSN" in printed
    assert (
        "kubectl create secret generic notes-sql -n sless-prod "
        "--from-file=PG_DSN=secrets/notes-sql/PG_DSN "
        "--from-file=API_TOKEN=secrets/notes-sql/API_TOKEN" in printed
    )
    _assert_no_secret_below(out)
    _valid(capsys, out)
    migrating = (out / "MIGRATING.md").read_text()
    for address in ("sless_function.hello", "sless_trigger.time_display_cron", "sless_job.seed"):
        assert f"`{address}`" in migrating
    removals = [line for line in migrating.splitlines() if line.startswith("terraform state rm")]
    kinds = [line.split("'")[1].split(".")[0] for line in removals]
    assert kinds == sorted(kinds, key=("sless_job", "sless_trigger", "sless_function").index)
    assert len(removals) == 10
    # job ordering that sless.yaml cannot express is a warning, not silence
    assert "main.tf:92: sless_job.seed depends_on sless_job.create_table: warning" in printed


def test_what_is_not_converted_is_named_by_file_and_line_and_exits_1(tmp_path, capsys):
    out = tmp_path / "functions"
    code, printed, _ = _import(capsys, str(DATA / "unsupported"), "--out", str(out))
    assert code == 1
    lines = printed.splitlines()
    for expected in (
        "main.tf:16: sless_function.ok.env_vars.SHOUT: not converted: the function upper()",
        "main.tf:17: sless_function.ok.env_vars.LEVEL: not converted: local.level",
        "main.tf:18: sless_function.ok.env_vars.PHASE: not converted: sless_job.warm.phase",
        "main.tf:19: sless_function.ok.env_vars.SUM: not converted: an arithmetic",
        "main.tf:37: sless_function.many.count: not converted",
        "main.tf:44: module.extra: not converted",
        "main.tf:48: resource aws_s3_bucket.assets: not converted",
    ):
        assert any(line.startswith(expected) for line in lines), (expected, printed)
    _valid(capsys, out)  # what was converted is still a valid repository
    assert "WORD: hey" in (out / "code" / "ok" / "sless.yaml").read_text()


REFUSALS = [
    pytest.param(
        {"main.tf": 'resource "sless_function" "a" {\n  name = "a"\n  runtime =\n}\n'},
        "main.tf:3:12: not valid HCL: unexpected",
        id="unparseable",
    ),
    pytest.param(
        {
            "main.tf": 'resource "sless_trigger" "t" {\n  type = "http"\n'
            "  function = sless_function.missing.name\n}\n"
        },
        "main.tf:3: sless_trigger.t: refers to sless_function.missing, which no block declares",
        id="undeclared-resource",
    ),
    pytest.param(
        {
            "main.tf": 'resource "sless_function" "f" {\n  for_each = toset(["a"])\n'
            '  name = each.key\n  runtime = "nodejs20"\n}\n'
        },
        "main.tf:2: sless_function.f: for_each makes one block many objects",
        id="for-each",
    ),
]


@pytest.mark.parametrize(("files", "line"), REFUSALS)
def test_a_refusal_is_one_line_exits_1_and_writes_nothing(tmp_path, capsys, files, line):
    source, out = write_files(tmp_path / "tf", files), tmp_path / "functions"
    code, printed, err = _import(capsys, str(source), "--out", str(out))
    assert code == 1
    assert err.splitlines()[0].startswith(line), err
    assert len(err.splitlines()) == 2  # the reason, then "nothing written"
    assert not out.exists() and printed == ""


def test_force_writes_what_can_be_converted_despite_a_refusal(tmp_path, capsys):
    source = write_files(
        tmp_path / "tf",
        {
            "broken.tf": "resource {\n",
            "main.tf": 'resource "sless_function" "f" {\n  name = "f"\n  runtime = "nodejs20"\n'
            '  entrypoint = "index.main"\n  source_dir = "${path.module}/src"\n}\n',
            "src/index.js": "module.exports.main = async () => 1;\n",
        },
    )
    out = tmp_path / "functions"
    code, printed, _ = _import(capsys, str(source), "--out", str(out), "--force")
    assert code == 1
    assert printed.startswith("broken.tf:2:")
    assert (out / "src" / "sless.yaml").is_file()


def test_a_non_empty_out_is_never_overwritten_without_force(tmp_path, capsys):
    out = write_files(tmp_path / "mine", {"keep.txt": "mine"})
    code, _, err = _import(capsys, str(EXAMPLE), "--out", str(out))
    assert code == 2 and "not empty" in err
    assert [p.name for p in _files(out)] == ["keep.txt"]
    code, _, _ = _import(capsys, str(EXAMPLE), "--out", str(out), "--force")
    assert code == 0 and (out / "keep.txt").read_text() == "mine"
    assert (out / "code" / "hello" / "sless.yaml").is_file()


def test_code_next_to_the_tf_files_is_copied_without_terraform_files(tmp_path, capsys):
    source = write_files(
        tmp_path / "tf",
        {
            "main.tf": 'variable "token" {\n  sensitive = true\n}\n'
            'resource "sless_function" "f" {\n  name = "f"\n  runtime = "nodejs20"\n'
            '  entrypoint = "index.main"\n  source_dir = path.module\n'
            "  env_vars = { AUTH = var.token }\n}\n",
            "terraform.tfvars": f'token = "{TOKEN}"\n',
            "terraform.tfstate": json.dumps({"token": TOKEN}),
            ".terraform/providers/x": "binary",
            "node_modules/dep/index.js": "module.exports = 1;\n",
            "index.js": "module.exports.main = async () => process.env.AUTH.length;\n",
        },
    )
    out = tmp_path / "functions"
    code, printed, _ = _import(capsys, str(source), "--out", str(out))
    assert code == 0, printed
    assert sorted(p.relative_to(out).as_posix() for p in _files(out)) == [
        "MIGRATING.md",
        "index.js",
        "sless.yaml",
    ]
    _assert_no_secret_below(out)
    assert "AUTH: {secret: f, key: AUTH}" in (out / "sless.yaml").read_text()
    shutil.rmtree(out)


def test_a_disabled_trigger_disables_its_function_only_when_it_is_the_only_kind_left(
    tmp_path, capsys
):
    fn = (
        'resource "sless_function" "{n}" {{\n  name = "{n}"\n  runtime = "nodejs20"\n'
        '  entrypoint = "index.main"\n  source_dir = "${{path.module}}/src"\n}}\n'
    )
    source = write_files(
        tmp_path / "tf",
        {
            "main.tf": fn.format(n="paused")
            + fn.format(n="live")
            + 'resource "sless_trigger" "a" {\n  type = "http"\n  function = "paused"\n'
            "  enabled = false\n}\n"
            'resource "sless_trigger" "b" {\n  type = "http"\n  function = "live"\n}\n'
            'resource "sless_trigger" "c" {\n  type = "cron"\n  schedule = "*/5 * * * *"\n'
            '  function = "live"\n  enabled = false\n}\n',
            "src/index.js": "module.exports.main = async () => 1;\n",
        },
    )
    out = tmp_path / "functions"
    code, printed, _ = _import(capsys, str(source), "--out", str(out))
    assert code == 0
    assert "sless_trigger.c: warning: disabled while live has enabled triggers" in printed
    manifest = (out / "src" / "sless.yaml").read_text()
    paused, live = manifest.split("- name: live")
    assert "enabled: false" in paused and "{type: http}" in paused
    assert "enabled" not in live and "cron" not in live
    _valid(capsys, out)


def test_the_migration_guides_commands_run_as_written_from_the_repository_root(tmp_path):
    """docs/migrating.md's first commands, typed at the root of a checkout (here a copy
    of its examples/): the import and the validate of what it wrote both succeed."""
    text = (ROOT / "docs" / "migrating.md").read_text()
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    ran = []
    for argv in commands:
        assert argv[0] == ".venv/bin/gitops-sless", argv
        if argv[1] == "serve":
            continue  # serves until stopped: the import's other tests run it
        done = subprocess.run(
            [sys.executable, "-m", "gitops_sless", *argv[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (argv, done.stderr)
        ran.append(argv[1])
    assert ran == ["import", "validate"]
    assert (tmp_path / "secrets" / "time-display" / "DB_DSN").is_file()
