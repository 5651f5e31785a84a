"""Where a caller reads a handler's exception in a 500 (``serve --error-details``).

The runtimes decide by ``SLESS_ERROR_DETAIL`` (1 or 0), and without it show the detail in
preview environments (``pr-*``) only: the exception's text can hold what the caller sent
or what the function knows, and elsewhere the caller gets the request id that finds it in
the function's log. A backend sets the variable only where this setting differs from that
default, so the default leaves every replica's specification as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifests.model import ENV_NAME, is_preview

__all__ = ["DEFAULT", "ErrorDetails"]

_ALL = "all"
_NONE = "none"
_PREVIEWS = "previews"


@dataclass(frozen=True)
class ErrorDetails:
    """The environments whose callers read a handler's exception."""

    environments: frozenset[str] = frozenset()
    previews: bool = True
    everywhere: bool = False

    @classmethod
    def parse(cls, text: str) -> ErrorDetails:
        """``previews`` (the default), ``all``, ``none``, or a comma-separated list of
        environment names, ``previews`` among them or not; ValueError when malformed."""
        items = [item.strip() for item in text.split(",")]
        if items in ([_ALL], [_NONE]):
            return cls(previews=items == [_ALL], everywhere=items == [_ALL])
        names = [item for item in items if item != _PREVIEWS]
        for name in names:
            if not ENV_NAME.fullmatch(name) or name in (_ALL, _NONE):
                raise ValueError(
                    f"{name!r} is not an environment name; give 'previews', 'all', 'none' "
                    "or environment names, comma-separated"
                )
        return cls(frozenset(names), previews=_PREVIEWS in items)

    def shows(self, environment: str) -> bool:
        if self.everywhere or environment in self.environments:
            return True
        return self.previews and is_preview(environment)

    def runtime_env(self, environment: str) -> dict[str, str]:
        """What a replica in ``environment`` is started with: nothing where the runtime's
        own default (details in previews only) is what is asked."""
        shows = self.shows(environment)
        if shows == is_preview(environment):
            return {}
        return {"SLESS_ERROR_DETAIL": "1" if shows else "0"}

    def __str__(self) -> str:
        if self.everywhere:
            return _ALL
        items = sorted(self.environments) + ([_PREVIEWS] if self.previews else [])
        return ",".join(items) or _NONE


DEFAULT = ErrorDetails()
