"""gitops-sless Python runtime: serves one handler function over HTTP/1.1 (README.md).

The script that is started. The server is the module ``_sless_server`` beside it:
Python compiles a script at every start (4 ms for that one), a module it loads
from its cached bytecode (``__pycache__/``, written ahead by scripts/setup and
the image's Dockerfile, as the runtime folder is read-only where it runs). A
missing or stale cache only costs that compile.
"""

import time

_STARTED = time.monotonic()  # first of all: when the start began (the ready line's "start")

import os  # noqa: E402
import sys  # noqa: E402

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    if sys.path[:1] != [_here]:  # it is sys.path[0] already, unless -P or PYTHONSAFEPATH
        sys.path.insert(0, _here)
    from _sless_server import main  # the handler does not see this folder on sys.path

    sys.exit(main(_STARTED))
