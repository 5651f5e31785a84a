"""``gitops-sless serve``: one process that follows a repository and serves its functions.

It wires the pieces together: the mirror, the reconciler loop (polling and
webhooks, one pass at a time), the local backend, the status store, and one
HTTP server that carries the API and the /fn/ proxy; or two, with ``fn_listen``:
one for the dashboard and the API, one for /fn/ alone, so that a function's page
never shares the dashboard's origin.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import textwrap
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from apscheduler.schedulers.background import BackgroundScheduler

from .. import logs, telemetry
from .. import proxy as proxy_mod
from ..errors import SlessError
from ..invocations.worker import ProxyCaller
from ..local import gc
from ..local import sandbox as sandbox_mod
from ..local.backend import LocalBackend
from ..local.secrets import SecretsDir
from ..manifests import runtimes
from ..metrics import METRICS
from ..notify import notifications
from ..plan.backend import Backend
from ..previews.environments import PinnedSource, PreviewConfig, Previews
from ..previews.reporter import reporting
from ..proxy.history import InvocationBuffer
from ..reconciler import Reconciler
from ..scaling.scaler import Scaler
from ..source import mirror as mirror_mod
from ..source import seed, webhooks
from ..state.inflight import InFlight
from ..state.routes import RouteTable
from ..state.store import Store
from ..web import listeners
from ..web.api import create_api
from ..web.otlp import relay_local_spans
from . import queue
from .config import ServeConfig
from .restart import Restart, take_handoff

__all__ = ["Server", "local_sandbox", "resolve_repository", "share_sign_outs"]

log = logging.getLogger("gitops_sless")

FLUSH_SEC = 0.5
ANNOUNCE_WAIT_SEC = 60.0


def local_sandbox(mode: str) -> sandbox_mod.Sandbox:
    """The local backend's sandbox for ``mode``, checked against every runtime's interpreter
    (SandboxUnavailable when ``bubblewrap`` was asked for and cannot run)."""
    interpreters = tuple(sorted({r.interpreter for r in runtimes.available().values()}))
    return sandbox_mod.resolve(mode, interpreters)


def resolve_repository(repo: str, state_dir: Path) -> tuple[str, Path | None]:
    """The URL to follow; a plain directory becomes a seeded bare repository first."""
    path = Path(repo)
    if "://" in repo or not path.is_dir() or seed.is_repository(path):
        return repo, None
    bare = seed.seed_repository(path, state_dir / "repos" / f"{path.resolve().name}.git")
    return str(bare), bare


class Server:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        if config.otlp_endpoint:
            telemetry.configure(config.otlp_endpoint, config.service_name)
        self.url, self.seeded = resolve_repository(config.repo, config.state_dir)
        self.store = Store(config.state_dir / "status.db")
        self.routes = RouteTable()
        self.invocations = InvocationBuffer(self.store)
        self.restart = Restart()
        adopted = take_handoff()  # replicas that serve on across a restart in place
        self.backend = self._backend(adopted or ())
        self._handoff: object = None
        self.mirror = mirror_mod.Mirror(
            self.url,
            config.branch,
            config.state_dir / "mirror.git",
            credentials=mirror_mod.Credentials.from_env(),
            timeout_sec=config.fetch_timeout,
            preview_refs=config.previews,
            known_hosts=config.ssh_known_hosts,
        )
        # builds and jobs under way, shared by every environment: a tag is built once
        self.work = InFlight(32 if config.backend == "kubernetes" else 16)
        # the forge hears of previews and rollouts (statuses, PR comments), given a token
        self.forge, self.reporter = reporting(
            self.url,
            config.forge_token,
            config.forge_api,
            config.forge_kind,
            config.instance_name,
            required=config.previews,
        )
        self.notify = notifications(config, self.store, self.reporter, self.mirror, self.elector)
        self.reconciler = Reconciler(
            self.mirror,
            self.backend,
            self.store,
            env=config.env,
            public_url=config.fn_url,
            routes=self.routes,
            allow_empty=config.allow_empty,
            leading=self.elector.is_leader if self.elector else None,
            # builds run in the cluster there: the reconciler only waits for them
            workers=16 if config.backend == "kubernetes" else 4,
            after_pass=self._after_pass,
            work=self.work,
            keep_revisions=config.keep_revisions,
            on_verdict=self.notify.on_verdict,  # the forge's commit status, a rollback's event
        )
        if adopted:  # their routes before the first call: the restore adopts them
            self.reconciler.restore_serving()
        self.previews = self._previews() if config.previews else None
        # every environment runs on the one backend; only the leader writes decisions
        leading = self.elector.is_leader if self.elector else None
        self.scaler = Scaler(self.routes, lambda env: self.backend, config.scale_windows, leading)
        self.proxy = proxy_mod.ProxyApp(
            self.routes,
            record=self.invocations.record,
            max_body_bytes=config.max_body_bytes,
            trusted_proxies=config.trusted_proxies,
            # a function never gets the server's own credentials, whoever sends them
            withheld_tokens=(config.api_token, config.read_token),
            wake=self.scaler.wake,
        )
        # attempts go through the proxy, in this process: every rule of a call applies
        self.async_calls = queue.invocations(config, self.routes, ProxyCaller(self.proxy))
        self.notify.watch_dead_letters(self.async_calls.dead_letters)
        api = create_api(
            self.reconciler,
            self.store,
            branch=config.branch,
            repo=mirror_mod.redact(self.url),
            api_token=config.api_token,
            read_token=config.read_token,
            anonymous_read=config.anonymous_read,
            trusted_proxies=config.trusted_proxies,
            webhook_secret=config.webhook_secret,
            webhook_secrets=dict(config.webhook_secrets),
            on_shutdown=self._shutdown,
            poll_interval=config.poll_interval,
            readiness=self._readiness,
            previews=self.previews,
            sandbox=self.sandbox.kind if isinstance(self.backend, LocalBackend) else None,
            forge=config.forge_kind,
            forward_webhook=self._forward_webhook if self.elector else None,
            scaling=self.scaler.report,
            invocations=self.async_calls,
            routes=self.routes,
            fn_url=config.fn_url,
            notifications=self.notify.status,
            trace_url=config.trace_url_template,
        )
        relay_local_spans(api, self.backend, config.public_url)  # with --otlp-endpoint
        if self.elector is not None:
            share_sign_outs(api.state.access, self.elector.members)
        self.proxy.submissions = self.async_calls.submitter  # the fast path's
        if config.fn_listen:
            self.app = listeners.without_functions(api, config.fn_url)
            self.fn_app: listeners.ASGIApp | None = listeners.functions_only(
                self.proxy, self.async_calls.submitter
            )
        else:
            self.app = listeners.dispatch(api, self.proxy, self.async_calls.submitter)
            self.fn_app = None
        self._closed = threading.Event()
        self.scheduler = BackgroundScheduler()

    def _backend(self, adopted: Sequence[Mapping[str, Any]]) -> Backend:
        config = self.config
        self.elector: Any = None
        self.followers: Any = None  # kube.mirror.FunctionMirror: what a non-leader serves
        if config.backend == "kubernetes":
            # the kubernetes client loads only for this backend
            from ..kube.connect import connect
            from ..kube.leader import LeaderElector
            from ..kube.mirror import FunctionMirror

            backend = connect(config.kube, self.routes, on_cron=self.invocations.record_cron)
            backend.on_replica_event = self._replica_event  # Idle/Ready without a pass
            self.elector = LeaderElector(
                backend.client,
                config.kube.namespace,
                on_change=self._leadership,
                address=self._address(),
                # each replica's proxy enforces its share of every rateLimit
                on_members=lambda n: setattr(self.proxy.activator, "share", 1 / n),
            )
            # checked before every write batch: a replica that lost the lease writes nothing
            backend.client.may_write = self.elector.is_leader
            self.followers = FunctionMirror(
                backend.client, self.store, self.routes, backend.route_for, self.elector.is_leader
            )
            return backend
        self.sandbox = local_sandbox(config.sandbox)
        return LocalBackend(
            config.state_dir,
            self.routes,
            SecretsDir(config.secrets_dir),
            max_builds=config.max_builds,
            build_timeout_sec=config.build_timeout,
            on_cron=self.invocations.record_cron,
            # the reconciler is made below; replicas exist once it has run a pass (or adopted)
            on_replica_event=self._replica_event,
            preview_secrets=SecretsDir(config.preview_secrets_dir, previews=True),
            sandbox=self.sandbox,
            error_details=config.error_details,
            adopt=adopted,
        )

    def _previews(self) -> Previews:
        config = self.config
        settings = PreviewConfig(
            base=config.preview_base or config.branch,
            base_from_filter=config.preview_base is not None,
            trust=config.preview_trust,
            approve_label=config.preview_approve_label,
            label=config.preview_label,
            branch=config.preview_branch,
            max_previews=config.max_previews,
            ttl_sec=config.preview_ttl,
            public_url=config.fn_url,
        )

        def make_reconciler(env: str, source: PinnedSource) -> Reconciler:
            return Reconciler(
                source,
                self.backend if source.trusted else self.backend.for_untrusted(),
                self.store,
                env=env,
                public_url=config.fn_url,
                routes=self.routes,
                workers=2,
                leading=self.elector.is_leader if self.elector else None,
                patience_sec=1.0,  # previews take turns: none waits long for its builds
                follow_up=lambda: self.previews.request() if self.previews else None,
                work=self.work,
            )

        return Previews(
            self.mirror,
            self.backend,
            self.store,
            self.routes,
            settings,
            make_reconciler,
            forge=self.forge,
            reporter=self.reporter,
            forge_interval_sec=max(config.poll_interval, 15.0),
            leading=self.elector.is_leader if self.elector else None,
        )

    def _replica_event(self, env: str, name: str, kind: str, reason: str | None) -> None:
        if env == self.config.env:
            self.reconciler.replica_event(env, name, kind, reason)
        elif getattr(self, "previews", None) is not None:
            self.previews.request()  # its pass looks at the replicas again

    def _after_pass(self) -> None:
        self.notify.wake()
        previews = getattr(self, "previews", None)  # the first pass may end before it exists
        if previews is not None:
            previews.request()

    def _address(self) -> str | None:
        """Where the other replicas reach this one: SLESS_ADVERTISE_URL, else the pod's IP
        (POD_IP, from the downward API) or the address it listens on, with its port."""
        given = os.environ.get("SLESS_ADVERTISE_URL")
        if given:
            return given.rstrip("/")
        host = os.environ.get("POD_IP") or self.config.host
        if host in ("0.0.0.0", "::", ""):
            return None  # every address, so none in particular: webhooks are not handed on
        return f"http://{f'[{host}]' if ':' in host else host}:{self.config.port}"

    def _forward_webhook(
        self, forge: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        """A verified delivery handed to the leader as the forge sent it (it verifies the
        signature again); None, and this replica acts on it, when there is no leader to
        reach or it did not take the delivery."""
        url = None if self.elector.is_leader() else self.elector.leader_url()
        if not url:
            return None
        sent = {**webhooks.forwardable(headers), webhooks.FORWARDED_BY: self.elector.holder}
        try:
            answer = httpx.post(
                f"{url}/api/v1/webhooks/{forge}", content=body, headers=sent, timeout=10
            )
            if answer.status_code in (200, 202):
                logs.event(
                    log, "webhook.forwarded", f"{forge} webhook: handed to the leader at {url}"
                )
                return answer.status_code, answer.json()
            reason = f"HTTP {answer.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
        logs.event(
            log,
            "webhook.unforwarded",
            f"{forge} webhook: the leader at {url} did not take it ({reason}); acting on it here",
            level=logging.WARNING,
        )
        return None

    def _leadership(self, leading: bool) -> None:
        if leading:
            self.reconciler.request_sync("leader")

    def _readiness(self) -> tuple[bool, str]:
        if self.followers is None:
            ready = self.reconciler.passes > 0
            return ready, "a first pass ran" if ready else "waiting for the first pass"
        if self.elector.is_leader():
            ready = self.reconciler.passes > 0 or self.followers.synced.is_set()
            return ready, "leader" if ready else "leader, waiting for the first pass"
        if self.followers.synced.is_set():
            return True, "following the leader's Function resources"
        return False, "reading the Function resources"

    def start_background(self) -> None:
        if self.previews is not None:
            self.previews.start()
        if self.elector is not None:
            self.elector.start()
            self.followers.start()
        threading.Thread(target=self.reconciler.run_forever, name="sless-sync", daemon=True).start()
        self.scaler.start()
        self.scheduler.add_job(
            self.reconciler.request_sync,
            "interval",
            seconds=self.config.poll_interval,
            jitter=max(0.0, self.config.poll_interval * 0.1),
            args=("poll",),
            id="poll",
        )
        self.scheduler.add_job(self.invocations.flush, "interval", seconds=FLUSH_SEC, id="flush")
        collect = (
            self.collect_garbage
            if isinstance(self.backend, LocalBackend)
            else self.collect_cluster_garbage
        )
        self.scheduler.add_job(collect, "interval", seconds=self.config.gc_interval, id="gc")
        self.scheduler.start()
        self.reconciler.request_sync("startup")

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM, then stop every process this server started; on
        SIGUSR2, re-execute in place (``restart``) with the sockets and replicas."""
        self.start_background()
        try:
            self._serve()
        finally:
            self.close()
        if self.restart.requested.is_set():
            self.restart.exec(self._handoff)

    def _serve(self) -> None:
        # log_config=None: uvicorn's own lines go through logs.configure's handler (json too)
        if self.fn_app is None:
            config = proxy_mod.config(
                self.app, self.config.host, self.config.port, proxy=self.proxy, log_config=None
            )
            only = listeners.Listener(config)
            self._announce_when_listening(only)
            self.restart.on_signal(lambda: setattr(only, "should_exit", True))
            only.run(sockets=self.restart.sockets([config]))
            return
        fn_host, fn_port = self.config.fn_listen or ("", 0)
        # /fn/ never reaches the main listener's fast path: it has none
        main = listeners.Listener(
            proxy_mod.config(self.app, self.config.host, self.config.port, log_config=None)
        )
        beside = listeners.Beside(
            proxy_mod.config(self.fn_app, fn_host, fn_port, proxy=self.proxy, log_config=None)
        )
        self._announce_when_listening(main, beside)
        self.restart.on_signal(lambda: setattr(main, "should_exit", True))
        sockets = self.restart.sockets([main.config, beside.config])
        with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
            runner.run(_both(main, beside, sockets))

    async def _shutdown(self) -> None:
        await self.proxy.aclose()
        self.close()

    def collect_garbage(self) -> gc.Collected:
        """Delete artifacts and logs nothing uses (between passes, never during one)."""
        return self.reconciler.exclusively(self._collect_garbage)

    def _collect_garbage(self) -> gc.Collected:
        assert isinstance(self.backend, LocalBackend)
        records = [r for env in self.store.environments() for r in self.store.functions(env)]
        in_use = {r["build_tag"] for r in records if r["build_tag"]}
        in_use |= self.backend.tags_in_use() | self._kept_revision_tags()
        live = {(r["env"], r["name"]) for r in records}
        collected = gc.collect(
            self.backend.builder,
            self.config.state_dir / "logs",
            in_use,
            live,
            self.config.keep_builds,
        )
        self.store.delete_builds(collected.removed_tags)
        METRICS.gc_runs.inc()
        METRICS.gc_reclaimed.inc(collected.reclaimed_bytes)
        return collected

    def collect_cluster_garbage(self) -> Any:
        """Kubernetes: delete build records, contexts and images nothing uses (the leader
        only, between passes of the tracked branch; kube/gc.py says what is kept)."""
        if self.elector is None or not self.elector.is_leader():
            return None
        try:
            return self.reconciler.exclusively(self._collect_cluster_garbage)
        except SlessError as exc:  # S3, the registry or the API down: the next run retries
            log.warning("garbage collection in the cluster stopped: %s", exc)
            return None

    def _collect_cluster_garbage(self) -> Any:
        from ..kube.gc import ClusterGC  # the kubernetes client loads only for this backend

        collector = ClusterGC(
            self.backend.client,
            self.backend.builds.contexts,
            self.backend.config,
            keep=self.config.keep_builds,
            min_age_sec=self.config.gc_min_age,
        )
        collected = collector.collect(
            self._wanted_tags, self._tags_building, self.elector.is_leader
        )
        self.backend.builds.refresh()  # forget what went before a preview's pass asks
        return collected

    def _wanted_tags(self) -> set[str]:
        """Every tag an environment (previews too) wants or serves, from the store."""
        records = [r for env in self.store.environments() for r in self.store.functions(env)]
        wanted = {r[k] for r in records for k in ("build_tag", "wanted_tag") if r.get(k)}
        return wanted | self._kept_revision_tags()

    def _kept_revision_tags(self) -> set[str]:
        """The builds of every kept revision: a rollback switches to one without a build."""
        return {
            r["build_tag"] for env in self.store.environments() for r in self.store.revisions(env)
        }

    def _tags_building(self) -> set[str]:
        return {
            key[1]
            for key in self.work.under_way()
            if isinstance(key, tuple) and len(key) > 1 and key[0] == "build"
        }

    def close(self) -> None:
        """Stop the loop and every process this server started (safe to call twice); in a
        restart in place, the replicas serve on."""
        if self._closed.is_set():
            return
        self._closed.set()
        logs.event(log, "server.stopping", "stopping every process this server started")
        self.scaler.close()  # decides nothing more: the processes are about to stop
        self.reconciler.stop()
        self.work.shutdown()
        if self.previews is not None:
            self.previews.stop()
        if self.reporter is not None:
            self.reporter.close()
        self.notify.close()
        if self.elector is not None:
            self.followers.stop()
            self.elector.stop()  # hands the lease over at once
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.restart.requested.is_set():
            self._handoff = self.backend.hand_over()  # what the next image adopts
        else:
            self.backend.close()
        self.mirror.close()
        self.invocations.flush()
        self.store.close()
        telemetry.shutdown()  # what is batched goes out
        logs.event(log, "server.stopped", "stopped")

    def _announce_when_listening(self, *servers: uvicorn.Server) -> None:
        """The banner, once the first pass is done and every listener is up: a server that
        cannot listen exits 3 without saying where it would have served."""
        threading.Thread(
            target=self._announce, args=(servers,), name="sless-announce", daemon=True
        ).start()

    def _announce(self, servers: tuple[uvicorn.Server, ...]) -> None:
        if not self.reconciler.wait_for_pass(0, 600):
            return
        # the builds and jobs the first pass started: the listing says where each one ended,
        # unless one takes long (it then says Building)
        self.reconciler.wait_for_settled(0, ANNOUNCE_WAIT_SEC)
        while not all(server.started for server in servers):
            if self._closed.wait(0.05):
                return
        if self._closed.is_set():
            return
        base = self.config.public_url
        lines = [f"gitops-sless is serving {mirror_mod.redact(self.url)} ({self.config.branch})"]
        for fn in self.store.functions(self.config.env):
            target = f"curl {fn['url']}" if fn["url"] else f"{fn['name']} (no http trigger)"
            why = next(iter((fn["message"] or "").splitlines()), "")
            lines.append(f"  {fn['phase']:<9} {target}")
            if why and fn["phase"] != "Ready":
                lines += _wrapped(why, indent=12)
        lines += self._access_lines(base)
        if self.seeded:
            lines += [
                "to redeploy, push to the repository this server follows:",
                f"  git clone {self.seeded} my-functions && cd my-functions",
                "  # edit, then: git commit -am 'change' && git push",
                f"  (polled every {self.config.poll_interval:g}s)",
            ]
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _access_lines(self, base: str) -> list[str]:
        """How to read the API and sign in to the dashboard with this server's token."""
        config = self.config
        reader = "SLESS_READ_TOKEN" if config.read_token else "SLESS_API_TOKEN"
        if config.token_file is not None:
            reader = f"(cat {config.token_file})"
        tokens = config.api_token or config.read_token
        needs = tokens and not config.anonymous_read
        auth = f' -H "Authorization: Bearer ${reader}"' if needs else ""
        lines = [f"status:   curl{auth} {base}/api/v1/status", f"API docs: {base}/docs"]
        if config.token_file is not None and config.api_token:
            # in the fragment: a browser never sends it, so no access log holds it
            found = (
                "the CLI finds it from the folder that holds .sless-state"
                if config.token_file.parent.name == ".sless-state"
                else f"the CLI reads it with --state-dir {config.token_file.parent}"
            )
            lines += [
                f"sign in:  {base}/signin#token={config.api_token}",
                f"API token: {config.token_file} (generated; {found})",
            ]
        return lines


async def _both(main: uvicorn.Server, beside: uvicorn.Server, sockets: list[Any]) -> None:
    """Serve on both listeners until the main one stops (a signal), then stop the other."""
    task = asyncio.ensure_future(beside.serve(sockets=sockets[1:]))
    try:
        await main.serve(sockets=sockets[:1])
    finally:
        beside.should_exit = True
        await task


def _wrapped(text: str, indent: int, width: int = 100) -> list[str]:
    """``text`` whole, on lines of at most ``width`` broken between words: a reason cut
    short loses its end, and often a closing parenthesis with it."""
    pad = " " * indent
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=pad,
        subsequent_indent=pad,
        break_long_words=False,
        break_on_hyphens=False,
    )


SIGNED_OUT_ANNOTATION = "gitops-sless.dev/signed-out"


def share_sign_outs(access: Any, members: Any) -> None:
    """Every replica's member Lease carries the dashboard sessions signed out on it (or
    learnt from the others), and each round reads the others': a sign-out ends the
    session on every replica within a round, the signing-out one's at once."""
    members.annotations = lambda: {SIGNED_OUT_ANNOTATION: access.signed_out_text()}
    members.on_annotations = lambda told: access.learn_signed_out(
        told.get(SIGNED_OUT_ANNOTATION, "{}")
    )
    access.on_sign_out = members.nudge
