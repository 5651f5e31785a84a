"""``ssh://`` remotes against a real OpenSSH server on loopback: the mirror, then ``serve``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pygit2
import pytest
from pygit2.enums import Feature

from gitops_sless.errors import TransientError
from gitops_sless.mirror import Credentials, FetchError, Mirror

from .gitserver import WorkRepo, init_bare
from .sless_server import SlessServer
from .sshserver import Sshd, keygen
from .test_serve import http_function


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    with Sshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME of the test's own: libgit2 reads ``~/.ssh/known_hosts`` from there."""
    folder = tmp_path / "home"
    (folder / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(folder))  # before a mirror starts its fetch process
    return folder


class Remote:
    """A bare repository the sshd serves, and a work tree that pushes to it on disk."""

    def __init__(self, tmp_path: Path, sshd: Sshd) -> None:
        self.bare = init_bare(tmp_path / "served" / "functions.git")
        self.url = sshd.url(self.bare)
        self.work = WorkRepo(tmp_path / "work")

    def push(self, files: dict[str, str | None]) -> str:
        commit = self.work.commit("change", files)
        self.work.push(str(self.bare))
        return commit


@pytest.fixture
def remote(tmp_path: Path, sshd: Sshd) -> Remote:
    return Remote(tmp_path, sshd)


def _key(sshd: Sshd, key: Path | None = None) -> Credentials:
    key = key or sshd.client_key
    return Credentials(ssh_key=str(key), ssh_pubkey=f"{key}.pub")


def test_pygit2_here_speaks_ssh():
    # without it every ssh:// remote fails: this must fail loudly, never be skipped
    assert pygit2.features & Feature.SSH, f"pygit2 {pygit2.__version__} was built without SSH"


def test_a_mirror_follows_a_branch_over_ssh_with_a_key(remote, sshd, home, tmp_path):
    first = remote.push({"a.txt": "one\n"})
    mirror = Mirror(remote.url, "main", tmp_path / "mirror.git", credentials=_key(sshd))
    try:
        assert mirror.fetch().commit == first
        second = remote.push({"a.txt": "two\n"})
        result = mirror.fetch()
        assert (result.previous, result.commit, result.changed) == (first, second, True)
        assert mirror.snapshot().read("a.txt") == b"two\n"
        assert not mirror.fetch().changed
    finally:
        mirror.close()
    assert f"Accepted publickey for {sshd.user}" in sshd.output()


def test_a_key_the_server_does_not_know_is_one_clear_line(remote, sshd, home, tmp_path):
    commit = remote.push({"a.txt": "one\n"})
    path = tmp_path / "mirror.git"
    Mirror(remote.url, "main", path, credentials=_key(sshd)).fetch()
    remote.push({"a.txt": "two\n"})
    stranger = keygen(tmp_path / "stranger")
    mirror = Mirror(remote.url, "main", path, credentials=_key(sshd, stranger))
    with pytest.raises(FetchError) as info:
        mirror.fetch()
    message = str(info.value)
    assert message == (
        f"fetch {remote.url} (branch 'main'): authentication failed for user "
        f"{sshd.user!r} with the SSH key {stranger}"
    )
    assert isinstance(info.value, TransientError)  # the key may be authorized later
    assert mirror.head() == commit  # nothing changed
    mirror.close()


def test_a_missing_key_file_is_one_line(remote, sshd, home, tmp_path):
    remote.push({"a.txt": "one\n"})
    missing = tmp_path / "no-such-key"
    mirror = Mirror(remote.url, "main", tmp_path / "mirror.git", credentials=_key(sshd, missing))
    with pytest.raises(FetchError, match=r"^fetch ssh://\S+ \(branch 'main'\): .*key file") as info:
        mirror.fetch()
    assert "\n" not in str(info.value)
    mirror.close()


@pytest.mark.parametrize("known", ["this-key", "no-entry", "another-key"])
def test_the_host_key_is_not_checked(known, remote, sshd, home, tmp_path):
    """What the code does today, pinned so that changing it is a decision.

    libgit2 compares the host key with ``~/.ssh/known_hosts`` and says whether it
    matches, but pygit2's default certificate check lets every SSH host key through
    (pygit2/callbacks.py ``_certificate_check_cb``), and the mirror does not override
    it: a host key that contradicts known_hosts is accepted as well.
    """
    other = keygen(tmp_path / "other_host").with_suffix(".pub").read_text().split()[:2]
    lines = {
        "this-key": sshd.known_hosts_line(),
        "no-entry": "",
        "another-key": f"[127.0.0.1]:{sshd.port} {' '.join(other)}\n",
    }
    (home / ".ssh" / "known_hosts").write_text(lines[known])
    commit = remote.push({"a.txt": "one\n"})
    mirror = Mirror(remote.url, "main", tmp_path / "mirror.git", credentials=_key(sshd))
    assert mirror.fetch().commit == commit
    mirror.close()


def test_serve_follows_an_ssh_remote(remote, sshd, home, tmp_path):
    remote.push(http_function("greet", "over ssh v1"))
    env = {
        "HOME": str(home),
        "SLESS_GIT_SSH_KEY": str(sshd.client_key),
        "SLESS_GIT_SSH_PUBKEY": f"{sshd.client_key}.pub",
    }
    server = SlessServer(remote.url, tmp_path / "state", env=env)
    try:
        server.start()
        assert server.call("greet").json()["message"] == "over ssh v1", server.output()
        revision = remote.push(http_function("greet", "over ssh v2"))
        assert server.sync()["revision"] == revision
        assert server.call("greet").json()["message"] == "over ssh v2"
    finally:
        server.stop()
