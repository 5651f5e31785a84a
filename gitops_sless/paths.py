"""Where the project's data folders are: schemas/, templates/ and runtimes/.

They live beside the package (DESIGN §9). ``SLESS_HOME`` points elsewhere, for
an installation that keeps them in another place.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["home", "runtimes_dir", "schema_path", "templates_dir"]


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
