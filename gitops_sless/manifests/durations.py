"""Durations as sless.yaml writes them: ``90s``, ``5m``, ``1h30m``, ``2d``, or whole seconds.

A string holds one or more of the units d, h, m and s, each at most once and in that
order, each after a whole number; an integer is a number of seconds. The schema's
pattern (``$defs.duration``) refuses other strings; :func:`parse` says why in words.
"""

from __future__ import annotations

import re

__all__ = ["DurationError", "parse", "shown"]

_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_PATTERN = re.compile(r"(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")


class DurationError(ValueError):
    """A duration that does not parse."""


def parse(value: str | int | float) -> int:
    """Seconds of ``value``; raises DurationError for anything but the forms above."""
    if isinstance(value, bool):
        raise DurationError(f"{value} is not a duration")
    if isinstance(value, int | float):
        if value != int(value):
            raise DurationError(f"{value} is not a whole number of seconds")
        return int(value)
    match = _PATTERN.fullmatch(value)
    if not value or match is None:
        raise DurationError(
            f"{value!r} is not a duration: give a whole number of seconds or numbers with "
            "units d, h, m, s, each at most once and in that order (90s, 5m, 1h30m, 2d)"
        )
    counts = zip(match.groups(), _UNITS, strict=True)
    return sum(int(n) * size for n, (_, size) in counts if n is not None)


def shown(seconds: float) -> str:
    """``seconds`` as a manifest would write it: 300 -> ``5m``, 5400 -> ``1h30m``, 0 -> ``0s``."""
    left = round(seconds)
    parts = []
    for unit, size in _UNITS:
        count, left = divmod(left, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"
