"""``ssh://`` remotes against a real OpenSSH server on loopback: the mirror, then ``serve``.

The server's host key is checked against a known-hosts file; the attacker here is
whoever answers on the server's address with a key of their own.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pygit2
import pytest
from pygit2.enums import CredentialType, Feature

from gitops_sless.errors import TransientError
from gitops_sless.source.fetcher import _Callbacks
from gitops_sless.source.known_hosts import HostKeyRefused
from gitops_sless.source.mirror import Credentials, FetchError, Mirror

from ..gitserver import WorkRepo, init_bare
from ..sless_server import SlessServer
from ..sshserver import Sshd, keygen
from ..test_serve import http_function
from ..test_serve_start import assert_refused, serve


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


@pytest.fixture
def known_hosts(tmp_path: Path, sshd: Sshd) -> Path:
    """A known-hosts file that holds the test server's key, as ssh-keyscan writes it."""
    path = tmp_path / "known_hosts"
    path.write_text(sshd.known_hosts_line())
    return path


def fingerprint(key: Path) -> str:
    """OpenSSH's own word for a key's fingerprint: ``SHA256:...`` from ``ssh-keygen -l``."""
    listed = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", f"{key}.pub"],
        check=True,
        capture_output=True,
        text=True,
    )
    return listed.stdout.split()[1]


def public_key(key: Path) -> str:
    """``ssh-ed25519 AAAA...``: type and key, as a known_hosts line holds them."""
    return " ".join(Path(f"{key}.pub").read_text().split()[:2])


def keyscan(sshd: Sshd, *flags: str) -> str:
    scanned = subprocess.run(
        ["ssh-keyscan", *flags, "-p", str(sshd.port), "127.0.0.1"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert scanned.stdout.strip(), scanned.stderr
    return scanned.stdout


def _key(sshd: Sshd, key: Path | None = None) -> Credentials:
    key = key or sshd.client_key
    return Credentials(ssh_key=str(key), ssh_pubkey=f"{key}.pub")


def test_pygit2_here_speaks_ssh():
    # without it every ssh:// remote fails: this must fail loudly, never be skipped
    assert pygit2.features & Feature.SSH, f"pygit2 {pygit2.__version__} was built without SSH"


def test_a_mirror_follows_a_branch_over_ssh_with_a_key(remote, sshd, home, known_hosts, tmp_path):
    first = remote.push({"a.txt": "one\n"})
    mirror = Mirror(
        remote.url,
        "main",
        tmp_path / "mirror.git",
        credentials=_key(sshd),
        known_hosts=known_hosts,
    )
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


def test_a_key_the_server_does_not_know_is_one_clear_line(
    remote, sshd, home, known_hosts, tmp_path
):
    commit = remote.push({"a.txt": "one\n"})
    path = tmp_path / "mirror.git"
    Mirror(remote.url, "main", path, credentials=_key(sshd), known_hosts=known_hosts).fetch()
    remote.push({"a.txt": "two\n"})
    stranger = keygen(tmp_path / "stranger")
    mirror = Mirror(
        remote.url, "main", path, credentials=_key(sshd, stranger), known_hosts=known_hosts
    )
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


def test_a_missing_key_file_is_one_line(remote, sshd, home, known_hosts, tmp_path):
    remote.push({"a.txt": "one\n"})
    missing = tmp_path / "no-such-key"
    mirror = Mirror(
        remote.url,
        "main",
        tmp_path / "mirror.git",
        credentials=_key(sshd, missing),
        known_hosts=known_hosts,
    )
    with pytest.raises(FetchError, match=r"^fetch ssh://\S+ \(branch 'main'\): .*key file") as info:
        mirror.fetch()
    assert "\n" not in str(info.value)
    mirror.close()


# -- the server's host key ---------------------------------------------------------------


def test_a_server_with_another_key_on_the_same_address_gets_nothing(
    remote, sshd, home, known_hosts, tmp_path
):
    """Someone takes over the server's address (DNS, a route, a port freed on a shared
    host) with a host key of their own, serves a commit of theirs, and would let the
    mirror's key in: the fetch is refused before any credential is offered."""
    first = remote.push({"a.txt": "one\n"})
    mirror = Mirror(
        remote.url,
        "main",
        tmp_path / "mirror.git",
        credentials=_key(sshd),
        known_hosts=known_hosts,
    )
    try:
        assert mirror.fetch().commit == first
        theirs = WorkRepo(tmp_path / "theirs")
        planted = theirs.commit("planted", {"a.txt": "theirs\n"})
        theirs.push(str(init_bare(tmp_path / "theirs.git")))
        sshd.stop()
        impostor = Sshd(
            tmp_path / "impostor",
            client_key=sshd.client_key,
            config=f"ForceCommand git-upload-pack '{tmp_path / 'theirs.git'}'\n",
        )
        impostor.start(port=sshd.port)
        try:
            with pytest.raises(FetchError) as info:
                mirror.fetch()
        finally:
            impostor.stop()
        served = impostor.output()
        message = str(info.value)
        assert message.startswith(
            f"fetch {remote.url} (branch 'main'): ssh host key of [127.0.0.1]:{sshd.port} "
            f"has changed: it presents ssh-ed25519 {fingerprint(impostor.host_key)}, "
            f"{known_hosts} holds {fingerprint(sshd.host_key)} (line 1); "
        ), message
        assert "--ssh-known-hosts" in message
        assert f"ssh-keyscan -p {sshd.port} 127.0.0.1" in message
        assert "\n" not in message
        assert isinstance(info.value, TransientError)  # the file is read again next time
        assert mirror.head() == first
        assert planted not in pygit2.Repository(str(tmp_path / "mirror.git"))
        assert "Accepted publickey" not in served, served
    finally:
        mirror.close()


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        pytest.param(
            lambda s, other: f"[127.0.0.1]:{s.port} {other}\n", "has changed", id="another-key"
        ),
        pytest.param(lambda s, other: "", "is unknown", id="no-entry"),
        pytest.param(
            lambda s, other: f"127.0.0.1 {public_key(s.host_key)}\n",
            "is unknown",
            id="this-key-for-port-22",
        ),
        pytest.param(
            lambda s, other: f"[127.0.0.2]:{s.port} {public_key(s.host_key)}\n",
            "is unknown",
            id="this-key-for-another-host",
        ),
        pytest.param(
            lambda s, other: (
                f"[127.0.0.*]:{s.port},![127.0.0.1]:{s.port} {public_key(s.host_key)}\n"
            ),
            "is unknown",
            id="this-key-negated",
        ),
        pytest.param(
            lambda s, other: s.known_hosts_line() + f"@revoked * {public_key(s.host_key)}\n",
            "@revoked",
            id="this-key-revoked",
        ),
        pytest.param(
            lambda s, other: f"@cert-authority [127.0.0.1]:{s.port} {public_key(s.host_key)}\n",
            "is unknown",
            id="this-key-as-a-certificate-authority",
        ),
    ],
)
def test_a_host_key_the_file_does_not_hold_for_the_server_is_refused(
    lines, says, remote, sshd, home, tmp_path
):
    other = public_key(keygen(tmp_path / "other_host"))
    path = tmp_path / "known_hosts"
    path.write_text(lines(sshd, other))
    # libgit2 reads ~/.ssh/known_hosts on its own: holding the key there changes nothing
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line())
    remote.push({"a.txt": "one\n"})
    mirror = Mirror(
        remote.url, "main", tmp_path / "mirror.git", credentials=_key(sshd), known_hosts=path
    )
    with pytest.raises(FetchError) as info:
        mirror.fetch()
    mirror.close()
    message = str(info.value)
    for word in (
        f"ssh host key of [127.0.0.1]:{sshd.port}",
        f"ssh-ed25519 {fingerprint(sshd.host_key)}",
        "--ssh-known-hosts",
        says,
    ):
        assert word in message, message
    assert mirror.head() is None
    assert "Accepted publickey" not in sshd.output()


def test_with_no_known_hosts_file_every_host_key_is_refused(remote, sshd, home, tmp_path):
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line())
    remote.push({"a.txt": "one\n"})
    mirror = Mirror(remote.url, "main", tmp_path / "mirror.git", credentials=_key(sshd))
    with pytest.raises(FetchError) as info:
        mirror.fetch()
    mirror.close()
    assert str(info.value) == (
        f"fetch {remote.url} (branch 'main'): ssh host key of [127.0.0.1]:{sshd.port} "
        f"(ssh-ed25519 {fingerprint(sshd.host_key)}) cannot be checked: no known-hosts file "
        "(~/.ssh/known_hosts did not exist at start); pass --ssh-known-hosts PATH "
        "($SLESS_SSH_KNOWN_HOSTS)"
    )
    assert mirror.head() is None


def hashed(text: str, folder: Path) -> str:
    """``text`` with every host name hashed by OpenSSH (``ssh-keygen -H``)."""
    path = folder / "to_hash"
    path.write_text(text)
    subprocess.run(["ssh-keygen", "-H", "-f", str(path)], check=True, capture_output=True)
    return path.read_text()


@pytest.mark.parametrize(
    "lines",
    [
        pytest.param(lambda s, tmp: s.known_hosts_line(), id="plain"),
        pytest.param(lambda s, tmp: keyscan(s), id="ssh-keyscan"),
        pytest.param(lambda s, tmp: keyscan(s, "-H"), id="ssh-keyscan-hashed"),
        pytest.param(
            lambda s, tmp: hashed(
                f"# ours\n\ngit.example.com {public_key(keygen(tmp / 'other'))}\n"
                f"[127.0.0.1]:{s.port + 1} {public_key(keygen(tmp / 'next'))}\n"
                + s.known_hosts_line(),
                tmp,
            ),
            id="hashed-among-others",
        ),
        pytest.param(
            lambda s, tmp: f"git.example.com,[127.0.0.?]:{s.port} {public_key(s.host_key)} c\n",
            id="pattern-in-a-list",
        ),
        pytest.param(
            lambda s, tmp: (
                f"[127.0.0.1]:{s.port} {public_key(keygen(tmp / 'old'))}\n" + s.known_hosts_line()
            ),
            id="after-another-key",
        ),
    ],
)
def test_the_server_key_in_the_file_is_accepted(lines, remote, sshd, home, tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(lines(sshd, tmp_path))
    commit = remote.push({"a.txt": "one\n"})
    mirror = Mirror(
        remote.url, "main", tmp_path / "mirror.git", credentials=_key(sshd), known_hosts=path
    )
    try:
        assert mirror.fetch().commit == commit
    finally:
        mirror.close()


def test_serve_follows_an_ssh_remote(remote, sshd, home, tmp_path):
    # no --ssh-known-hosts: ~/.ssh/known_hosts is the file, as for OpenSSH
    (home / ".ssh" / "known_hosts").write_text(keyscan(sshd, "-H"))
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


def test_serve_reports_a_changed_host_key_and_deploys_nothing(remote, sshd, home, tmp_path):
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line())  # not the file used
    path = tmp_path / "pinned_hosts"
    path.write_text(f"[127.0.0.1]:{sshd.port} {public_key(keygen(tmp_path / 'pinned'))}\n")
    remote.push(http_function("greet", "served by whoever answers"))
    env = {
        "HOME": str(home),
        "SLESS_GIT_SSH_KEY": str(sshd.client_key),
        "SLESS_GIT_SSH_PUBKEY": f"{sshd.client_key}.pub",
    }
    server = SlessServer(
        remote.url, tmp_path / "state", env=env, args=["--ssh-known-hosts", str(path)]
    )
    try:
        server.start()
        error = server.syncs()[-1]["error"]
        for word in (
            f"[127.0.0.1]:{sshd.port} has changed",
            f"ssh-ed25519 {fingerprint(sshd.host_key)}",
            "--ssh-known-hosts",
        ):
            assert word in error, error
            assert word in server.output()
        assert server.function("greet") is None
        assert server.call("greet").status_code == 404
    finally:
        server.stop()
    assert "Accepted publickey" not in sshd.output()


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_a_known_hosts_file_that_does_not_exist_is_refused_at_start(how, tmp_path):
    missing = tmp_path / "known_hosts"
    flag = ["--ssh-known-hosts", str(missing)] if how == "flag" else []
    env = {"SLESS_SSH_KNOWN_HOSTS": str(missing)} if how == "variable" else {}
    proc = serve(tmp_path, "--repo", "ssh://git@git.example.com/team/f.git", *flag, env=env)
    assert_refused(proc, f"--ssh-known-hosts {missing}: no such file", "ssh-keyscan")


def test_no_credential_goes_to_an_ssh_server_whose_key_was_not_checked(tmp_path):
    """Should a libgit2 or pygit2 upgrade stop handing the key to the check, the
    credentials callback refuses rather than authenticate to an unchecked server."""
    url = "ssh://git@git.example.com:2222/team/functions.git"
    key = keygen(tmp_path / "client")
    callbacks = _Callbacks(
        Credentials(ssh_key=str(key), ssh_pubkey=f"{key}.pub"),
        time.monotonic() + 60,
        str(tmp_path / "known_hosts"),
        url,
    )
    with pytest.raises(HostKeyRefused, match=r"^ssh host key not checked"):
        callbacks.credentials(url, "git", CredentialType.SSH_KEY)
