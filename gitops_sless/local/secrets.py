"""Secrets on the local backend: one file per key, ``<dir>/<secret>/<key>``, never from git.

This mirrors a Kubernetes Secret mounted as a volume, so the same
``{secret: notes-db, key: dsn}`` reference works on both backends.
"""

from __future__ import annotations

from pathlib import Path

from .. import logs
from ..backend import SecretUnavailable
from ..manifest import SecretRef

__all__ = ["SecretMissing", "SecretsDir"]


class SecretMissing(SecretUnavailable):
    """A referenced secret key has no file: the function waits (never an empty value)."""


class SecretsDir:
    def __init__(self, root: Path | None) -> None:
        self.root = root.resolve() if root else None

    def resolve(self, ref: SecretRef) -> str:
        if self.root is None:
            raise SecretMissing(
                f"secret {ref.secret!r} key {ref.key!r}: no secrets directory is configured "
                "(serve --secrets-dir DIR, one file per key: DIR/SECRET/KEY)"
            )
        # the schema allows no '/' and no '..' in either name, so this stays inside root
        path = self.root / ref.secret / ref.key
        try:
            value = path.read_text().removesuffix("\n")
        except FileNotFoundError:
            raise SecretMissing(f"secret {ref.secret!r} key {ref.key!r}: no file {path}") from None
        except OSError as exc:
            raise SecretMissing(f"secret {ref.secret!r} key {ref.key!r}: {exc.strerror}") from exc
        logs.register_secret(value)  # whatever prints it later, the log shows ***
        return value
