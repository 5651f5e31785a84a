"""The repository mirror: a bare repository that follows one branch (and PR heads) of a remote.

``Mirror.fetch()`` is the only place that talks to the network. It fetches into a
staging ref and moves the branch only after the fetch succeeded and the branch
was found, so a failed fetch leaves the mirror exactly as it was. Every pygit2 or
OS error from a fetch becomes a ``FetchError`` (transient: retry later) whose
message names the URL with its password redacted.

An ``ssh://`` server must present a host key that the ``known_hosts`` file holds
for it (``known_hosts.check``); with no file, every SSH host key is refused.

Each fetch has an overall deadline, ``timeout_sec``: the fetch runs in a child
process (``fetcher.FetchWorker``) that is stopped when the deadline passes, even
while libgit2 is still reading the server's ref list, where no callback runs.

``seed_repository()`` turns a plain directory into a bare repository users can
clone and push to, for ``serve --repo <directory>``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pygit2
from pygit2.enums import RepositoryOpenFlag

from ..errors import SourceError, TransientError
from ..redact import url_passwords
from .fetcher import (
    Credentials,
    FetchRequest,
    FetchWorker,
    WorkerFailed,
    _AuthFailed,
    _Callbacks,  # noqa: F401 - tests/source/test_mirror.py checks the credentials offered here
    _Deadline,
)
from .snapshot import GitSnapshot

__all__ = [
    "Credentials",  # defined in fetcher, where the child process uses it
    "FetchError",
    "FetchResult",
    "Mirror",
    "redact",
]

log = logging.getLogger(__name__)

_STAGING = "refs/sless/incoming/"
_PREVIEW_REF = re.compile(r"^refs/(?:pull|merge-requests)/(\d+)/head$")
_PREVIEW_SPECS = (
    "+refs/pull/*/head:refs/pull/*/head",
    "+refs/merge-requests/*/head:refs/merge-requests/*/head",
)


_GIT_ERRORS = (pygit2.GitError, OSError, KeyError, ValueError)


class FetchError(TransientError):
    """A fetch failed: network, timeout, server error, authentication, or a missing branch."""


def _parse_userinfo(url: str) -> tuple[str, str, str, str] | None:
    """``(scheme://, user, password, host-and-rest)`` of a URL carrying a password, else None."""
    scheme, sep, rest = url.partition("://")
    end = next((i for i, char in enumerate(rest) if char in "/?#"), len(rest))
    # the last "@" ends the userinfo: an unencoded "@" in a password stays hidden
    userinfo, at, host = rest[:end].rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not (sep and at and colon):
        return None
    return f"{scheme}://", user, password, host + rest[end:]


def redact(url: str) -> str:
    """``url`` with the password of ``user:password@`` shown as ``***``."""
    parsed = _parse_userinfo(url)
    if parsed is None:
        return url
    prefix, user, _, rest = parsed
    return f"{prefix}{user}:***@{rest}"


def _split_userinfo(url: str) -> tuple[str, Credentials | None]:
    """``url`` without its password, and the user and password it carried.

    libgit2 never sees the password, so it cannot end up in FETCH_HEAD or in an
    error message; the credentials callback hands it over instead.
    """
    parsed = _parse_userinfo(url)
    if parsed is None:
        return url, None
    prefix, user, password, rest = parsed
    stripped = f"{prefix}{user}@{rest}" if user else f"{prefix}{rest}"
    return stripped, Credentials(username=unquote(user) or None, password=unquote(password))


@dataclass(frozen=True)
class FetchResult:
    """What one fetch did: the branch head before and after, and how much it received."""

    commit: str
    previous: str | None
    changed: bool
    received_objects: int


class Mirror:
    """A bare repository at ``path`` that follows ``branch`` of ``url``.

    ``known_hosts``: the OpenSSH known_hosts file an ``ssh://`` server's key must be in.

    ``fetch()`` runs one at a time; ``head()``, ``snapshot()`` and the other readers
    may run at any time, from any thread, and older commits stay readable.
    """

    def __init__(
        self,
        url: str,
        branch: str,
        path: Path,
        credentials: Credentials | None = None,
        timeout_sec: float = 120,
        preview_refs: bool = False,
        known_hosts: Path | None = None,
    ) -> None:
        if not pygit2.reference_is_valid_name(f"refs/heads/{branch}"):
            raise SourceError(f"branch {branch!r}: not a valid branch name")
        self.url = url
        self.branch = branch
        self.path = Path(path)
        self.credentials = credentials
        self.timeout_sec = timeout_sec
        self.preview_refs = preview_refs
        self.known_hosts = known_hosts
        self._ref = f"refs/heads/{branch}"
        self._lock = threading.Lock()
        self._fetch_url, url_creds = _split_userinfo(url)
        self._auth = credentials or url_creds
        self._secrets = [s for c in (credentials, url_creds) if c for s in c.secrets()]
        self._worker = FetchWorker()
        # a fetch stopped half way (or a crash) may have left lock files behind
        self._interrupted = True

    def close(self) -> None:
        """Stop the process fetches run in (the next fetch starts another one).

        Not under the fetch lock: a shutdown does not wait for a fetch to end, it ends it.
        """
        self._worker.close()

    def __repr__(self) -> str:
        return f"Mirror({redact(self.url)!r}, branch={self.branch!r}, path={str(self.path)!r})"

    # -- reading ---------------------------------------------------------------------------

    def _open(self) -> pygit2.Repository | None:
        # NO_SEARCH: a mirror path inside another repository must not open that one
        try:
            return pygit2.Repository(str(self.path), RepositoryOpenFlag.NO_SEARCH)
        except pygit2.GitError:
            return None

    def head(self) -> str | None:
        """The commit of the tracked branch in the mirror, or ``None`` before the first fetch."""
        repo = self._open()
        ref = repo.references.get(self._ref) if repo is not None else None
        return str(ref.target) if ref is not None else None

    def snapshot(self, commit: str | None = None) -> GitSnapshot:
        """The files of ``commit`` (default: the branch head), read from git objects."""
        repo = self._open()
        revision = commit or self.head()
        if repo is None or revision is None:
            raise SourceError(f"{redact(self.url)}: nothing fetched yet for branch {self.branch!r}")
        try:
            found = repo.revparse_single(revision).peel(pygit2.Commit)
        except (KeyError, ValueError, pygit2.GitError) as exc:
            raise SourceError(f"{redact(self.url)}: no commit {revision!r} in the mirror") from exc
        return GitSnapshot(repo, found)

    def preview_heads(self) -> dict[int, str]:
        """PR/MR number -> head commit (``refs/pull/N/head``, ``refs/merge-requests/N/head``).

        Empty unless ``preview_refs``: refs left from an earlier configuration are not previews.
        """
        repo = self._open()
        if repo is None or not self.preview_refs:
            return {}
        heads: dict[int, str] = {}
        for name in repo.references:
            match = _PREVIEW_REF.match(name)
            if match:
                target = repo.references[name].peel(pygit2.Commit).id
                heads.setdefault(int(match.group(1)), str(target))
        return heads

    def is_ancestor(self, commit: str, of: str) -> bool:
        """Whether ``commit`` is ``of`` or one of its ancestors (merged into it).

        A commit the mirror does not hold is no ancestor of anything it holds.
        """
        repo = self._open()
        if repo is None:
            return False
        try:
            a, b = (repo.revparse_single(c).peel(pygit2.Commit).id for c in (commit, of))
            return a == b or repo.descendant_of(b, a)
        except (KeyError, ValueError, pygit2.GitError):
            return False

    # -- fetching --------------------------------------------------------------------------

    def _refspecs(self) -> list[str]:
        specs = [f"+{self._ref}:{_STAGING}{self.branch}"]
        return specs + list(_PREVIEW_SPECS) if self.preview_refs else specs

    def _init(self) -> pygit2.Repository:
        repo = self._open()
        if repo is not None:
            return repo
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise SourceError(f"{self.path}: exists and is not a git repository; not a mirror")
        return pygit2.init_repository(str(self.path), bare=True, initial_head=self.branch)

    def fetch(self) -> FetchResult:
        """Fetch the branch (and PR heads when ``preview_refs``); raise ``FetchError`` on failure.

        The branch is force-updated: a force push on the remote wins. A failed fetch
        changes nothing.
        """
        with self._lock:
            started = time.monotonic()
            log.debug("fetch %s branch %r into %s", redact(self.url), self.branch, self.path)
            try:
                received = self._transfer(self._init())
                result = self._promote(self._init(), received)  # opened again: new packs
            except FetchError as exc:
                log.warning("%s", exc)
                raise
            except (_Deadline, _AuthFailed, WorkerFailed, *_GIT_ERRORS) as exc:
                raise self._failure(exc, started) from self._chainable(exc)
            # an idle poll is routine: only a moved branch is worth INFO
            log.log(
                logging.INFO if result.changed else logging.DEBUG,
                "fetched %s %s: %s -> %s (%d objects, %.2fs)",
                redact(self.url),
                self.branch,
                (result.previous or "none")[:12],
                result.commit[:12],
                result.received_objects,
                time.monotonic() - started,
            )
            return result

    def _transfer(self, repo: pygit2.Repository) -> int:
        if self._interrupted:
            _remove_stale_locks(self.path)
        staging = f"{_STAGING}{self.branch}"
        if staging in repo.references:
            repo.references.delete(staging)  # left by a crash: it must not pass for a result
        request = FetchRequest(
            path=str(self.path),
            url=self._fetch_url,
            refspecs=self._refspecs(),
            message=f"fetch {redact(self.url)}",
            credentials=self._auth,
            timeout_sec=self.timeout_sec,
            known_hosts=str(self.known_hosts) if self.known_hosts else None,
        )
        try:
            return self._worker.fetch(request)
        finally:
            self._interrupted = self._worker.killed

    def _promote(self, repo: pygit2.Repository, received: int) -> FetchResult:
        staging = repo.references.get(f"{_STAGING}{self.branch}")
        if staging is None:
            # libgit2 fetches nothing, silently, for a branch the remote lacks
            raise FetchError(f"branch {self.branch!r} not found at {redact(self.url)}")
        new = staging.peel(pygit2.Commit).id
        old = repo.references.get(self._ref)
        previous = str(old.target) if old is not None else None
        repo.references.create(self._ref, new, force=True)
        staging.delete()
        commit = str(new)
        return FetchResult(commit, previous, commit != previous, received)

    def _failure(self, exc: BaseException, started: float) -> FetchError:
        where = redact(self.url)
        if isinstance(exc, _Deadline) or "timed out" in str(exc).lower():
            cause = f"timed out after {self.timeout_sec:g}s"
            if not isinstance(exc, _Deadline):
                cause += f" ({self._scrub(str(exc))})"
        elif str(exc) == "unsupported URL protocol" and "://" not in self.url:
            cause = "no repository at this path"
        else:
            cause = self._scrub(str(exc)) or type(exc).__name__
        elapsed = time.monotonic() - started
        log.warning("fetch %s branch %r failed after %.2fs: %s", where, self.branch, elapsed, cause)
        return FetchError(f"fetch {where} (branch {self.branch!r}): {cause}")

    def _scrub(self, text: str) -> str:
        text = url_passwords(text, "***")  # inside any URL (libgit2's messages, for instance)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _chainable(self, exc: BaseException) -> BaseException | None:
        # a traceback prints the cause too: drop it rather than show a secret
        return exc if self._scrub(str(exc)) == str(exc) else None


def _remove_stale_locks(path: Path) -> None:
    """Lock files and half-written packs a stopped fetch left; only a fetch writes them."""
    leftovers = [
        *path.glob("*.lock"),  # packed-refs.lock, FETCH_HEAD.lock, config.lock
        *(path / "refs").rglob("*.lock"),
        *(path / "objects" / "pack").glob("pack_git2_*"),
    ]
    for leftover in leftovers:
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
            log.info("removed %s, left by a fetch that was stopped", leftover)
