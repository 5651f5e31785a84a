"""The mirror against real git servers on loopback: git daemon, smart HTTP, file:// and paths."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pygit2
import pytest
from pygit2.enums import CredentialType

from gitops_sless.errors import SourceError, TransientError
from gitops_sless.source.mirror import (
    Credentials,
    FetchError,
    Mirror,
    _AuthFailed,
    _Callbacks,
    redact,
)
from gitops_sless.source.seed import is_repository, seed_repository
from gitops_sless.source.snapshot import DirectorySnapshot

from .. import gitserver
from ..gitserver import SmartHttpServer, WorkRepo, free_port, git, init_bare

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
work_repo = gitserver.work_repo

USER, PASSWORD = "alice", "s3cr3t-Pa55"


@dataclass
class Remote:
    """A bare repository served by the test servers, and a work repo that pushes to it."""

    bare: Path
    work: WorkRepo

    def push(self, files: dict[str, str | bytes | None], *, ref: str | None = None) -> str:
        commit = self.work.commit("change", files)
        self.work.push(str(self.bare), ref)
        return commit


@pytest.fixture
def remote(git_root: Path, work_repo: WorkRepo) -> Remote:
    bare = init_bare(git_root / "fns.git")
    # enough files that a one-file change is clearly an incremental fetch
    work_repo.commit("initial", {f"functions/f{i}/handler.py": f"n = {i}\n" for i in range(20)})
    work_repo.push(str(bare))
    return Remote(bare, work_repo)


@pytest.fixture
def http_auth(git_root: Path) -> Iterator[SmartHttpServer]:
    with SmartHttpServer(git_root, USER, PASSWORD) as server:
        yield server


@pytest.fixture
def mirror_at(tmp_path: Path) -> Callable[..., Mirror]:
    def make(url: str, **kwargs: object) -> Mirror:
        return Mirror(url, "main", tmp_path / "mirror.git", **kwargs)  # type: ignore[arg-type]

    return make


def _assert_unchanged(mirror: Mirror, commit: str) -> None:
    assert mirror.head() == commit
    assert mirror.snapshot().revision == commit
    assert mirror.snapshot().read("functions/f3/handler.py") == b"n = 3\n"


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text, text


# -- fetching over each transport ----------------------------------------------------------


URLS = {
    "git-daemon": lambda r, daemon, http: daemon.url("fns.git"),
    "file-url": lambda r, daemon, http: f"file://{r.bare}",
    "plain-path": lambda r, daemon, http: str(r.bare),
    "http-basic-auth": lambda r, daemon, http: http.url("fns.git"),
}


@pytest.mark.parametrize("transport", list(URLS))
def test_first_incremental_and_idle_fetch(transport, remote, git_daemon, http_auth, mirror_at):
    url = URLS[transport](remote, git_daemon, http_auth)
    mirror = mirror_at(url, credentials=Credentials(USER, PASSWORD), timeout_sec=10)
    assert mirror.head() is None

    first = mirror.fetch()
    assert (first.commit, first.previous, first.changed) == (remote.work.head(), None, True)
    assert first.received_objects >= 20

    second_commit = remote.push({"functions/f3/handler.py": "n = 33\n"})
    second = mirror.fetch()
    assert (second.commit, second.previous, second.changed) == (second_commit, first.commit, True)
    # the commit, the changed trees (root, functions, f3) and the blob
    assert 1 <= second.received_objects <= 5
    assert mirror.snapshot().read("functions/f3/handler.py") == b"n = 33\n"

    idle = mirror.fetch()
    assert (idle.commit, idle.changed, idle.received_objects) == (second_commit, False, 0)


def test_force_push_wins_and_old_commits_stay_readable(remote, git_daemon, mirror_at):
    mirror = mirror_at(git_daemon.url("fns.git"))
    old = remote.push({"notes.txt": "before\n"})
    mirror.fetch()

    remote.work.git("reset", "--quiet", "--hard", "HEAD~1")
    rewritten = remote.work.commit("rewritten", {"notes.txt": "after\n"})
    remote.work.push(str(remote.bare), force=True)

    result = mirror.fetch()
    assert (result.commit, result.previous, result.changed) == (rewritten, old, True)
    assert mirror.head() == rewritten
    assert mirror.snapshot().read("notes.txt") == b"after\n"
    assert mirror.snapshot(old).read("notes.txt") == b"before\n"
    assert not mirror.is_ancestor(old, rewritten)


# -- authentication and secrets ------------------------------------------------------------


def test_password_in_the_url_is_used_and_never_stored(remote, http_auth, mirror_at, tmp_path):
    url = http_auth.url("fns.git").replace("http://", f"http://{USER}:{PASSWORD}@")
    mirror = mirror_at(url)
    assert mirror.fetch().commit == remote.work.head()
    assert PASSWORD not in repr(mirror)
    for path in (tmp_path / "mirror.git").rglob("*"):
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path


@pytest.mark.parametrize(
    "credentials",
    [
        pytest.param(Credentials(USER, "wrong"), id="wrong-password"),
        pytest.param(Credentials("mallory", PASSWORD), id="wrong-user"),
        pytest.param(None, id="none-configured"),
    ],
)
def test_rejected_credentials_fail_once_without_a_replay_storm(
    credentials, remote, http_auth, mirror_at
):
    mirror = mirror_at(http_auth.url("fns.git"), credentials=credentials)
    with pytest.raises(FetchError) as info:
        mirror.fetch()
    message = str(info.value)
    assert message.startswith(f"fetch {http_auth.url('fns.git')} (branch 'main'): ")
    assert "authentication failed" in message or "none are configured" in message
    assert len(http_auth.requests) <= 3  # libgit2 alone would replay 15 times
    assert mirror.head() is None


def test_secrets_appear_in_no_exception_repr_or_log(remote, http_auth, mirror_at, caplog):
    caplog.set_level(logging.DEBUG)
    url = http_auth.url("fns.git").replace("http://", f"http://{USER}:{PASSWORD}@")
    credentials = Credentials(USER, PASSWORD + "-wrong", passphrase=PASSWORD)
    mirror = mirror_at(url, credentials=credentials)
    with pytest.raises(FetchError) as info:
        mirror.fetch()
    shown = redact(url)
    assert shown == url.replace(PASSWORD, "***")
    assert shown in str(info.value)
    chain = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain += [str(exc), repr(exc)]
        exc = exc.__cause__ or exc.__context__
    _assert_no_secret(*chain, repr(mirror), repr(credentials), str(credentials), caplog.text)
    assert "failed after" in caplog.text  # the failure was logged, redacted


# -- failures leave the mirror as it was ---------------------------------------------------


def test_closed_port_fails_fast(remote, mirror_at):
    before = mirror_at(str(remote.bare)).fetch().commit
    # the same mirror folder, now following a server that went away
    mirror = mirror_at(f"http://127.0.0.1:{free_port()}/fns.git", timeout_sec=10)
    with pytest.raises(FetchError, match=r"Connection refused") as info:
        mirror.fetch()
    # refused at once, not given up at the deadline (that would say "timed out after 10s")
    assert "timed out" not in str(info.value)
    assert isinstance(info.value, TransientError)
    _assert_unchanged(mirror, before)


def test_hanging_server_times_out_and_changes_nothing(remote, git_root, mirror_at):
    with SmartHttpServer(git_root) as server:
        url = server.url("fns.git")
        mirror = mirror_at(url, timeout_sec=2)
        before = mirror.fetch().commit
        remote.push({"functions/f3/handler.py": "n = 33\n"})
        server.mode = "hang"
        with pytest.raises(FetchError, match=r"timed out after 2s") as info:
            mirror.fetch()
    # the deadline ended it (the server would have hung for good): its message says so
    assert str(info.value).startswith(f"fetch {url} (branch 'main'): timed out after 2s")
    _assert_unchanged(mirror, before)


def test_trickling_server_is_cut_off_by_the_deadline(remote, git_root, mirror_at):
    # each read arrives well within the per-read timeout: only the callbacks can stop it
    with SmartHttpServer(git_root) as server:
        mirror = mirror_at(server.url("fns.git"), timeout_sec=1.5)
        before = mirror.fetch().commit
        remote.push({"big.bin": os.urandom(200_000)})
        server.mode, server.slow_bytes, server.slow_delay = "slow", 2048, 0.05
        # only the overall deadline stops it: the message names it
        with pytest.raises(FetchError, match=r"\): timed out after 1.5s$"):
            mirror.fetch()
    _assert_unchanged(mirror, before)
    assert "refs/sless/incoming/main" not in pygit2.Repository(str(mirror.path)).references


def test_server_error_is_transient(remote, git_root, mirror_at):
    with SmartHttpServer(git_root) as server:
        mirror = mirror_at(server.url("fns.git"))
        before = mirror.fetch().commit
        server.mode = "unavailable"
        with pytest.raises(FetchError, match=r"503"):
            mirror.fetch()
    _assert_unchanged(mirror, before)


def test_missing_branch_is_named_and_keeps_the_last_commit(remote, git_daemon, tmp_path):
    url = git_daemon.url("fns.git")
    with pytest.raises(FetchError) as info:
        Mirror(url, "release", tmp_path / "other.git").fetch()
    assert str(info.value) == f"branch 'release' not found at {url}"

    mirror = Mirror(url, "main", tmp_path / "mirror.git")
    before = mirror.fetch().commit
    git("update-ref", "-d", "refs/heads/main", cwd=remote.bare)
    with pytest.raises(FetchError, match=r"^branch 'main' not found at git://"):
        mirror.fetch()
    _assert_unchanged(mirror, before)


def test_missing_repository(tmp_path, git_daemon):
    with pytest.raises(FetchError, match=r"no repository at this path"):
        Mirror(str(tmp_path / "nope.git"), "main", tmp_path / "m1.git").fetch()
    with pytest.raises(FetchError, match=r"no such repository"):
        Mirror(git_daemon.url("nope.git"), "main", tmp_path / "m2.git").fetch()


# -- previews, ancestry, concurrency -------------------------------------------------------


def test_preview_refs_and_merged_heads(remote, git_daemon, mirror_at, tmp_path):
    main = remote.work.head()
    pr = remote.push({"functions/f1/handler.py": "n = 'pr'\n"}, ref="refs/pull/7/head")
    mr = remote.push({"extra.txt": "mr\n"}, ref="refs/merge-requests/9/head")
    remote.work.git("reset", "--quiet", "--hard", main)

    mirror = mirror_at(git_daemon.url("fns.git"), preview_refs=True)
    mirror.fetch()
    assert mirror.preview_heads() == {7: pr, 9: mr}
    assert mirror.snapshot(pr).read("functions/f1/handler.py") == b"n = 'pr'\n"
    assert not mirror.is_ancestor(pr, mirror.head())
    plain = Mirror(git_daemon.url("fns.git"), "main", tmp_path / "plain.git")
    plain.fetch()
    assert plain.preview_heads() == {}

    # PR 7 is merged (fast-forward) and its ref deleted on the server
    git("push", "--quiet", str(remote.bare), f"{pr}:refs/heads/main", cwd=remote.work.path)
    git("update-ref", "-d", "refs/pull/7/head", cwd=remote.bare)
    mirror.fetch()
    assert mirror.preview_heads() == {9: mr}
    assert mirror.is_ancestor(pr, mirror.head())
    assert mirror.is_ancestor(main, pr)
    assert not mirror.is_ancestor("0" * 40, pr)


def test_one_fetch_at_a_time_while_readers_go_on(remote, git_root, mirror_at):
    with SmartHttpServer(git_root) as server:
        mirror = mirror_at(server.url("fns.git"), timeout_sec=10)
        old = mirror.fetch().commit
        new = remote.push({"big.bin": os.urandom(100_000)})
        server.mode, server.slow_bytes, server.slow_delay = "slow", 4096, 0.02
        results = []
        threads = [threading.Thread(target=lambda: results.append(mirror.fetch())) for _ in "ab"]
        for thread in threads:
            thread.start()
        reads = 0
        while any(t.is_alive() for t in threads):
            assert mirror.snapshot(old).read("functions/f3/handler.py") == b"n = 3\n"
            reads += 1
        for thread in threads:
            thread.join()
    assert reads > 0
    assert sorted(r.changed for r in results) == [False, True]  # serialized, not raced
    assert {r.commit for r in results} == {new}


# -- construction and helpers --------------------------------------------------------------


def test_mirror_inside_another_repository_is_its_own(work_repo, tmp_path):
    mirror = Mirror(str(tmp_path / "x.git"), "main", work_repo.path / "mirror.git")
    assert mirror.head() is None
    with pytest.raises(SourceError, match="nothing fetched yet"):
        mirror.snapshot()


def test_invalid_branch_and_unknown_commit(remote, mirror_at):
    with pytest.raises(SourceError, match="not a valid branch name"):
        Mirror(str(remote.bare), "bad..name", Path("unused"))
    mirror = mirror_at(str(remote.bare))
    mirror.fetch()
    with pytest.raises(SourceError, match="no commit 'f00d"):
        mirror.snapshot("f00d" * 10)


def test_a_non_repository_path_is_not_taken_over(remote, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    with pytest.raises(SourceError, match="not a git repository"):
        Mirror(str(remote.bare), "main", tmp_path / "taken").fetch()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        pytest.param("https://u:pw@host/r.git", "https://u:***@host/r.git", id="https"),
        pytest.param("http://u:p%40ss:x@h:8080/r", "http://u:***@h:8080/r", id="encoded"),
        pytest.param("https://u:p@ss@host/r", "https://u:***@host/r", id="raw-at-sign"),
        pytest.param("https://:tok@host/r", "https://:***@host/r", id="token-only"),
        pytest.param("ssh://git@host/r.git", "ssh://git@host/r.git", id="ssh-user-only"),
        pytest.param("https://host/r.git", "https://host/r.git", id="no-userinfo"),
        pytest.param("git@host:org/r.git", "git@host:org/r.git", id="scp-like"),
        pytest.param("/srv/git/r.git", "/srv/git/r.git", id="path"),
    ],
)
def test_redact(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param({}, None, id="nothing"),
        pytest.param({"SLESS_GIT_USERNAME": ""}, None, id="empty"),
        pytest.param(
            {"SLESS_GIT_USERNAME": "bot", "SLESS_GIT_PASSWORD": "tok"},
            Credentials("bot", "tok"),
            id="token",
        ),
        pytest.param(
            {
                "SLESS_GIT_SSH_KEY": "/k",
                "SLESS_GIT_SSH_PUBKEY": "/k.pub",
                "SLESS_GIT_SSH_PASSPHRASE": "pp",
            },
            Credentials(ssh_key="/k", ssh_pubkey="/k.pub", passphrase="pp"),
            id="ssh-key",
        ),
    ],
)
def test_credentials_from_env(environ, expected):
    assert Credentials.from_env(environ) == expected


SSH_KEY = Credentials("deploy", ssh_key="/k", ssh_pubkey="/k.pub", passphrase="pp")


@pytest.mark.parametrize(
    ("credentials", "from_url", "allowed", "offered"),
    [
        pytest.param(None, None, "USERNAME", ("git",), id="ssh-asks-for-a-user"),
        pytest.param(SSH_KEY, "git", "SSH_KEY", ("deploy", "/k.pub", "/k", "pp"), id="ssh-key"),
        pytest.param(None, "git", "SSH_KEY", ("git", None, None, None), id="ssh-agent"),
        pytest.param(Credentials("u", "t"), None, "USERPASS_PLAINTEXT", ("u", "t"), id="http"),
    ],
)
def test_credentials_offered_per_transport(credentials, from_url, allowed, offered):
    # no sshd here: the SSH choices are checked at the callback libgit2 calls
    callbacks = _Callbacks(credentials, deadline=time.monotonic() + 60)
    kind = CredentialType[allowed]
    assert callbacks.credentials("ssh://h/r", from_url, kind).credential_tuple == offered
    with pytest.raises(_AuthFailed, match="authentication failed"):
        callbacks.credentials("ssh://h/r", from_url, kind)  # asked again: refused


def test_credentials_repr_hides_secrets():
    shown = repr(Credentials("bot", PASSWORD, "/k", passphrase=PASSWORD))
    assert PASSWORD not in shown
    assert shown == (
        "Credentials(username='bot', password=***, passphrase=***, ssh_key='/k', ssh_pubkey=None)"
    )


# -- seeding a repository from a directory -------------------------------------------------


def _plain_directory(root: Path) -> Path:
    for rel, text in {
        "functions/hello/sless.yaml": "functions: []\n",
        "functions/hello/run.sh": "#!/bin/sh\necho hi\n",
        "functions/hello/__pycache__/x.pyc": "junk",
        "functions/hello/node_modules/dep/index.js": "junk",
        "functions/hello/.sless-deps/lib.py": "junk",
        "README.md": "# fns\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    os.chmod(root / "functions/hello/run.sh", 0o755)
    os.symlink("../../README.md", root / "functions/hello/README.md")
    os.symlink("/etc/passwd", root / "outside")  # kept as a link, never read through
    return root


def test_seed_repository_holds_the_directory(tmp_path):
    directory = _plain_directory(tmp_path / "plain")
    bare = seed_repository(directory, tmp_path / "srv" / "fns.git")
    assert bare == tmp_path / "srv" / "fns.git" and is_repository(bare)
    assert [p.name for p in bare.parent.iterdir()] == ["fns.git"]  # no staging left behind

    repo = pygit2.Repository(str(bare))
    commit = repo.references["refs/heads/main"].peel(pygit2.Commit)
    assert repo.head.name == "refs/heads/main"
    assert (commit.author.name, commit.author.email) == ("gitops-sless", "gitops-sless@localhost")
    assert (commit.committer.name, commit.committer.email) == (
        commit.author.name,
        "gitops-sless@localhost",
    )
    assert str(commit.tree.id) == DirectorySnapshot(directory).tree_id("")
    tree = commit.tree
    assert tree["functions/hello/run.sh"].filemode == pygit2.enums.FileMode.BLOB_EXECUTABLE
    assert tree["functions/hello/sless.yaml"].filemode == pygit2.enums.FileMode.BLOB
    assert tree["outside"].filemode == pygit2.enums.FileMode.LINK
    assert repo[tree["outside"].id].data == b"/etc/passwd"
    names = {path for path, _ in DirectorySnapshot(directory).walk()}
    assert not {n for n in names if any(s in n for s in ("__pycache__", "node_modules", ".sless"))}


def test_seeded_repository_clones_pushes_and_survives_restarts(tmp_path):
    directory = _plain_directory(tmp_path / "plain")
    bare = seed_repository(directory, tmp_path / "fns.git")
    clone = tmp_path / "clone"
    git("clone", "--quiet", bare, clone)
    assert (clone / "README.md").read_text() == "# fns\n"
    assert os.stat(clone / "functions/hello/run.sh").st_mode & stat.S_IXUSR
    assert os.readlink(clone / "functions/hello/README.md") == "../../README.md"
    assert not (clone / "functions/hello/__pycache__").exists()

    work = WorkRepo(clone)
    pushed = work.commit("user change", {"README.md": "# changed\n"})
    work.push(str(bare))
    (directory / "README.md").write_text("# directory changed too\n")

    assert seed_repository(directory, bare) == bare
    mirror = Mirror(str(bare), "main", tmp_path / "mirror.git")
    assert mirror.fetch().commit == pushed
    assert mirror.snapshot().read("README.md") == b"# changed\n"


def test_seed_refuses_a_non_repository_target(tmp_path):
    directory = _plain_directory(tmp_path / "plain")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(SourceError, match="not a git repository"):
        seed_repository(directory, tmp_path / "busy")
    (tmp_path / "empty").mkdir()
    assert is_repository(seed_repository(directory, tmp_path / "empty"))


def test_is_repository(tmp_path, work_repo):
    bare = init_bare(tmp_path / "bare.git")
    (work_repo.path / "sub").mkdir()
    assert is_repository(work_repo.path) and is_repository(bare)
    assert not is_repository(work_repo.path / "sub")
    assert not is_repository(bare / "objects")
    assert not is_repository(tmp_path / "missing")
    assert not is_repository(tmp_path)
