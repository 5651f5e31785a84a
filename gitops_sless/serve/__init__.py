"""``gitops-sless serve``: one process that follows a repository and serves its functions.

``config`` holds what the command was asked (:class:`ServeConfig`), ``server`` wires
the layers into one process (:class:`Server`), ``queue`` chooses and opens the
asynchronous invocations' engine.

May import: every layer below it (only ``cli`` and ``__main__`` are above).
"""

from .config import ServeConfig
from .server import Server, local_sandbox, resolve_repository

__all__ = ["ServeConfig", "Server", "local_sandbox", "resolve_repository"]
