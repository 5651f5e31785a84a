"""gitops-sless: serverless functions on Kubernetes, deployed by git push."""

from .errors import ManifestError, PermanentError, SlessError, TransientError
from .manifests.load import load
from .manifests.model import DesiredState, Function
from .source.snapshot import open_snapshot

__all__ = [
    "DesiredState",
    "Function",
    "ManifestError",
    "PermanentError",
    "SlessError",
    "TransientError",
    "load",
    "open_snapshot",
]

__version__ = "0.1.0"
