"""Errors, split by what happens next.

    SlessError
    ├── PermanentError        retrying cannot help: wait for a new commit or new config
    │   ├── ManifestError     one line: ``path:LINE: field.path: reason``
    │   ├── SourceError       a ref or path that does not exist, not a repository
    │   ├── RuntimeNotFound   a runtime folder is missing or malformed
    │   ├── TemplateError     a template names a placeholder nobody supplies
    │   └── ForgeRefused      the forge's API said 401/404/4xx: fix the token or the URL
    └── TransientError        network, API 5xx, conflicts: retry with backoff
        └── ForgeUnavailable  the forge's API is down, rate limited or refusing for now

Third-party exceptions (pygit2, yaml, jsonschema) are translated into these once,
at the module that calls the library, chaining with ``raise ... from exc``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ForgeRefused",
    "ForgeUnavailable",
    "ManifestError",
    "PermanentError",
    "RuntimeNotFound",
    "SlessError",
    "SourceError",
    "TemplateError",
    "TransientError",
]


class SlessError(Exception):
    """Base of every error this package raises on purpose."""


class PermanentError(SlessError):
    """Retrying the same input gives the same failure."""


class TransientError(SlessError):
    """The same input may succeed later (network, timeouts, API 5xx, conflicts)."""


class SourceError(PermanentError):
    """A repository, ref or directory cannot be read as asked."""


class RuntimeNotFound(PermanentError):
    """A runtime named by a manifest or the CLI has no usable folder."""


class TemplateError(PermanentError):
    """A template is malformed or names a placeholder that was not supplied."""


class ForgeRefused(PermanentError):
    """The forge's API refused a request for good (401, 404, 422, ...): one line, no token."""


class ForgeUnavailable(TransientError):
    """The forge's API cannot answer now (403, 429, 5xx, network): one line, no token."""


@dataclass(frozen=True)
class ManifestProblem:
    """One thing wrong in one manifest, with where it is."""

    path: str
    line: int
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.reason}"


class ManifestError(PermanentError):
    """A manifest is invalid; carries every problem found in it."""

    def __init__(self, problems: list[ManifestProblem]) -> None:
        self.problems = sorted(problems, key=lambda p: (p.path, p.line, p.field))
        super().__init__("\n".join(str(p) for p in self.problems))
