"""Build contexts for kaniko: one function's files and its runtime, as a gzip tarball.

The tarball holds ``Dockerfile`` (the runtime's), ``runtime/`` (the runtime
folder, read from disk), ``function/`` (the function folder without its
``sless.yaml``, read from git objects, never a checkout) and ``deps/``: what
installing its dependencies reads (``requirements.txt``; ``package.json`` and
its lock file; the whole folder when those name its files, see
``gitops_sless.manifests.dependencies``) plus ``.sless-deps-key``, the key of that
install. The Dockerfile copies ``deps/`` and installs before it copies
``function/``, so kaniko's layer cache (``--cache=true``) reuses the install
for every build whose ``deps/`` is the same: a code change installs nothing,
and ``deps/`` is never empty. The same function gives the same bytes on any
machine: entries sorted by name, folders listed, times, owners and modes fixed,
and a gzip header without a time or a file name. A context is stored under its
build tag, so its content must be exactly what the tag names.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
import tarfile
from dataclasses import dataclass

from ..errors import TransientError
from ..manifests.dependencies import Dependencies, dependencies
from ..manifests.identity import is_manifest, source_id
from ..manifests.load import _resolve_in_folder
from ..manifests.model import Function
from ..manifests.runtimes import get as get_runtime
from ..paths import stays_inside
from ..plan.backend import BuildFailed
from ..source.snapshot import DirectorySnapshot, Snapshot

__all__ = ["DEPS_KEY_FILE", "SourceChanged", "build_context"]

DEPS_KEY_FILE = ".sless-deps-key"

_DIR_MODE = 0o755
_EXEC_MODE = 0o755
_FILE_MODE = 0o644
_LINK_MODE = 0o777  # what ``ln -s`` gives; a link's own mode is never used
_GZIP_LEVEL = 9


class SourceChanged(TransientError):
    """A file changed while it was read (a directory being edited): build again later."""


@dataclass(frozen=True)
class _Member:
    name: str
    kind: str  # "dir", "file" or "link"
    mode: int = _FILE_MODE
    data: bytes = b""
    target: str = ""


def build_context(fn: Function, snapshot: Snapshot) -> bytes:
    """The build context of ``fn`` read from ``snapshot``, the one it was loaded from.

    Raises ``ValueError`` for another snapshot, ``BuildFailed`` for a folder that
    cannot be built (a link leaving it, a submodule), ``SourceChanged`` when a file
    changed while it was read.
    """
    tag = fn.build_tag
    found = source_id(snapshot, fn.folder)
    if found != fn.source_id:
        raise ValueError(
            f"{fn.name}: folder {fn.folder or '.'} of {snapshot.revision[:12]} has source "
            f"{found}, the function was loaded with {fn.source_id}"
        )
    runtime = get_runtime(fn.runtime)
    on_disk = DirectorySnapshot(runtime.folder)
    if on_disk.tree_id("") != runtime.version:
        # the tag names the runtime as this process read it; another one needs another tag
        raise BuildFailed(tag, f"runtime folder {runtime.folder} changed since it was read")
    dockerfile = {e.name: e for e in on_disk.entries("")}.get("Dockerfile")
    if dockerfile is None or dockerfile.kind != "blob":
        raise BuildFailed(tag, f"runtime folder {runtime.folder} has no Dockerfile")
    members = [
        _Member("Dockerfile", "file", data=_verified(on_disk, "Dockerfile", dockerfile.oid)),
        *_members(tag, on_disk, "", "runtime", manifest=False),
        *_members(tag, snapshot, fn.folder, "function", manifest=True),
        *_dependency_members(tag, snapshot, fn.folder, dependencies(fn, snapshot)),
    ]
    return _tarball(sorted(members, key=lambda m: m.name.encode("utf-8", "surrogateescape")))


def _members(
    tag: str, snapshot: Snapshot, folder: str, prefix: str, *, manifest: bool
) -> list[_Member]:
    """The entries of ``folder`` as tar members below ``prefix``, links checked.

    ``manifest``: ``folder`` is a function folder, whose root ``sless.yaml`` is left out.
    """
    members = [_Member(prefix, "dir", _DIR_MODE)]
    links: dict[str, str] = {}
    for path, entry in snapshot.walk(folder):
        if manifest and is_manifest(folder, path):
            continue  # not part of the build: see identity
        rel = posixpath.relpath(path, folder) if folder else path
        name = f"{prefix}/{rel}"
        if entry.kind == "tree":
            members.append(_Member(name, "dir", _DIR_MODE))
        elif entry.kind == "blob":
            mode = _EXEC_MODE if entry.mode & 0o111 else _FILE_MODE
            members.append(_Member(name, "file", mode, _verified(snapshot, path, entry.oid)))
        elif entry.kind == "link":
            target = _verified(snapshot, path, entry.oid).decode("utf-8", "surrogateescape")
            if not stays_inside(rel, target):
                raise BuildFailed(tag, f"symlink {rel} -> {target} leaves the folder")
            links[rel] = target
            members.append(_Member(name, "link", _LINK_MODE, target=target))
        else:
            raise BuildFailed(tag, f"{rel} is a {entry.kind}; it cannot be built")
    # each link stays inside by itself; a chain through other links may not
    for rel in links:
        if _resolve_in_folder(rel, links) is None:
            raise BuildFailed(tag, f"symlink {rel} resolves outside the folder")
    return members


def _dependency_members(
    tag: str, snapshot: Snapshot, folder: str, deps: Dependencies | None
) -> list[_Member]:
    """``deps/``: what the install reads, and the file naming its key."""
    key = _Member(
        f"deps/{DEPS_KEY_FILE}", "file", data=f"{deps.key if deps else 'none'}\n".encode()
    )
    if deps is None:
        return [_Member("deps", "dir", _DIR_MODE), key]
    if deps.whole_folder:
        whole = _members(tag, snapshot, folder, "deps", manifest=True)
        return [*(m for m in whole if m.name != key.name), key]
    entries = {e.name: e for e in snapshot.entries(folder)}
    files = [
        _Member(
            f"deps/{name}",
            "file",
            _EXEC_MODE if entries[name].mode & 0o111 else _FILE_MODE,
            _verified(snapshot, posixpath.join(folder, name), entries[name].oid),
        )
        for name in deps.files
    ]
    return [_Member("deps", "dir", _DIR_MODE), *files, key]


def _verified(snapshot: Snapshot, path: str, oid: str) -> bytes:
    # a directory snapshot reads files when asked: one edited since the scan
    # would be stored under a tag that names other content
    data = snapshot.read(path)
    if hashlib.sha1(b"blob %d\0%s" % (len(data), data)).hexdigest() != oid:
        raise SourceChanged(f"{path} changed while it was read")
    return data


def _tarball(members: list[_Member]) -> bytes:
    out = io.BytesIO()
    # no file name and time 0 in the gzip header: the bytes depend on the content only
    gz = gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=_GZIP_LEVEL, mtime=0)
    with gz, tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            info = tarfile.TarInfo(member.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = member.mode
            if member.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif member.kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, member.target
                tar.addfile(info)
            else:
                info.size = len(member.data)
                tar.addfile(info, io.BytesIO(member.data))
    return out.getvalue()
