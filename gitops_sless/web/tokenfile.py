"""The API token a local server keeps in its state folder, and how the CLI finds it.

On the local backend, functions run on the reconciler's own machine and share its
loopback: an API without a token would be open to every function. So ``serve`` on
the local backend always has one: the configured ``--api-token``/``--read-token``,
else a random read/write token it generates on its first start and keeps in
``<state-dir>/api-token`` (mode 0600, reused by later starts). The command line on
the same machine reads it from there (:func:`find`), so ``gitops-sless status`` and
``sync`` work in a new shell with nothing set.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

__all__ = ["NAME", "STATE_DIR", "TokenFileError", "find", "find_state_dir", "load_or_create"]

NAME = "api-token"
STATE_DIR = ".sless-state"  # serve's default --state-dir, found from the working directory


class TokenFileError(Exception):
    """The token file cannot be used: its message names the file and what is wrong."""


def load_or_create(state_dir: Path) -> str:
    """The token in ``state_dir/api-token``; a new random one written there (0600) if none."""
    path = state_dir / NAME
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return read(path)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token


def read(path: Path) -> str:
    """The token a token file holds; TokenFileError if others may read it, or it holds none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot read the API token: {exc.strerror}") from exc
    with os.fdopen(fd) as found:
        mode = os.fstat(found.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise TokenFileError(f"{path}: not a regular file; remove it to get a new token")
        if mode & 0o077:
            raise TokenFileError(
                f"{path}: mode {stat.S_IMODE(mode):04o} lets other users read the API token; "
                f"run chmod 600 {path}"
            )
        token = found.read().strip()
    if not token or any(c.isspace() for c in token):
        raise TokenFileError(f"{path}: holds no token (one line expected); remove it")
    return token


def find_state_dir(start: Path) -> Path | None:
    """The nearest ``.sless-state`` holding a token file, from ``start`` up (as git finds
    ``.git``); None when there is none."""
    for folder in (start, *start.parents):
        if (folder / STATE_DIR / NAME).exists():
            return folder / STATE_DIR
    return None


def find(state_dir: str | None, cwd: Path) -> tuple[str, Path] | None:
    """(token, file) of ``state_dir`` when one is given, else of the ``.sless-state`` found
    from ``cwd`` up; None when there is no token file. TokenFileError when it is unusable."""
    folder = Path(state_dir) if state_dir else find_state_dir(cwd)
    if folder is None:
        return None
    path = folder / NAME
    if state_dir and not path.exists():
        return None
    return read(path), path
