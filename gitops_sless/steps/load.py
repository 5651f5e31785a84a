"""Load: every manifest of a snapshot, as the desired state (cached by revision)."""

from __future__ import annotations

import logging

from .. import logs
from ..manifests import load as manifest
from ..manifests.model import DesiredState
from ..source.snapshot import Snapshot
from .context import Context, log, short

__all__ = ["Load"]


class Load:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._manifests = manifest.ManifestCache()
        self._logged_problems: frozenset[str] = frozenset()

    def run(self, snapshot: Snapshot) -> DesiredState:
        ctx = self.ctx
        cached = ctx.desired
        if cached is not None and cached.revision == snapshot.revision:
            return cached
        desired = manifest.load(snapshot, self._manifests)
        self._keep_last_good_names(desired)
        ctx.desired = desired
        return desired

    def log_problems(self, desired: DesiredState) -> None:
        """Each manifest problem once, when it appears (not on every poll)."""
        problems = frozenset(str(p) for p in desired.problems)
        for line in sorted(problems - self._logged_problems):
            logs.event(
                log,
                "manifest.invalid",
                line,
                level=logging.WARNING,
                env=self.ctx.env,
                revision=short(desired.revision),
            )
        self._logged_problems = problems

    def _keep_last_good_names(self, desired: DesiredState) -> None:
        """An invalid manifest keeps every function it last declared, however broken it is.

        A file that cannot be read at all (YAML syntax, encoding, size, a
        symlink) yields no names of its own, so the names come from what
        serves from that path, and from the records; only deleting the file
        removes them.
        """
        if not desired.invalid:
            return
        ctx = self.ctx
        declared = {row["name"]: row["manifest"] for row in ctx.records.all()}
        for row in ctx.store.serving(ctx.env):
            declared[row["name"]] = row["deployment"]["function"]["manifest"]
        for name, path in declared.items():
            if path in desired.invalid and name not in desired.functions:
                desired.invalid_names.setdefault(name, path)
