"""What an installer leaves behind, checked before the reconciler touches any of it.

An installer runs a function author's code (a ``preinstall`` script, a PEP 517
backend), so its output folder is hostile input to the reconciler, which reads
it outside any sandbox: it hard-links the files into artifacts, changes their
modes and copies them. A symlink there would make the reconciler act on a host
path of the author's choosing (``node_modules -> ../../../../secrets`` copied
production's secrets into a preview's artifact), and a FIFO would block the
copy forever. So every entry is ``lstat``-ed, never followed, and only these
are kept:

- real folders and regular files;
- symlinks whose target is relative and stays inside the function's folder
  (where the output is laid, beside the function's own files), once every
  link on the way is resolved (npm's ``node_modules/.bin/x -> ../x/bin/x``, a
  ``file:`` dependency's ``node_modules/dep -> ../vendored/dep``): inside an
  artifact they resolve to its own files only.

Anything else fails the build with the entry's name. The walk reads each entry
once (linear in the tree's size), and resolving a link reads link targets
only, never a file's content.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnsafeOutput", "check_output"]


class UnsafeOutput(Exception):
    """An installer left something the reconciler must not read: ``str()`` names it."""


def check_output(root: Path, within: Path) -> int:
    """Check everything below ``root`` (an installer's output, laid out in ``within``);
    how many entries it holds.

    UnsafeOutput for ``root`` itself not being a real folder, a special file, or a
    symlink that is absolute or leads out of ``within``.
    """
    mode = os.lstat(root).st_mode
    if stat.S_ISLNK(mode):
        raise UnsafeOutput(f"symlink {root.name} -> {os.readlink(root)}: not a folder of its own")
    if not stat.S_ISDIR(mode):
        raise UnsafeOutput(f"{root.name} is {_kind(mode)}, not a folder")
    inside = os.path.realpath(within)
    count = 0
    for parent, folders, files in os.walk(root):  # never descends into a link
        for name in [*folders, *files]:
            path = os.path.join(parent, name)
            shown = os.path.relpath(path, root.parent)
            mode = os.lstat(path).st_mode
            count += 1
            if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                continue
            if not stat.S_ISLNK(mode):
                raise UnsafeOutput(f"{shown} is {_kind(mode)}: only files and folders are kept")
            _check_link(path, shown, inside)
    return count


def _check_link(path: str, shown: str, inside: str) -> None:
    target = os.readlink(path)
    if os.path.isabs(target):
        raise UnsafeOutput(f"symlink {shown} -> {target} is absolute: it would leave the folder")
    # realpath resolves every link on the way (reading their targets, nothing else): a
    # chain of links each pointing inside can still end outside, and this sees where
    resolved = os.path.realpath(path)
    if resolved != inside and not resolved.startswith(inside + os.sep):
        raise UnsafeOutput(f"symlink {shown} -> {target} leads out of the folder")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"
