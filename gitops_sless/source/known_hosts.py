"""Which SSH host keys a remote may present: a ``known_hosts`` file, read as OpenSSH reads it.

``check()`` takes the key the server presented (the SSH wire blob, as libgit2 hands
it over) and accepts it only when the file holds it for that host; anything else
raises ``HostKeyRefused`` with a message that names the host, the key's type and
its fingerprint (``SHA256:...``, as ``ssh-keygen -l`` prints it) and the flag that
fixes it. The file is read at every check, so an edit takes effect at the next fetch.

Lines follow sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT": comma-separated host patterns
(``*`` and ``?`` wildcards, ``!`` negation), ``[host]:port`` for a port other than
22, or one hashed name ``|1|salt|hmac`` (``ssh-keyscan -H``); then the key type,
the base64 key and a comment. ``@revoked`` refuses its key; ``@cert-authority``
lines are skipped (libgit2's SSH transport does not take host certificates).

Standard library only: the fetch process (``fetcher.py``) loads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FLAG", "HostKey", "HostKeyRefused", "check", "host_name"]

FLAG = "--ssh-known-hosts"
_VARIABLE = "SLESS_SSH_KNOWN_HOSTS"
_HASHED = "|1|"


class HostKeyRefused(Exception):
    """The server's host key is not one the known-hosts file holds for it."""


@dataclass(frozen=True)
class HostKey:
    """A public key as SSH sends it: ``blob`` is the wire encoding, base64 in known_hosts."""

    blob: bytes

    @property
    def key_type(self) -> str:
        # the blob opens with its type: a 4-byte big-endian length, then the name
        size = int.from_bytes(self.blob[:4], "big")
        return self.blob[4 : 4 + size].decode("ascii", "replace") if size < 64 else "unknown"

    @property
    def fingerprint(self) -> str:
        digest = base64.b64encode(hashlib.sha256(self.blob).digest()).decode()
        return "SHA256:" + digest.rstrip("=")

    def __str__(self) -> str:
        return f"{self.key_type} {self.fingerprint}"


@dataclass(frozen=True)
class _Entry:
    line: int
    marker: str  # "", "@revoked" or "@cert-authority"
    hosts: str
    key_type: str
    key: HostKey | None  # None: the base64 does not decode


def host_name(host: str, port: int) -> str:
    """The name known_hosts holds a host under: ``host``, or ``[host]:port`` off port 22."""
    return host.lower() if port == 22 else f"[{host.lower()}]:{port}"


def _pattern(pattern: str) -> re.Pattern[str]:
    parts = ("." if c == "?" else ".*" if c == "*" else re.escape(c) for c in pattern.lower())
    return re.compile("".join(parts), re.DOTALL)


def _hashed_match(field: str, name: str) -> bool:
    salt, _, digest = field[len(_HASHED) :].partition("|")
    try:
        salt_bytes, digest_bytes = base64.b64decode(salt), base64.b64decode(digest)
    except (binascii.Error, ValueError):
        return False
    mac = hmac.new(salt_bytes, name.encode(), hashlib.sha1).digest()
    return hmac.compare_digest(mac, digest_bytes)


def _matches(hosts: str, name: str) -> bool:
    """OpenSSH's rule: some pattern matches the name and no negated one does."""
    if hosts.startswith(_HASHED):
        return _hashed_match(hosts, name)
    matched = False
    for pattern in hosts.split(","):
        negated = pattern.startswith("!")
        if _pattern(pattern.removeprefix("!")).fullmatch(name):
            if negated:
                return False
            matched = True
    return matched


def _decode(text: str) -> HostKey | None:
    try:
        return HostKey(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return None


def _entries(text: str) -> list[_Entry]:
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else ""
        if len(fields) >= 3:
            entries.append(_Entry(number, marker, fields[0], fields[1], _decode(fields[2])))
    return entries


def _fix(presented: HostKey, host: str, port: int, path: Path | None) -> str:
    keyscan = f"ssh-keyscan -p {port} {host}" if port != 22 else f"ssh-keyscan {host}"
    where = str(path) if path else "KNOWN_HOSTS"
    return (
        f"if {presented.fingerprint} is the server's key (compare it with one its "
        f"administrator gives you), add it: {keyscan} >> {where}; the file is "
        f"{FLAG} PATH (${_VARIABLE}), default ~/.ssh/known_hosts"
    )


def _read(path: Path | None, presented: HostKey, name: str) -> str:
    if path is None:
        raise HostKeyRefused(
            f"ssh host key of {name} ({presented}) cannot be checked: no known-hosts file "
            f"(~/.ssh/known_hosts did not exist at start); pass {FLAG} PATH (${_VARIABLE})"
        )
    try:
        return path.read_text(errors="replace")
    except OSError as exc:
        raise HostKeyRefused(
            f"ssh host key of {name} ({presented}) cannot be checked: {FLAG} {path}: "
            f"{exc.strerror or exc}"
        ) from None


def check(path: Path | None, host: str, port: int, presented: HostKey) -> None:
    """Accept ``presented`` for ``host``:``port`` if the file holds it; else ``HostKeyRefused``."""
    name = host_name(host, port)
    ours = [e for e in _entries(_read(path, presented, name)) if _matches(e.hosts, name)]
    if any(e.marker == "@revoked" and e.key == presented for e in ours):
        raise HostKeyRefused(
            f"ssh host key of {name} ({presented}) is marked @revoked in {path} ({FLAG}): "
            "never accepted"
        )
    if any(e.marker == "" and e.key == presented for e in ours):
        return
    fix = _fix(presented, host, port, path)
    held = [e for e in ours if e.marker == "" and e.key is not None]
    same_type = [e for e in held if e.key_type == presented.key_type]
    if same_type:
        lines = ", ".join(f"{e.key.fingerprint} (line {e.line})" for e in same_type if e.key)
        raise HostKeyRefused(
            f"ssh host key of {name} has changed: it presents {presented}, {path} holds "
            f"{lines}; someone may be intercepting the connection; {fix}"
        )
    others = f" (it holds only {', '.join(sorted({e.key_type for e in held}))})" if held else ""
    raise HostKeyRefused(
        f"ssh host key of {name} is unknown: {presented} is not in {path}{others}; {fix}"
    )
