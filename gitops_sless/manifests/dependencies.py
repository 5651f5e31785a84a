"""What installing a function's dependencies reads, and the key its result is cached under.

An install reads the dependency file (``requirements.txt``; ``package.json``
with ``package-lock.json`` / ``npm-shrinkwrap.json`` and a project ``.npmrc``)
and nothing else of the folder, unless the file points into the folder: a
requirement ``./vendored/x.whl`` or ``-r base.txt``, an npm ``file:``
dependency, an install script of the package itself. Then the install may read
any file of the folder, and its key is the whole folder's source identity.

The key (``<runtime>-<hash>``) covers the runtime's name and version and the
git object ids of what the install reads, so two builds with the same key
install the same thing: the local builder installs once per key and links the
result into every artifact, and kaniko's layer cache does the same for images
built from the same ``deps/`` folder of the build context.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..source.snapshot import Entry, Snapshot
from .identity import TAG_HASH_CHARS, is_manifest, source_id
from .model import Function
from .runtimes import get as get_runtime

__all__ = ["Dependencies", "dependencies", "input_paths"]

NODE_FILES = ("package.json", "package-lock.json", "npm-shrinkwrap.json", ".npmrc")
# npm runs these of the package being installed: they may read any file of it
NODE_INSTALL_SCRIPTS = frozenset(
    {"preinstall", "install", "postinstall", "preprepare", "prepare", "postprepare", "prepublish"}
)
NODE_SPEC_SECTIONS = (
    "dependencies",
    "devDependencies",
    "optionalDependencies",
    "peerDependencies",
    "overrides",
)
_NODE_PATH_PROTOCOLS = ("file:", "link:")
# what separates paths from the rest of a requirement line: version specifiers,
# markers, extras, ``name @ url``, ``--option=value``
_REQUIREMENT_SPLIT = re.compile(r"[\s=,;@\[\]'\"<>!~]+")


@dataclass(frozen=True)
class Dependencies:
    """The install of one function folder: what it reads and its cache key."""

    key: str
    dependency_file: str
    # files of the folder the install reads (relative); empty when it reads all of it
    files: tuple[str, ...]
    # why the install may read any file of the folder; None when only ``files``
    whole_folder: str | None

    def describe(self) -> str:
        if self.whole_folder:
            return f"the whole folder ({self.whole_folder})"
        return ", ".join(self.files)


def dependencies(fn: Function, snapshot: Snapshot) -> Dependencies | None:
    """The install ``fn`` needs, or None when its folder has no dependency file."""
    runtime = get_runtime(fn.runtime)
    top = {e.name: e for e in snapshot.entries(fn.folder)}
    main = top.get(runtime.dependency_file)
    if main is None:
        return None
    names = NODE_FILES if runtime.dependency_file == "package.json" else (main.name,)
    files = {name: top[name] for name in names if name in top}
    reason = _whole_folder_reason(fn, snapshot, runtime.dependency_file, files)
    digest = hashlib.sha256(f"{runtime.name}\0{runtime.version}\0".encode())
    if reason:
        digest.update(f"folder\0{source_id(snapshot, fn.folder)}".encode())
    else:
        for name, entry in sorted(files.items()):
            digest.update(f"{name}\0{entry.mode:o}\0{entry.oid}\0".encode())
    key = f"{runtime.name}-{digest.hexdigest()[:TAG_HASH_CHARS]}"
    return Dependencies(key, main.name, () if reason else tuple(sorted(files)), reason)


def input_paths(deps: Dependencies, snapshot: Snapshot, folder: str) -> Iterable[str]:
    """Paths (relative to the snapshot) of what the install reads, depth first, in git's order.

    The folder's root ``sless.yaml`` is never one of them: it is not part of
    the build (see identity).
    """
    if not deps.whole_folder:
        yield from (posixpath.join(folder, name) for name in deps.files)
        return
    for path, _ in snapshot.walk(folder):
        if not is_manifest(folder, path):
            yield path


def _whole_folder_reason(
    fn: Function, snapshot: Snapshot, dependency_file: str, files: Mapping[str, Entry]
) -> str | None:
    for name, entry in files.items():
        if entry.kind != "blob":
            return f"{name} is a {entry.kind}"
    text = snapshot.read(posixpath.join(fn.folder, dependency_file))
    if dependency_file == "package.json":
        return _node_reason(text, {e.name for e in snapshot.entries(fn.folder)})
    return _requirements_reason(text, _folder_paths(snapshot, fn.folder))


def _folder_paths(snapshot: Snapshot, folder: str) -> set[str]:
    start = len(folder) + 1 if folder else 0
    return {path[start:] for path, _ in snapshot.walk(folder)}


def _requirements_reason(text: bytes, paths: set[str]) -> str | None:
    """Why ``requirements.txt`` may read other files of the folder, or None.

    Generous on purpose: any word of a line that names a file or folder of the
    function folder counts (a package named like a folder included). A false
    alarm costs a cache miss; a missed reference would reuse an install made
    from other files.
    """
    for number, raw in enumerate(text.decode("utf-8", "replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        for word in _REQUIREMENT_SPLIT.split(line):
            path = word.removeprefix("file://").removeprefix("file:")
            if path in (".", "..") or path.startswith(("./", "../")):
                return f"requirements.txt:{number} names the path {path}"
            if path and posixpath.normpath(path) in paths:
                return f"requirements.txt:{number} names {path}, a file of the folder"
    return None


def _node_reason(text: bytes, top_names: set[str]) -> str | None:
    """Why ``npm install`` may read other files of the folder, or None."""
    try:
        package = json.loads(text)
    except ValueError:
        return "package.json is not valid JSON"
    if not isinstance(package, dict):
        return "package.json is not a JSON object"
    scripts = package.get("scripts")
    found = sorted(NODE_INSTALL_SCRIPTS & set(scripts)) if isinstance(scripts, dict) else []
    if found:
        return f"package.json has a {found[0]} script"
    if "workspaces" in package:
        return "package.json declares workspaces"
    if "binding.gyp" in top_names:  # npm runs node-gyp on it
        return "the folder has a binding.gyp"
    for section in NODE_SPEC_SECTIONS:
        for name, spec in _specs(package.get(section)):
            if _node_relative_path(spec):
                return f"package.json {section}.{name} is the path {spec}"
    return None


def _node_relative_path(spec: str) -> bool:
    """Whether an npm spec is a path relative to the package (so maybe inside the folder).

    An absolute path (``file:/srv/pkgs/x.tgz``, ``~/x``) names something outside
    the folder, as a registry or URL spec does: not part of the folder's content.
    """
    path = spec
    for protocol in _NODE_PATH_PROTOCOLS:
        if spec.startswith(protocol):
            path = spec[len(protocol) :]
            break
    else:
        if not spec.startswith("."):
            return False  # a version range, a tag, a URL, a git or GitHub spec
    return not path.startswith(("/", "~"))


def _specs(value: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    """(name, spec) of a dependency section; ``overrides`` nests mappings."""
    if not isinstance(value, dict):
        return
    for name, spec in value.items():
        if isinstance(spec, str):
            yield prefix + str(name), spec
        else:
            yield from _specs(spec, f"{prefix}{name}.")
