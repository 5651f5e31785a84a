"""Secrets on the local backend: one file per key, ``<dir>/<secret>/<key>``, never from git.

This mirrors a Kubernetes Secret mounted as a volume, so the same
``{secret: notes-db, key: dsn}`` reference works on both backends.

There are two scopes: production's folder (``--secrets-dir``) and the previews'
(``--preview-secrets-dir``), as each Kubernetes environment has its own
namespace. A preview runs code from a pull request, whose manifest may name any
secret, so a preview resolves only from its own scope and never falls back to
production's.
"""

from __future__ import annotations

from pathlib import Path

from .. import logs
from ..manifests.model import SecretRef
from ..plan.backend import SecretUnavailable

__all__ = ["SecretMissing", "SecretsDir"]


class SecretMissing(SecretUnavailable):
    """A referenced secret key has no file: the function waits (never an empty value)."""


class SecretsDir:
    """One scope of secrets; ``previews`` marks the previews' scope (its messages say so)."""

    def __init__(self, root: Path | None, *, previews: bool = False) -> None:
        self.root = root.resolve() if root else None
        self.previews = previews

    def resolve(self, ref: SecretRef) -> str:
        if self.root is None:
            raise SecretMissing(self._missing(ref, "no secrets directory is configured"))
        # the schema allows no '/' and no '..' in either name, so this stays inside root
        path = self.root / ref.secret / ref.key
        try:
            value = path.read_text().removesuffix("\n")
        except FileNotFoundError:
            raise SecretMissing(self._missing(ref, f"no file {path}")) from None
        except OSError as exc:
            raise SecretMissing(self._missing(ref, exc.strerror or str(exc))) from exc
        logs.register_secret(value)  # whatever prints it later, the log shows ***
        return value

    def _missing(self, ref: SecretRef, why: str) -> str:
        if not self.previews:
            hint = " (serve --secrets-dir DIR, one file per key: DIR/SECRET/KEY)"
            return f"secret {ref.secret!r} key {ref.key!r}: {why}" + (
                hint if self.root is None else ""
            )
        # production's secrets are never looked at for a preview, whatever its manifest says
        where = (
            "no --preview-secrets-dir is configured"
            if self.root is None
            else f"no file {ref.secret}/{ref.key} in --preview-secrets-dir"
        )
        return f'secret "{ref.secret}" is not available to previews ({where})'
