"""Deciding: the desired state against what is built, run and deployed.

Owns the boundary every backend implements (``backend``: what is deployed, what
can be built and applied), the list of work a pass does (``planner``) and what a
sync would change in an environment (``diff``).

May import: ``manifests``, ``source`` and the shared top-level modules. It never
does the work: backends do.
"""
