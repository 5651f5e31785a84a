"""The steps of a reconcile pass, one object each, as Flux's controllers compose
sub-reconcilers: ``restore`` (at start-up, what served), ``load`` (the manifests),
``decide`` (observe and plan), ``build`` and ``jobs`` (long work, in the background),
``apply``, ``prune`` and ``report`` (phases, the pass's result, the proxy's table);
``revisions`` records each deploy as a revision, keeps the newest runnable and
switches to one by hand (a rollback, which pins the function); ``rollouts`` brings a
change of a function with a ``rollout`` block to its callers step by step.

They share one :class:`~.context.Context`: what the reconciler of one environment
knows between passes. The coordinator (``reconciler``) calls them in order; each can
be built and run alone in a test.

May import: ``state``, ``plan``, ``manifests``, ``source`` and the shared top-level
modules. Backends are reached through ``plan.backend``'s boundary only.
"""

from .apply import Apply
from .build import Build
from .context import Context, PassState
from .decide import Decide
from .jobs import Jobs
from .load import Load
from .prune import Prune
from .report import Report
from .restore import Restore
from .revisions import NoSuchRevision, Revisions, RollbackRefused
from .rollouts import Rollouts, Verdict

__all__ = [
    "Apply",
    "Build",
    "Context",
    "Decide",
    "Jobs",
    "Load",
    "NoSuchRevision",
    "PassState",
    "Prune",
    "Report",
    "Restore",
    "Revisions",
    "RollbackRefused",
    "Rollouts",
    "Verdict",
]
