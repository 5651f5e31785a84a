"""Pull-request previews: one environment ``pr-<number>`` per open pull request.

Each preview is a full environment with its own :class:`Reconciler`, pinned to
the PR's head commit, sharing the backend (so builds are shared by tag: a PR
that changes one function builds one), the status store and the routes.
Previews run in their own thread after each pass of the tracked branch, so
``prod`` is converged first and never waits for a preview.

What is open comes from three places: webhook events, the forge's API (when a
token is configured) and the ``refs/pull/*/head`` / ``refs/merge-requests/*/head``
refs of the mirror. Closing wins over a ref: GitHub keeps the refs of closed
PRs, so a ref never brings back a preview the forge reported closed. A preview
is torn down when the forge says closed, when its head is merged into the
tracked branch (seen in git alone), when its head has not changed for the TTL,
or by hand. A PR known from its ref alone (no forge token, no webhook about it)
has nothing but the ref to say it is open: when the ref leaves the remote, it
is closed, and it opens again if the ref comes back. Teardown is recorded before
it starts (``TearingDown``), so a reconciler killed in the middle finishes it
when it starts again.

Which PRs run, and at which commit, is :mod:`gitops_sless.previews.trust`'s to decide
(``--preview-trust``, approvals, the label filter): a PR it holds back is listed
``Waiting`` with the reason and runs nothing; one that ran before is taken down
(its environment removed, the row kept). Approval is a label added by a user with
write access: the event says who added it at which head; the forge says, in this
thread, whether that user may write. What the forge hears of a preview is
:class:`~gitops_sless.previews.reporter.PreviewReport`'s: states, names and links only.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import logs
from ..errors import SlessError
from ..plan.backend import Backend
from ..reconciler import Reconciler
from ..source.snapshot import Snapshot
from ..state.routes import RouteTable
from ..state.store import Store
from .approvals import Approvals
from .pulls import PullRequest
from .reporter import PreviewReport
from .states import CLOSED, REF_DELETED, REOPEN_ON_NEW_HEAD, env_name
from .trust import Decision, decide

__all__ = ["PinnedSource", "PreviewConfig", "Previews"]

log = logging.getLogger(__name__)


class Mirror(Protocol):
    def head(self) -> str | None: ...

    def snapshot(self, commit: str | None = None) -> Snapshot: ...

    def preview_heads(self) -> dict[int, str]: ...

    def is_ancestor(self, commit: str, of: str) -> bool: ...


class Forge(Protocol):
    def open_pulls(self) -> list[PullRequest]: ...

    def pull(self, number: int) -> PullRequest | None: ...

    def can_write(self, user: str, user_id: int | None = None) -> bool: ...


class Reporting(Protocol):
    def report_preview(self, number: int, preview: PreviewReport) -> None: ...


@dataclass(frozen=True)
class PreviewConfig:
    base: str = "main"  # only PRs into this branch (the tracked branch by default)
    base_from_filter: bool = False  # base named by --preview-filter: an unknown base fails
    label: str | None = None  # only commits this label was added at
    branch: str | None = None  # only PRs whose head branch matches this pattern
    max_previews: int = 10
    ttl_sec: float = 7 * 86400
    public_url: str = "http://127.0.0.1:8080"
    trust: str = "same-repo"  # trust.TRUST_LEVELS
    approve_label: str = "preview"


class PinnedSource:
    """A preview's source: the mirror the tracked branch already fetched, at one commit."""

    def __init__(self, mirror: Mirror, commit: str, trusted: bool = True) -> None:
        """``trusted``: the PR's code may be built with the reconciler's own credentials
        (a same-repo PR); False builds it apart (:meth:`Backend.for_untrusted`)."""
        self.mirror = mirror
        self.commit = commit
        self.trusted = trusted

    def fetch(self) -> None:
        return None

    def snapshot(self, commit: str | None = None) -> Snapshot:
        return self.mirror.snapshot(commit or self.commit)


class Previews:
    def __init__(
        self,
        mirror: Mirror,
        backend: Backend,
        store: Store,
        routes: RouteTable,
        config: PreviewConfig,
        make_reconciler: Callable[[str, PinnedSource], Reconciler],
        forge: Forge | None = None,
        reporter: Reporting | None = None,
        forge_interval_sec: float = 60.0,
        leading: Callable[[], bool] | None = None,
    ) -> None:
        """``leading()``: whether this replica may act (it holds the lease)."""
        self.mirror = mirror
        self.backend = backend
        self.store = store
        self.routes = routes
        self.config = config
        self.make_reconciler = make_reconciler
        self.forge = forge
        self.reporter = reporter
        self.forge_interval_sec = forge_interval_sec
        self.leading = leading or (lambda: True)
        self._reconcilers: dict[int, Reconciler] = {}
        self._reported_heads: dict[int, str] = {}
        # what webhooks said, newer than the forge's list may be: number -> (time, head)
        self._hooked: dict[int, tuple[float, str | None]] = {}
        self._forge_read_at = 0.0  # when the last open list was asked for
        self._forge_open: dict[int, PullRequest] | None = None  # the API's last answer
        self.approvals = Approvals(store, forge, config)
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._pass_lock = threading.Lock()
        self.passes = 0
        self._idle = threading.Condition()

    # --- the loop ------------------------------------------------------------------------

    def start(self) -> None:
        if self.config.trust == "approved" and self.forge is None:
            logs.event(
                log,
                "preview.trust",
                "--preview-trust approved without SLESS_FORGE_TOKEN: who adds a label cannot "
                "be checked, so no fork is approved (forks wait as with same-repo)",
                level=logging.WARNING,
            )
        threading.Thread(target=self._loop, name="sless-previews", daemon=True).start()
        if self.forge is not None:
            threading.Thread(target=self._poll_forge, name="sless-forge", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wanted.set()
        for reconciler in list(self._reconcilers.values()):
            reconciler.stop()

    def request(self) -> None:
        self._wanted.set()

    def wait_for_pass(self, after: int, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self.passes > after, timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._wanted.wait(1.0):
                continue
            self._wanted.clear()
            if self._stop.is_set():
                return
            try:
                self.run_pass()
            except Exception:  # a bug here must not stop previews for good
                log.exception("previews pass crashed")

    def _poll_forge(self) -> None:
        while not self._stop.is_set():
            try:
                assert self.forge is not None
                asked = time.time()
                self._forge_open = {pr.number: pr for pr in self.forge.open_pulls()}
                self._forge_read_at = asked
                self.request()
            except SlessError as exc:  # the forge's trouble never stops reconciling
                logs.event(log, "forge.unavailable", str(exc), level=logging.WARNING)
            self._stop.wait(self.forge_interval_sec)

    # --- events --------------------------------------------------------------------------

    def on_event(self, pr: PullRequest) -> None:
        """A pull-request webhook: remember what it says; the next pass acts on it."""
        row = self.store.preview(pr.number)
        self._hooked[pr.number] = (time.time(), pr.head_sha if pr.state == "open" else None)
        fields: dict[str, Any] = {
            "forge_open": 1 if pr.state == "open" else 0,
            "title": pr.title,
            "author": pr.author,
            "base": pr.base,
            "head_branch": pr.head_branch,
            "labels": pr.labels,
            "same_repo": _flag(pr.same_repo),
        }
        if pr.state == "open" and row is not None and row["state"] == CLOSED:
            fields["state"] = "Waiting"  # reopened
        if pr.state == "open" and pr.head_sha:
            fields["head"] = pr.head_sha
        if pr.state == "open" and self.approvals.approves(row, pr):
            request = {"user": pr.sender, "id": pr.sender_id, "sha": pr.head_sha}
            fields["approval_request"] = json.dumps(request)
        fields = {k: v for k, v in fields.items() if v is not None}
        fields.update(self.approvals.labelled(row, pr.labels, pr.labels_added, pr.head_sha))
        self.store.set_preview(pr.number, **fields)
        if pr.state != "open":
            self.begin_teardown(pr.number, "merged" if pr.merged else "closed")
        self.request()

    def unconfirmed(self, pr: PullRequest) -> str | None:
        """Why a webhook that would open or reopen ``pr``'s preview is to be ignored, or None
        (see :meth:`Approvals.unconfirmed`)."""
        return self.approvals.unconfirmed(pr)

    def delete(self, number: int) -> bool:
        """``DELETE /api/v1/environments/pr-N``: False when there is no such preview."""
        row = self.store.preview(number)
        if row is None or row["state"] == CLOSED:
            return False
        self.begin_teardown(number, "deleted")
        self.request()
        return True

    # --- one pass ------------------------------------------------------------------------

    def run_pass(self) -> None:
        with self._pass_lock:
            try:
                self._run_pass()
            finally:
                with self._idle:
                    self.passes += 1
                    self._idle.notify_all()

    def _run_pass(self) -> None:
        if not self.leading():  # another replica runs the previews
            return
        self._finish_teardowns()
        self.approvals.check_all()
        tracked = self.mirror.head()
        refs = self.mirror.preview_heads()
        forge_open = self._forge_open
        numbers = set(refs) | {r["number"] for r in self.store.previews()}
        if forge_open is not None:
            numbers |= set(forge_open)
        candidates: list[tuple[int, str, Decision]] = []
        for number in sorted(numbers):
            head = self._observe(number, refs.get(number), forge_open)
            if head is None:
                continue
            row = self.store.preview(number) or {}
            if tracked and self.mirror.is_ancestor(head, tracked):
                self.begin_teardown(number, "merged")
            elif time.time() - (row.get("head_since") or time.time()) > self.config.ttl_sec:
                self.begin_teardown(number, "expired")
            elif (unwanted := self._unwanted(row)) is not None:
                self._hold(number, head, unwanted)
            elif (decision := decide(row, head, self.approvals.gate)).commit is None:
                self._hold(number, head, self.approvals.why(number, head, decision))
            else:
                candidates.append((number, head, decision))
        self._finish_teardowns()
        running = set(self._reconcilers)
        candidates.sort(key=lambda c: (c[0] not in running, c[0]))
        for index, (number, head, decision) in enumerate(candidates):
            if index >= self.config.max_previews:
                reason = (
                    f"over --max-previews {self.config.max_previews}: waits for another "
                    "preview to close"
                )
                self._set_state(number, "Waiting", reason)
                continue
            self._converge(number, head, decision)

    def _observe(
        self, number: int, ref_head: str | None, forge_open: dict[int, PullRequest] | None
    ) -> str | None:
        """Record what is known of ``number``; its head, or None when it is no preview now."""
        row = self.store.preview(number)
        pr = forge_open.get(number) if forge_open is not None else None
        if pr is not None and self._hooked.get(number, (0.0, None))[0] >= self._forge_read_at:
            pr = None  # read before the last webhook about it: older news (a close stays closed)
        if row is None and ref_head is None and pr is None:
            return None
        fields: dict[str, Any] = {}
        if pr is not None:
            fields.update(
                forge_open=1,
                title=pr.title,
                author=pr.author,
                base=pr.base,
                head_branch=pr.head_branch,
                same_repo=_flag(pr.same_repo),
                labels=pr.labels,
            )
            # a list says which labels are on, not which were added: compared with the row
            fields.update(self.approvals.labelled(row, pr.labels, None, pr.head_sha))
        elif (
            forge_open is not None
            and row is not None
            and row["forge_open"] == 1
            # absent from the open list: closed, unless a webhook said open after it was read
            and self._hooked.get(number, (0.0, None))[0] < self._forge_read_at
        ):
            fields["forge_open"] = 0
        # what git holds first (the ref), then a webhook's news, then the API's list
        hooked = self._hooked.get(number, (0.0, None))[1]
        api_head = pr.head_sha if pr else None
        head = ref_head or hooked or api_head or (row or {}).get("head")
        if head and head != (row or {}).get("head"):
            fields.update(head=head, head_since=time.time())
        if row is None:
            fields.update(state="Waiting", head_since=time.time())
        elif self._ref_deleted(number, row, ref_head):
            self._update(number, row, fields)
            logs.event(
                log,
                "preview.ref_deleted",
                f"{env_name(number)}: the PR's ref left the remote, and no forge or webhook "
                "says it is open: taken as closed",
                env=env_name(number),
            )
            self.begin_teardown(number, REF_DELETED)
            return None
        elif row["state"] == CLOSED:
            reopened = pr is not None and row["forge_open"] == 0
            new_head = row["reason"] in REOPEN_ON_NEW_HEAD and "head" in fields
            ref_back = row["reason"] == REF_DELETED and ref_head is not None
            if not (reopened or new_head or ref_back):
                self._update(number, row, fields)
                return None
            fields["state"] = "Waiting"
            if ref_back:
                fields.setdefault("head_since", time.time())  # its TTL starts again
        elif fields.get("forge_open", row["forge_open"]) == 0:
            self._update(number, row, fields)
            self.begin_teardown(number, "closed")
            return None
        self._update(number, row, fields)
        return head

    def _ref_deleted(self, number: int, row: dict[str, Any], ref_head: str | None) -> bool:
        """A PR found from its ref alone whose ref is gone: nothing else can tell it closed.

        ``forge_open`` stays unset until a webhook or the forge speaks of the PR, so a row
        without it was found from a ref. A mirror that never fetched holds no ref at all.
        """
        return (
            ref_head is None
            and self.forge is None
            and row["forge_open"] is None
            and number not in self._hooked
            and row["state"] not in (CLOSED, "TearingDown")
            and self.mirror.head() is not None
        )

    def _update(self, number: int, row: dict[str, Any] | None, fields: dict[str, Any]) -> None:
        changed = {
            k: v
            for k, v in fields.items()
            if (v is not None or k == "label_sha")
            and (row is None or row.get(k) != (list(v) if k == "labels" else v))
        }
        if changed or row is None:
            self.store.set_preview(number, **changed)

    def _unwanted(self, row: dict[str, Any]) -> str | None:
        """Why the filter's base or head-branch pattern leaves the PR out. What the sources
        cannot tell fails, except a base left to its default (the tracked branch)."""
        base, branch, config = row.get("base"), row.get("head_branch"), self.config
        if (base is None and config.base_from_filter) or (base not in (None, config.base)):
            return f"--preview-filter base={config.base}: the base is {base or 'unknown'}"
        if config.branch and (branch is None or not fnmatch.fnmatch(branch, config.branch)):
            return (
                f"--preview-filter branch={config.branch}: the head branch is {branch or 'unknown'}"
            )
        return None

    # --- trust -----------------------------------------------------------------------------

    def _hold(self, number: int, head: str, reason: str) -> None:
        """``number`` may run nothing now: it waits, and what it ran before goes."""
        self._withdraw(number)
        self._set_state(number, "Waiting", reason)
        if self.approvals.awaits(number):
            self._report(number, head, "Waiting", reason)

    def _withdraw(self, number: int) -> None:
        """Take down what ``number`` ran (a stricter setting, a base that changed)."""
        env = env_name(number)
        if number not in self._reconcilers and not self.store.functions(env):
            return
        self._remove_environment(number)
        logs.event(log, "preview.withdrawn", "no longer allowed to run: taken down", env=env)

    # --- converging ------------------------------------------------------------------------

    def _converge(self, number: int, head: str, decision: Decision) -> None:
        """Bring ``pr-<number>`` to the commit ``decision`` allows (the head, or an older
        approved one while the head waits)."""
        env, commit = env_name(number), decision.commit or head
        reconciler = self._reconcilers.get(number)
        if reconciler is None:
            source = PinnedSource(self.mirror, commit, self.approvals.trusted(number))
            reconciler = self.make_reconciler(env, source)
            self._reconcilers[number] = reconciler
        source = reconciler.source
        assert isinstance(source, PinnedSource)
        try:
            self.mirror.snapshot(commit)
        except SlessError:  # a webhook named a commit the next fetch brings
            self._set_state(number, "Waiting", f"waiting for commit {commit[:12]} to be fetched")
            return
        if self._reported_heads.get(number) != commit:
            self._report(number, commit, "Building", None)  # pending first, for a new head
        source.commit = commit
        self.routes.reopen(env)
        result = reconciler.sync("preview")
        if (self.store.preview(number) or {}).get("state") in ("TearingDown", CLOSED):
            return  # closed or deleted while the pass ran: the teardown wins
        failed = result.result in ("Failed", "Degraded", "Invalid")
        state, failures = self._state_of(env, failed, reconciler.busy())
        notes = [self.approvals.why(number, head, decision)] if decision.reason else []
        self._set_state(number, state, "; ".join(notes + failures) or None)
        if decision.pinned:  # the head hears that it waits; the approved commit said its part
            self._report(number, head, "Waiting", decision.reason)
        else:
            self._report(number, commit, state, None)

    def _state_of(self, env: str, failed: bool, busy: bool) -> tuple[str, list[str]]:
        """The preview's state, and what failed or waits by name (never a message: see
        _report). Functions that are Pending while no build or job of the preview is under
        way wait for something outside it (a secret): the preview waits too, it is not
        building."""
        failures = self._failures(env)
        if failures or failed:
            return "Failed", failures or ["sync failed"]
        records = self.store.functions(env)
        pending = [r["name"] for r in records if r["phase"] == "Pending"]
        if any(r["phase"] == "Building" for r in records) or (pending and busy):
            return "Building", []
        if pending:
            return "Waiting", [f"{name} is Pending" for name in pending]
        return "Ready", []

    def _failures(self, env: str) -> list[str]:
        """What failed in ``env``, by name: ``greet: build failed``, ``job x failed``."""
        found = []
        for record in self.store.functions(env):
            name, phase = record["name"], record["phase"]
            if phase == "Invalid":
                found.append(f"{name}: invalid manifest")
            elif phase == "Failed":
                build = self.store.build_of(record)
                built = build is None or build["phase"] != "Failed"
                found.append(f"{name} failed" if built else f"{name}: build failed")
        jobs = self.store.jobs(env)
        return found + [f"job {job['name']} failed" for job in jobs if job["phase"] == "Failed"]

    def _set_state(self, number: int, state: str, reason: str | None) -> None:
        row = self.store.preview(number)
        if row is None or (row["state"], row["reason"]) != (state, reason):
            self.store.set_preview(number, state=state, reason=reason)

    # --- reporting back ------------------------------------------------------------------

    def _report(self, number: int, sha: str, state: str, note: str | None) -> None:
        """Tell the forge: states, names and links only. A public PR's statuses and comments
        are read by anyone, so no message, log line or result goes there."""
        if self.reporter is None:
            return
        env = env_name(number)
        preview = PreviewReport(
            env=env,
            sha=sha,
            state=state,
            url=f"{self.config.public_url}/fn/{env}/",
            functions=tuple((r["name"], r["phase"], r["url"]) for r in self.store.functions(env)),
            failures=tuple(self._failures(env)) if state == "Failed" else (),
            note=note,
        )
        said = f"{sha}|{preview.forge_state}|{preview.description}|{preview.comment}"
        digest = hashlib.sha256(said.encode()).hexdigest()
        row = self.store.preview(number) or {}
        if row.get("reported") == digest:
            return  # said already: the forge hears each change once
        self.reporter.report_preview(number, preview)
        self.store.set_preview(number, reported=digest)
        self._reported_heads[number] = sha

    # --- teardown ------------------------------------------------------------------------

    def begin_teardown(self, number: int, reason: str) -> None:
        """404 at once: the routes go first, then (in the next pass) processes and rows."""
        row = self.store.preview(number)
        if row is not None and row["state"] == CLOSED:
            return
        self.store.set_preview(number, state="TearingDown", reason=reason)
        env = env_name(number)
        self.routes.close(env)  # 404 now, whatever a pass still running for it says
        logs.event(log, "preview.teardown", f"{env}: {reason}", env=env)

    def _finish_teardowns(self) -> None:
        for row in self.store.previews():
            if row["state"] == "TearingDown":
                self._teardown(row["number"], row["reason"] or "closed")

    def _teardown(self, number: int, reason: str) -> None:
        env = env_name(number)
        self._remove_environment(number)
        self.store.set_preview(number, state=CLOSED, reason=reason)
        logs.event(log, "preview.removed", f"{env} removed ({reason})", env=env)

    def _remove_environment(self, number: int) -> None:
        """Routes, processes or namespace, and status rows of ``pr-<number>``."""
        env = env_name(number)
        reconciler = self._reconcilers.pop(number, None)
        if reconciler is not None:
            reconciler.stop()
        self._reported_heads.pop(number, None)
        self.routes.close(env)
        for record in self.store.functions(env):
            self.backend.remove(env, record["name"])
        self.backend.remove_environment(env)
        self.store.delete_environment(env)

    # --- status --------------------------------------------------------------------------

    def listing(self) -> Iterable[dict[str, Any]]:
        """Previews that exist or wait, for ``GET /api/v1/environments``."""
        return [row for row in self.store.previews() if row["state"] != CLOSED]


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)
