"""Content-derived build tags.

A function folder's git tree id plus its runtime's version names the image.
Same tree and runtime: same tag, in every environment and preview, so a revert
is a cache hit and a tag is never reused for different content (no ``latest``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runtimes import Runtime

__all__ = ["build_tag"]

TAG_HASH_CHARS = 24


def build_tag(source_id: str, runtime: Runtime) -> str:
    """``<runtime>-<hash>``: a valid image tag, unique to this source and runtime version."""
    digest = hashlib.sha256(f"{source_id}\0{runtime.name}\0{runtime.version}".encode()).hexdigest()
    return f"{runtime.name}-{digest[:TAG_HASH_CHARS]}"
