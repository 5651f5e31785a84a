"""Passwords of URLs in free text (``scheme://user:password@host``), masked in linear time.

The text is what others print (installers, git, a function's build), so it
may be megabytes on one line. The pattern is built so that Python's
backtracking engine never backtracks, which a plain
``[A-Za-z][A-Za-z0-9+.-]*://…`` does not give: that one, tried at every
position of a long run of letters, rescans the run each time (quadratic).
Here:

- a scheme is tried only where a run of scheme characters starts (the
  lookbehind fails at once inside a run), so each run is read once;
- every quantifier is possessive and stops at a character the next part
  needs (``:`` ends a scheme and a user, ``@`` a password), so giving back
  characters could never help: nothing is given back;
- a user and a password end at ``/`` or whitespace, and every next
  ``://`` holds a ``/``, so the parts read after two schemes never overlap.

What a match masks is exactly what the plain pattern masks (the tests
compare the two).
"""

from __future__ import annotations

import re

__all__ = ["url_passwords"]

_SCHEME_CHARS = "A-Za-z0-9+.-"
_URL_PASSWORD = re.compile(
    rf"(?<![{_SCHEME_CHARS}])"  # the start of a run of scheme characters
    r"(?P<lead>[0-9+.-]*+)"  # a scheme starts with a letter: what comes before stays
    rf"(?P<head>[A-Za-z][{_SCHEME_CHARS}]*+://[^/\s:@]*+)"
    r":[^/\s@]*+@"
)


def url_passwords(text: str, mask: str) -> str:
    """``text`` with every ``scheme://user:password@`` shown as ``scheme://user:<mask>@``."""
    if "://" not in text:  # most lines: one pass in C, no regex at all
        return text
    return _URL_PASSWORD.sub(lambda m: f"{m['lead']}{m['head']}:{mask}@", text)
