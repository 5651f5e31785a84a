"""Build contexts for kaniko from real git repositories, and their bucket on a real S3 server."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from gitops_sless import logs
from gitops_sless.errors import PermanentError, TransientError
from gitops_sless.kube.contexts import build_context
from gitops_sless.kube.storage import ContextStore, S3Config, StorageError, StorageUnavailable
from gitops_sless.manifests import load as manifest
from gitops_sless.manifests import runtimes
from gitops_sless.manifests.identity import source_id
from gitops_sless.manifests.model import Function
from gitops_sless.plan.backend import BuildFailed
from gitops_sless.source.snapshot import DirectorySnapshot, Snapshot, open_snapshot

from ..gitserver import WorkRepo, free_port, git
from ..s3server import S3Server

HANDLER = "def main(event):\n    return {'ok': True}\n"
FILES: dict[str, str | bytes | None] = {
    "fns/hello/sless.yaml": (
        "functions:\n  - name: hello\n    runtime: python3.11\n    entrypoint: handler.main\n"
    ),
    "fns/hello/handler.py": HANDLER,
    "fns/hello/lib/util.py": "VALUE = 1\n",
    "fns/hello/run.sh": "#!/bin/sh\necho hi\n",
    "fns/hello/" + "long-" * 30 + "name.txt": "a name longer than 100 bytes\n",
    "README.md": "outside the function folder\n",
}


def load(snapshot: Snapshot) -> Function:
    state = manifest.load(snapshot)
    assert not state.invalid, state.problems
    return state.functions["hello"]


@pytest.fixture
def repo(tmp_path: Path) -> WorkRepo:
    work = WorkRepo(tmp_path / "work").write(FILES)
    (work.path / "fns/hello/run.sh").chmod(0o755)
    os.symlink("lib/util.py", work.path / "fns/hello/util-link.py")
    work.commit("a function")
    return work


def members(context: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(context), mode="r:gz") as tar:
        return {info.name: info for info in tar.getmembers()}


def content(context: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(context), mode="r:gz") as tar:
        extracted = tar.extractfile(name)
        assert extracted is not None
        return extracted.read()


# --- build contexts -------------------------------------------------------------------


def test_the_same_function_gives_the_same_bytes_from_any_clone(repo, tmp_path):
    snapshot = open_snapshot(repo.path)
    fn = load(snapshot)
    first = build_context(fn, snapshot)
    assert build_context(fn, snapshot) == first
    assert build_context(fn, open_snapshot(repo.path)) == first

    clone = tmp_path / "clone"
    git("clone", "--quiet", repo.path, clone)
    cloned = open_snapshot(clone)
    assert load(cloned) == fn
    assert build_context(load(cloned), cloned) == first
    # the files on disk hash as git objects do: the work tree gives the same context
    assert build_context(fn, DirectorySnapshot(clone)) == first


def test_a_changed_file_changes_the_context(repo):
    before = open_snapshot(repo.path)
    old = load(before)
    repo.commit("change", {"fns/hello/lib/util.py": "VALUE = 2\n"})
    after = open_snapshot(repo.path)
    new = load(after)

    assert new.build_tag != old.build_tag
    assert build_context(new, after) != build_context(old, before)
    # only the commit a function was loaded from: a tag must name exactly its content
    with pytest.raises(ValueError, match="the function was loaded with"):
        build_context(old, after)


def test_a_change_outside_the_function_folder_changes_nothing(repo):
    before = open_snapshot(repo.path)
    repo.commit("docs", {"README.md": "other words\n"})
    after = open_snapshot(repo.path)
    assert load(after) == load(before)
    assert build_context(load(after), after) == build_context(load(before), before)


def test_the_tarball_holds_dockerfile_runtime_and_function_with_fixed_metadata(repo):
    snapshot = open_snapshot(repo.path)
    fn = load(snapshot)
    context = build_context(fn, snapshot)
    found = members(context)
    runtime = runtimes.get("python3.11").folder
    runtime_files = sorted(
        p.relative_to(runtime).as_posix()
        for p in runtime.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    long_name = "function/" + "long-" * 30 + "name.txt"

    assert list(found) == sorted(
        [
            "Dockerfile",
            "deps",
            "deps/.sless-deps-key",  # no dependency file: deps/ holds only this
            "function",
            "function/handler.py",
            "function/lib",
            "function/lib/util.py",
            long_name,
            "function/run.sh",
            "function/util-link.py",
            "runtime",
            *(f"runtime/{name}" for name in runtime_files),
        ]
    )
    for name, info in found.items():
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname) == (0, 0, 0, "", ""), name
        if info.isdir():
            assert info.mode == 0o755, name
    assert found["function/run.sh"].mode == 0o755
    assert found["function/handler.py"].mode == 0o644
    assert found["Dockerfile"].mode == 0o644
    assert found["function/util-link.py"].issym()
    assert found["function/util-link.py"].linkname == "lib/util.py"
    assert content(context, "Dockerfile") == (runtime / "Dockerfile").read_bytes()
    assert content(context, "runtime/server.py") == (runtime / "server.py").read_bytes()
    assert content(context, "function/handler.py") == HANDLER.encode()
    assert content(context, "deps/.sless-deps-key") == b"none\n"
    assert content(context, long_name) == b"a name longer than 100 bytes\n"
    # nothing of the repository outside the folder, nothing of the work tree
    assert not any("README" in name for name in found if name.startswith("function"))
    # the gzip header: no time (bytes 4-7), no file name (flag bit 3)
    assert context[4:8] == b"\0\0\0\0"
    assert not context[3] & 0x08
    assert gzip.decompress(context)


def test_the_context_is_read_from_the_commit_not_the_work_tree(repo):
    snapshot = open_snapshot(repo.path)
    fn = load(snapshot)
    first = build_context(fn, snapshot)
    repo.write({"fns/hello/handler.py": "uncommitted\n", "fns/hello/extra.txt": "new\n"})
    assert build_context(fn, snapshot) == first
    assert content(first, "function/handler.py") == HANDLER.encode()


def _outside(tmp_path: Path, links: dict[str, str]) -> tuple[Function, Snapshot]:
    """A folder with ``links`` (path -> target), and a function claiming its tree."""
    folder = WorkRepo(tmp_path / "links").write(FILES).path
    for rel, target in links.items():
        os.symlink(target, folder / "fns/hello" / rel)
    snapshot = DirectorySnapshot(folder)
    assert manifest.load(snapshot).invalid  # the loader refuses them too
    clean = WorkRepo(tmp_path / "clean").write(FILES).path
    fn = replace(load(DirectorySnapshot(clean)), source_id=source_id(snapshot, "fns/hello"))
    return fn, snapshot


@pytest.mark.parametrize(
    ("links", "reason"),
    [
        ({"up": "../.."}, "symlink up -> ../.. leaves the folder"),
        ({"etc": "/etc/passwd"}, "symlink etc -> /etc/passwd leaves the folder"),
        ({"lib/up": "..", "out": "lib/up/../.."}, "symlink out resolves outside the folder"),
    ],
)
def test_a_link_leaving_the_folder_is_refused(tmp_path, links, reason):
    fn, snapshot = _outside(tmp_path, links)
    with pytest.raises(BuildFailed, match=reason) as caught:
        build_context(fn, snapshot)
    assert caught.value.tag == fn.build_tag


def test_a_submodule_is_refused(repo):
    head = repo.head()
    repo.git("update-index", "--add", "--cacheinfo", f"160000,{head},fns/hello/vendored")
    repo.git("commit", "--quiet", "-m", "a submodule")
    snapshot = open_snapshot(repo.path)
    assert manifest.load(snapshot).invalid
    fn = replace(load(open_snapshot(repo.path, head)), source_id=source_id(snapshot, "fns/hello"))
    with pytest.raises(BuildFailed, match="vendored is a submodule; it cannot be built"):
        build_context(fn, snapshot)


# --- the bucket -----------------------------------------------------------------------


def test_the_server_refuses_a_wrong_secret_key(s3_server: S3Server):
    wrong = s3_server.client(secret_key="not-the-secret-key")
    with pytest.raises(ClientError) as caught:
        wrong.put_object(Bucket=s3_server.bucket, Key="refused", Body=b"x")
    assert caught.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    with pytest.raises(ClientError, match="404"):
        s3_server.client().head_object(Bucket=s3_server.bucket, Key="refused")


def test_a_context_is_uploaded_once(s3_server: S3Server, repo):
    snapshot = open_snapshot(repo.path)
    fn = load(snapshot)
    store = ContextStore(s3_server.config())
    key = store.key(fn.build_tag)
    assert key == f"contexts/{fn.build_tag}.tar.gz"
    context = build_context(fn, snapshot)

    assert not store.exists(key)
    assert store.upload_if_absent(key, context) is True
    assert store.exists(key)
    assert store.upload_if_absent(key, b"other bytes") is False
    stored = s3_server.client().get_object(Bucket=s3_server.bucket, Key=key)
    assert stored["Body"].read() == context


def test_a_tag_that_could_climb_out_is_not_a_key(s3_server: S3Server):
    store = ContextStore(s3_server.config())
    for tag in ("../x", "", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="not a build tag"):
            store.key(tag)


def test_the_start_up_check_passes_and_leaves_no_probe(s3_server: S3Server):
    ContextStore(s3_server.config()).check()
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix="probes/")
    assert listed.get("KeyCount", 0) == 0


def _check_fails(config: S3Config) -> str:
    with pytest.raises(StorageError) as caught:
        ContextStore(config).check()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"S3 bucket {config.bucket} at {config.endpoint}: ")
    assert "sless-test-secret" not in message and "Traceback" not in message
    return message


def test_the_start_up_check_names_what_failed_in_one_line(s3_server: S3Server):
    wrong_key = _check_fails(s3_server.config(secret_key="sless-test-secret-wrong"))
    assert wrong_key.endswith("access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"), (
        wrong_key
    )
    missing = _check_fails(s3_server.config(bucket="no-such-bucket"))
    assert missing.endswith(": bucket does not exist"), missing
    closed = f"http://127.0.0.1:{free_port()}"
    unreachable = _check_fails(s3_server.config(endpoint=closed))
    assert unreachable == (
        f"S3 bucket {s3_server.bucket} at {closed}: unreachable (connection refused)"
    )


def test_upload_errors_say_whether_to_retry(s3_server: S3Server):
    closed = ContextStore(s3_server.config(endpoint=f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(StorageUnavailable, match="unreachable") as network:
        closed.upload_if_absent("contexts/x.tar.gz", b"x")
    assert isinstance(network.value, TransientError)

    refused = ContextStore(s3_server.config(secret_key="sless-test-secret-wrong"))
    with pytest.raises(StorageError, match="access denied") as auth:
        refused.upload_if_absent("contexts/x.tar.gz", b"x")
    assert isinstance(auth.value, PermanentError)

    missing = ContextStore(s3_server.config(bucket="no-such-bucket"))
    with pytest.raises(StorageError, match=r"cannot write contexts/x\.tar\.gz: bucket does not"):
        missing.upload_if_absent("contexts/x.tar.gz", b"x")


def test_the_configuration_comes_from_the_environment_and_hides_the_secret():
    secret = "from-env-secret-7f3a"
    config = S3Config.from_env(
        {
            "SLESS_S3_ENDPOINT": "http://127.0.0.1:8333/",
            "SLESS_S3_BUCKET": "sless-builds",
            "AWS_ACCESS_KEY_ID": "key-id",
            "AWS_SECRET_ACCESS_KEY": secret,
        }
    )
    assert config == S3Config(
        "http://127.0.0.1:8333", "sless-builds", "us-east-1", "key-id", secret
    )
    assert secret not in repr(config) and "key-id" not in repr(config)
    assert logs.redact(f"leaked {secret}") == "leaked ***"
    assert (
        S3Config.from_env(
            {
                "SLESS_S3_ENDPOINT": "https://s3",
                "SLESS_S3_BUCKET": "b",
                "SLESS_S3_REGION": "eu-west-1",
            }
        ).region
        == "eu-west-1"
    )
    with pytest.raises(StorageError, match="SLESS_S3_BUCKET not set"):
        S3Config.from_env({"SLESS_S3_ENDPOINT": "http://127.0.0.1:8333"})
    with pytest.raises(StorageError, match="give the scheme"):
        S3Config.from_env({"SLESS_S3_ENDPOINT": "127.0.0.1:8333", "SLESS_S3_BUCKET": "b"})
