"""W3C Trace Context (https://www.w3.org/TR/trace-context/): what a valid ``traceparent``
is, and a span of ours under one, or a new trace.

The proxy carries a caller's trace on (``proxy.http``), an asynchronous submission is a
span of the caller's trace and each of its attempts a child of it (``invocations``), and
a job run is traced under its job span (a trace of its own when none is exported), a
cron run starts a trace of its own (the runners read ``SLESS_TRACEPARENT``).
"""

from __future__ import annotations

import random
import re

__all__ = ["TRACEPARENT", "child_traceparent", "is_valid"]

# version 00 exactly; a later version (not ff) by its first four fields, with whatever it
# adds after them. All-zero trace and parent ids are invalid.
TRACEPARENT = re.compile(
    rb"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
    rb"|(?!00|ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(?:-[ -~]*)?"
)
_getrandbits = random.Random().getrandbits  # its own: the global one stays the caller's


def is_valid(traceparent: str | None) -> bool:
    """Whether ``traceparent`` is one to carry on."""
    if not traceparent:
        return False
    try:
        raw = traceparent.encode("ascii")
    except UnicodeEncodeError:
        return False
    return TRACEPARENT.fullmatch(raw) is not None


def child_traceparent(traceparent: str | None) -> str:
    """A traceparent for a span of ours under ``traceparent`` (the same trace and flags, a
    new parent id); a new sampled trace when ``traceparent`` is not a valid one."""
    span = _getrandbits(64) | 1
    if traceparent is not None and is_valid(traceparent):
        return f"00-{traceparent[3:35]}-{span:016x}-{traceparent[53:55]}"
    return f"00-{_getrandbits(128) | 1:032x}-{span:016x}-01"
