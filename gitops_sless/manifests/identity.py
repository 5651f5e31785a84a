"""Content-derived build tags.

A function's source identity is the git tree id its folder would have without
the ``sless.yaml`` at its root: the code and every file next to it, but not the
settings (env, replicas, jobs' ``runId``...) that take effect without a build.
That id plus the runtime's version names the image. Same code and runtime:
same tag, in every environment and preview, so a revert is a cache hit, an
edit of ``sless.yaml`` alone builds nothing, and a tag is never reused for
different content (no ``latest``). Builders leave the root ``sless.yaml`` out
of what they build, so a tag always holds exactly the content it names.
"""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING

from ..source.snapshot import git_tree_id

if TYPE_CHECKING:
    from ..source.snapshot import Snapshot
    from .runtimes import Runtime

__all__ = ["MANIFEST_NAME", "build_tag", "is_manifest", "source_id"]

MANIFEST_NAME = "sless.yaml"
TAG_HASH_CHARS = 24
# tree id -> source id is a pure function of content, so one table serves every
# snapshot; bounded so a long-running server with many previews stays small
_CACHE_LIMIT = 1 << 16

_source_ids: dict[str, str] = {}
_lock = threading.Lock()


def build_tag(source_id: str, runtime: Runtime) -> str:
    """``<runtime>-<hash>``: a valid image tag, unique to this source and runtime version."""
    digest = hashlib.sha256(f"{source_id}\0{runtime.name}\0{runtime.version}".encode()).hexdigest()
    return f"{runtime.name}-{digest[:TAG_HASH_CHARS]}"


def is_manifest(folder: str, path: str) -> bool:
    """Whether ``path`` is the manifest at the root of function folder ``folder``.

    Only that one file is left out of a build: a nested folder's ``sless.yaml``
    is an ordinary file of the outer folder.
    """
    return path == (f"{folder}/{MANIFEST_NAME}" if folder else MANIFEST_NAME)


def source_id(snapshot: Snapshot, folder: str) -> str:
    """The git tree id of ``folder`` without its root ``sless.yaml``.

    Computed from the object ids of the folder's own entries (no file is read);
    remembered per tree id, so a pass over an unchanged repository looks up a
    table instead of hashing every folder again.
    """
    tree = snapshot.tree_id(folder)
    found = _source_ids.get(tree)
    if found is not None:
        return found
    entries = [e for e in snapshot.entries(folder) if e.name != MANIFEST_NAME]
    found = git_tree_id(entries)
    with _lock:
        if len(_source_ids) >= _CACHE_LIMIT:
            _source_ids.clear()
        _source_ids[tree] = found
    return found
