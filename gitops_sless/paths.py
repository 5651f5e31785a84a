"""Where the project's data folders are: schemas/, templates/ and runtimes/.

They live beside the package (DESIGN §9). ``SLESS_HOME`` points elsewhere, for
an installation that keeps them in another place.

``stays_inside`` is the rule every builder applies to a symlink of a function folder.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

__all__ = ["home", "runtimes_dir", "schema_path", "stays_inside", "templates_dir"]


_BESIDE_PACKAGE = Path(__file__).resolve().parent.parent


def home() -> Path:
    """The folder holding schemas/, templates/ and runtimes/."""
    configured = os.environ.get("SLESS_HOME")
    return Path(configured) if configured else _BESIDE_PACKAGE


def schema_path() -> Path:
    return home() / "schemas" / "sless.schema.json"


def templates_dir() -> Path:
    return home() / "templates"


def runtimes_dir() -> Path:
    return home() / "runtimes"


def stays_inside(rel: str, link_target: str) -> bool:
    """Whether a symlink at ``rel`` (relative to a folder) pointing to ``link_target`` stays in it.

    The link's own text only: a chain through other links is the caller's to check.
    """
    if link_target.startswith("/"):
        return False
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), link_target))
    return resolved != ".." and not resolved.startswith("../")
