"""The web page of a pull request, from the repository's clone URL: a link for people.

Only what a forge's URL layout makes certain: GitHub ``/owner/repo/pull/N``, Gitea
``/owner/repo/pulls/N``, GitLab ``/group/project/-/merge_requests/N``. A repository on a
host that names no forge (and no ``--forge`` given), or a local path, has no link.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["pull_request_link"]

_PATHS = {"github": "pull", "gitea": "pulls", "gitlab": "-/merge_requests"}


def _web_base(repository: str) -> tuple[str, str] | None:
    """(https://host[/path to the repository], host) of a clone URL; None for a local path."""
    found = re.match(r"^(?:[^@/]+@)?([^:/]+):(?!//)(.+)$", repository.strip())
    if "://" not in repository and found:  # scp-like: git@host:owner/repo.git
        host, path = found.group(1), found.group(2)
        scheme = "https"
    else:
        parts = urlsplit(repository.strip())
        if parts.scheme not in ("http", "https", "ssh", "git") or not parts.hostname:
            return None
        host, path = parts.hostname, parts.path
        scheme = parts.scheme if parts.scheme in ("http", "https") else "https"
        if parts.port and scheme == parts.scheme:  # an SSH port is not the web server's
            host = f"{host}:{parts.port}"
    path = path.strip("/").removesuffix(".git")
    if path.count("/") < 1:
        return None
    return f"{scheme}://{host}/{path}", host


def _kind(host: str) -> str | None:
    name = host.lower().split(":")[0]
    if name in ("github.com", "www.github.com"):
        return "github"
    return next((kind for kind in ("gitlab", "gitea") if kind in name), None)


def pull_request_link(repository: str, number: int, forge: str | None = None) -> str | None:
    """The pull request's page, or None when the repository's forge cannot be told."""
    base = _web_base(repository)
    if base is None:
        return None
    kind = forge or _kind(base[1])
    if kind not in _PATHS:
        return None
    return f"{base[0]}/{_PATHS[kind]}/{int(number)}"
