"""A preview's states, and the name of its environment."""

from __future__ import annotations

__all__ = ["CLOSED", "PREVIEW_STATES", "REF_DELETED", "REOPEN_ON_NEW_HEAD", "env_name"]

PREVIEW_STATES = ("Building", "Ready", "Failed", "Waiting", "TearingDown")
CLOSED = "Closed"  # kept as a row, so a surviving ref does not bring the preview back
# closed for these reasons, a preview comes back with a new head commit; closed by the
# forge or merged, only when the forge says it is open again
REOPEN_ON_NEW_HEAD = ("expired", "deleted")
REF_DELETED = "ref deleted"  # closed because its ref left the remote: the ref brings it back


def env_name(number: int) -> str:
    return f"pr-{number}"
