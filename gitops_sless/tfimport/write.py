"""Writing a `Conversion`: folders with code and ``sless.yaml``, MIGRATING.md, secrets.

Secret values go only to ``--secrets-dir`` (``DIR/SECRET/KEY``, the layout
``serve --secrets-dir`` reads), never below the output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from .convert import Conversion, Folder, Secret

__all__ = ["SKIPPED", "copy_code", "write_manifest", "write_secrets"]

# what the provider's zip of source_dir leaves out, plus what must never reach git:
# Terraform's own files (tfvars and state hold secret values) and installed dependencies
# (the build installs them again from requirements.txt / package.json)
SKIPPED_DIRS = {".git", ".hg", ".svn", ".terraform", "node_modules", "__pycache__", ".sless-deps"}
SKIPPED_SUFFIXES = (
    ".tf",
    ".tfvars",
    ".tfstate",
    ".tfstate.backup",
    ".tfplan",
    ".terraform.lock.hcl",
)
SKIPPED = (*sorted(SKIPPED_DIRS), *(f"*{s}" for s in SKIPPED_SUFFIXES))
_ORDER = (
    "name",
    "runtime",
    "entrypoint",
    "memoryMB",
    "timeoutSec",
    "enabled",
    "env",
    "triggers",
    "jobs",
)


def copy_code(folder: Folder, out: Path) -> list[str]:
    """Copy the folder's code; returns what was left out (links leaving the folder)."""
    target = out / folder.path
    target.mkdir(parents=True, exist_ok=True)
    left_out: list[str] = []
    for here, dirs, files in os.walk(folder.source):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        rel = Path(here).relative_to(folder.source)
        for name in sorted(files):
            if name.endswith(SKIPPED_SUFFIXES) or name == "sless.yaml":
                continue
            source = Path(here) / name
            if source.is_symlink() and not _inside(source, folder.source):
                left_out.append((rel / name).as_posix())
                continue
            (target / rel).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target / rel / name)
    return left_out


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def write_manifest(folder: Folder, out: Path, header: str) -> Path:
    path = out / folder.path / "sless.yaml"
    functions = [{k: fn[k] for k in _ORDER if k in fn} for fn in folder.functions]
    text = yaml.safe_dump(
        {"functions": functions},
        sort_keys=False,
        default_flow_style=None,
        allow_unicode=True,
        width=100,
    )
    path.write_text(header + text, encoding="utf-8")
    return path


def write_secrets(secrets: list[Secret], directory: Path) -> list[Path]:
    """One file per key, readable by its owner only."""
    written = []
    for secret in secrets:
        folder = directory / secret.secret
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / secret.key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(secret.value)
        written.append(path)
    return written


def manifest_functions(conversion: Conversion) -> list[dict[str, Any]]:
    return [fn for folder in conversion.folders for fn in folder.functions]
