"""The status API, webhooks and health endpoints (FastAPI). The /fn/ proxy is not here.

Reads come from the status store; the only writes are "sync now" and
"delete a preview", which need the API token, and webhooks, which need a valid
signature. With no token or secret configured those calls are refused, never
open. Reads need the read or the API token (or a dashboard session) when one is
configured: :mod:`access` decides, before any route runs.
Every answer is a model from :mod:`.models` (camelCase keys, RFC 3339
times) and every error is ``{"error": "..."}``. ``/docs`` serves Swagger UI
from assets installed with the package, so it works without the internet.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response, Security
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials
from fastapi_offline import FastAPIOffline
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import logs
from ..errors import SlessError
from ..invocations.service import Invocations
from ..manifests import load as manifest
from ..manifests import model
from ..metrics import METRICS
from ..plan import diff as diff_mod
from ..previews import pulls
from ..previews.prlinks import pull_request_link
from ..reconciler import Reconciler
from ..source import webhooks
from ..state.routes import RouteTable
from ..state.store import MAX_SYNCS, Store
from . import diffs, replies
from .access import Access, ReadGate
from .dashboard import router as dashboard_router
from .dashboard import signin_page
from .diffs import DiffReply
from .invocations import router as invocations_router
from .logs import logs_router
from .models import (
    Environment,
    ErrorReply,
    Function,
    FunctionDetail,
    Health,
    JobRun,
    Readiness,
    Scaling,
    Status,
    Sync,
    SyncAccepted,
    WebhookReply,
)
from .notifications import router as notifications_router
from .revisions import router as revisions_router

__all__ = ["DOCS_ASSETS", "MAX_WEBHOOK_BYTES", "create_api"]

log = logging.getLogger(__name__)

MAX_WEBHOOK_BYTES = 1 << 20
MAX_DIFF_BYTES = 1 << 20
KEPT_REVISIONS = 8  # desired states of deployed revisions kept for diffs
MAX_WAIT_SEC = 600
DOCS_ASSETS = "/docs/assets"  # Swagger UI's JavaScript and CSS, from the fastapi-offline package
CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer


def _ignored(push: webhooks.Push) -> str:
    if push.event != "push":
        return f"{push.event} event"
    return f"push to {push.branch}" if push.branch else "push to a ref that is not a branch"


_WEBHOOK_BODY = {
    "requestBody": {
        "required": True,
        "description": "The forge's push or pull-request event, signed with the forge's "
        "webhook secret (else the shared one): "
        "X-Hub-Signature-256 (GitHub), X-Gitea-Signature (Gitea), X-Gitlab-Token (GitLab).",
        "content": {"application/json": {"schema": webhooks.PushPayload.model_json_schema()}},
    }
}

_DIFF_BODY = {
    "requestBody": {
        "required": True,
        "description": "A desired state as `gitops-sless diff` loads it from a folder or commit: "
        f"valid functions and invalid manifests (at most {MAX_DIFF_BYTES} bytes).",
        "content": {"application/json": {"schema": diffs.request_schema()}},
    }
}

_bearer = replies.bearer
_READ = replies.READ  # documents the token reads need; access.ReadGate checks it


def create_api(
    reconciler: Reconciler,
    store: Store,
    branch: str,
    repo: str,
    api_token: str | None,
    webhook_secret: str | None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    poll_interval: float | None = None,
    readiness: Callable[[], tuple[bool, str]] | None = None,
    previews: Any = None,
    read_token: str | None = None,
    anonymous_read: bool = False,
    trusted_proxies: Sequence[str] = (),
    webhook_secrets: Mapping[str, str | None] | None = None,
    sandbox: str | None = None,
    forge: str | None = None,
    forward_webhook: Callable[[str, Mapping[str, str], bytes], tuple[int, dict[str, Any]] | None]
    | None = None,
    scaling: Callable[[str, str], dict[str, Any] | None] | None = None,
    invocations: Invocations | None = None,
    routes: RouteTable | None = None,
    fn_url: str = "",
    notifications: Callable[[], list[dict[str, Any]]] | None = None,
    trace_url: str = "",
) -> FastAPI:
    """``readiness() -> (ready, reason)`` answers /readyz (default: a first pass ran).

    ``api_token`` reads and writes, ``read_token`` reads; with neither, or with
    ``anonymous_read``, reads are open. ``trusted_proxies`` say whose X-Forwarded-Proto
    is believed (a session cookie is ``Secure`` behind https). ``sandbox``: how the local
    backend confines function processes (``bubblewrap`` | ``off``), for the status.
    ``forge`` (github | gitea | gitlab, else guessed from ``repo``) links previews to their PRs.
    ``forward_webhook(forge, headers, body)``: hands a verified delivery to the replica that
    leads, whose (status, reply) it returns; None when this replica must act on it itself.
    ``scaling(env, name)``: an autoscaled function's replicas and cold starts (Scaling).
    ``invocations``: asynchronous invocations, started and stopped with the app (its
    workers run on the loop that serves it). ``routes``: the proxy's table (how warm each
    kept revision is); ``fn_url``: where functions are called (revisions' own URLs).
    ``notifications()``: each notification provider's last delivery (none: no providers).
    ``trace_url``: a trace viewer's URL with ``{trace_id}``, linked from the dashboard.
    """

    def scaled(env: str, row: dict[str, Any]) -> dict[str, Any]:
        """What the proxy and the autoscaler know of a function now."""
        report = scaling(env, row["name"]) if scaling is not None else None
        live: dict[str, Any] = {"scaling": Scaling(**report)} if report else {}
        route = routes.get(env, row["name"]) if routes is not None else None
        if route is not None:
            live.update(open_streams=route.load.streams, open_sockets=route.load.sockets)
        return live

    access = Access(
        api_token, read_token, anonymous_read=anonymous_read, trusted_proxies=trusted_proxies
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if invocations is not None:
            await invocations.start()
        yield
        if invocations is not None:
            await invocations.stop()
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so code after
        # server.run() may never run: the lifespan's end is the place to clean up
        if on_shutdown:
            await on_shutdown()

    app = FastAPIOffline(
        docs_url="/docs",
        redoc_url=None,
        static_url=DOCS_ASSETS,
        title="gitops-sless",
        summary="Serverless functions on Kubernetes, deployed by git push.",
        version="0.1.0",
        lifespan=lifespan,
    )
    replies.install_error_handlers(app)
    app.add_middleware(ReadGate, access=access, signin_page=signin_page)
    app.state.access = access  # replicas share their sign-outs through it (serve)

    def authorize(credentials: HTTPAuthorizationCredentials | None) -> None:
        refusal = access.write_refusal(credentials.credentials if credentials else None)
        if refusal is not None:
            raise HTTPException(*refusal)

    @app.get("/healthz", tags=["health"])
    def healthz() -> Health:
        return Health(status="ok")

    @app.get(
        "/readyz",
        tags=["health"],
        responses={503: {"model": Readiness, "description": "not synced with the cluster yet"}},
    )
    def readyz(response: Response) -> Readiness:
        if readiness is not None:
            ready, reason = readiness()
        else:
            ready = reconciler.passes > 0
            reason = "a first pass ran" if ready else "waiting for the first pass"
        if not ready:
            response.status_code = 503
        return Readiness(status="ready" if ready else "not ready", reason=reason)

    @app.get(
        "/metrics",
        tags=["health"],
        response_class=PlainTextResponse,
        dependencies=_READ,
        responses={
            401: {
                "description": replies.ERROR_TEXT[401],
                "content": {"application/json": {"schema": ErrorReply.model_json_schema()}},
            }
        },
    )
    def metrics() -> str:
        if routes is not None:
            METRICS.open_connections.replace(
                [
                    (count, {"env": r.env, "function": r.name, "kind": kind})
                    for r in routes.all()
                    for kind, count in (("stream", r.load.streams), ("websocket", r.load.sockets))
                ]
            )
        return METRICS.render()

    @app.get("/api/v1/status", tags=["status"], dependencies=_READ, responses=replies.errors(401))
    def status() -> Status:
        env = reconciler.env
        return Status.from_rows(
            repository=repo,
            branch=branch,
            environment=env,
            functions=store.functions(env),
            syncs=store.syncs(MAX_SYNCS, env),
            sandbox=sandbox,
        )

    @app.get(
        "/api/v1/environments", tags=["status"], dependencies=_READ, responses=replies.errors(401)
    )
    def environments() -> list[Environment]:
        """Every environment: the tracked branch's and one per pull-request preview."""
        rows = {f"pr-{row['number']}": row for row in (previews.listing() if previews else [])}
        names = sorted(set(store.environments()) | set(rows))
        return [
            Environment.from_rows(
                env,
                store.functions(env),
                store.last_sync(env),
                rows.get(env),
                pull_request_link(repo, int(env[3:]), forge) if env in rows else None,
            )
            for env in names
            if not env.startswith("pr-") or env in rows
        ]

    @app.delete(
        "/api/v1/environments/{env}",
        tags=["sync"],
        status_code=202,
        responses=replies.errors(401, 403, 404, 422),
    )
    def delete_environment(
        env: str, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
    ) -> WebhookReply:
        """Tear a preview down now: its routes answer 404 at once, the rest follows."""
        authorize(credentials)
        number = int(env[3:]) if re.fullmatch(r"pr-[1-9][0-9]{0,9}", env) else None
        if previews is None or number is None or not previews.delete(number):
            raise HTTPException(404, f"no preview environment {env!r}")
        return WebhookReply(accepted=True)

    @app.get(
        "/api/v1/environments/{env}/functions",
        tags=["status"],
        dependencies=_READ,
        responses=replies.errors(401, 422),
    )
    def functions(env: str) -> list[Function]:
        return [Function.from_row(row, **scaled(env, row)) for row in store.functions(env)]

    @app.get(
        "/api/v1/environments/{env}/functions/{name}",
        tags=["status"],
        dependencies=_READ,
        responses=replies.errors(401, 404, 422),
    )
    def function(env: str, name: str) -> FunctionDetail:
        row = store.function(env, name)
        if row is None:
            raise HTTPException(404, f"no function {name!r} in environment {env!r}")
        build = store.build_of(row)
        jobs = [job for job in store.jobs(env) if job["function"] == name]
        detail = FunctionDetail.from_rows(row, build, jobs, store.invocations(env, name))
        return detail.model_copy(update=scaled(env, row))

    @app.get(
        "/api/v1/environments/{env}/jobs",
        tags=["status"],
        dependencies=_READ,
        responses=replies.errors(401, 422),
    )
    def jobs(env: str) -> list[JobRun]:
        return [JobRun.from_row(row) for row in store.jobs(env)]

    @app.get(
        "/api/v1/syncs", tags=["status"], dependencies=_READ, responses=replies.errors(401, 422)
    )
    def syncs(
        limit: Annotated[int, Query(description=f"how many, newest first (1-{MAX_SYNCS})")] = 50,
        env: Annotated[str | None, Query(description="only this environment's passes")] = None,
    ) -> list[Sync]:
        rows = store.syncs(min(max(limit, 1), MAX_SYNCS), env)
        return [Sync.from_row(row) for row in rows]

    @app.post(
        "/api/v1/sync", tags=["sync"], status_code=202, responses=replies.errors(401, 403, 422)
    )
    def sync(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
        wait: Annotated[
            float,
            Query(
                description="seconds to wait for the pass, and the builds and jobs it "
                f"starts, to finish (at most {MAX_WAIT_SEC})"
            ),
        ] = 0,
    ) -> SyncAccepted:
        authorize(credentials)
        served_after = reconciler.request_sync("api")
        timeout = min(wait, MAX_WAIT_SEC)
        # a pass, and the builds and jobs it started: what the commit asks for is done
        finished = reconciler.wait_for_settled(served_after - 1, timeout) if wait > 0 else False
        return SyncAccepted.from_rows(store.last_sync(reconciler.env), finished=finished)

    @app.post(
        "/api/v1/webhooks/{forge}",
        tags=["webhooks"],
        status_code=202,
        responses={
            200: {
                "model": WebhookReply,
                "description": "ignored: another branch or event, a delivery received before "
                "(`duplicate delivery`), or a PR the forge says is not open at that head",
            },
            **replies.errors(400, 401, 403, 404, 413, 422),
        },
        openapi_extra=_WEBHOOK_BODY,
    )
    async def webhook(forge: str, request: Request, response: Response) -> WebhookReply:
        if forge not in webhooks.FORGES:
            raise HTTPException(
                404, f"no webhook for {forge!r}; use one of {', '.join(webhooks.FORGES)}"
            )
        secret = webhooks.secret_for(forge, webhook_secrets or {}, webhook_secret)
        if not secret:
            raise HTTPException(
                403,
                f"webhooks from {forge} are disabled: no webhook secret is configured for it "
                f"(SLESS_WEBHOOK_SECRET_{forge.upper()} or SLESS_WEBHOOK_SECRET)",
            )
        try:
            body = await replies.read_capped(request, MAX_WEBHOOK_BYTES)
        except ClientDisconnect:
            logs.event(
                log,
                "webhook.disconnected",
                f"{forge} webhook: the client closed the connection before sending its body",
                level=logging.DEBUG,
            )
            raise HTTPException(CLIENT_CLOSED, "client closed the connection") from None
        if body is None:
            raise HTTPException(413, f"webhook body is larger than {MAX_WEBHOOK_BYTES} bytes")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            webhooks.verify(forge, headers, body, secret)
            push = webhooks.parse_push(forge, headers, body)
            pull = pulls.pull_request_event(forge, push.event, body) if previews else None
            delivery = webhooks.delivery_id(forge, headers)
        except webhooks.SignatureError as exc:
            raise HTTPException(401, f"webhook refused: {exc}") from None
        except webhooks.PayloadError as exc:
            raise HTTPException(400, str(exc)) from None
        if pull is None and (push.event != "push" or push.branch != branch):
            response.status_code = 200
            return WebhookReply(accepted=False, ignored=_ignored(push))
        # signed: the leader verifies it again, and de-duplicates it in its own store
        if forward_webhook is not None and webhooks.FORWARDED_BY.lower() not in headers:
            forwarded = await run_in_threadpool(forward_webhook, forge, headers, body)
            if forwarded is not None:
                response.status_code = forwarded[0]
                return WebhookReply.model_validate(forwarded[1])
        # only now, signed: an unsigned request never marks a delivery as seen
        digest = webhooks.body_digest(body) if pull is not None else None
        reply = await run_in_threadpool(deliver, forge, push, pull, delivery, digest)
        if not reply.accepted:
            response.status_code = 200
        return reply

    def deliver(
        forge: str,
        push: webhooks.Push,
        pull: pulls.PullRequest | None,
        delivery: str | None,
        digest: str | None,
    ) -> WebhookReply:
        """Act on a signed delivery once: its replay, by id or (a PR event) by body, is 200."""
        if not store.claim_delivery(forge, delivery, digest):
            seen = delivery or f"with body sha256 {(digest or '')[:12]}"
            logs.event(
                log,
                "webhook.duplicate",
                f"{forge} webhook: delivery {seen} was received before: ignored",
            )
            return WebhookReply(accepted=False, ignored="duplicate delivery")
        try:
            if pull is None:
                reconciler.request_sync(f"webhook:{forge}")
                return WebhookReply(accepted=True)
            refused = previews.unconfirmed(pull)
            if refused:
                env = f"pr-{pull.number}"
                logs.event(
                    log,
                    "webhook.unconfirmed",
                    f"{env}: {refused}: ignored",
                    level=logging.WARNING,
                    env=env,
                )
                return WebhookReply(accepted=False, ignored=refused)
            previews.on_event(pull)
        except BaseException:
            store.release_delivery(forge, delivery, digest)  # not acted on: may come again
            raise
        # the PR's commits come with the next fetch; the previews pass follows it
        reconciler.request_sync(f"webhook:{forge}:pull")
        return WebhookReply(accepted=True)

    # --- the command line's reads: diff and logs ------------------------------------------

    state_dir = store.path.parent  # serve keeps status.db at the top of its state folder
    deployed_states: dict[str, model.DesiredState] = {}  # revision -> what it declared
    manifest_cache = manifest.ManifestCache()
    loading = threading.Lock()

    def running_functions(records: list[dict[str, Any]]) -> dict[str, model.Function]:
        """Deployed functions as the revision they serve declared them (from the mirror)."""
        source = getattr(reconciler, "source", None)
        found: dict[str, model.Function] = {}
        if source is None:
            return found
        with loading:
            for record in records:
                revision = record["revision"]
                if not revision or not isinstance(record.get("spec"), dict):
                    continue
                state = deployed_states.get(revision)
                if state is None:
                    try:
                        state = manifest.load(source.snapshot(revision), manifest_cache)
                    except SlessError:
                        continue
                    while len(deployed_states) >= KEPT_REVISIONS:
                        deployed_states.pop(next(iter(deployed_states)))
                    deployed_states[revision] = state
                if record["name"] in state.functions:
                    found[record["name"]] = state.functions[record["name"]]
        return found

    def compare(env: str, desired: model.DesiredState, revision: str | None) -> DiffReply:
        records = store.functions(env)
        tags = {fn.build_tag for fn in desired.functions.values()}
        result = diff_mod.compute(
            desired,
            env,
            records,
            {tag: store.build(tag) for tag in tags},
            store.jobs(env),
            running_functions(records),
            declared_functions(env),
        )
        return DiffReply.from_diff(result, revision)

    def declared_functions(env: str) -> dict[str, model.Function]:
        """What the server's last pass of ``env`` declares (the tracked branch's only)."""
        return dict(reconciler.declared()) if env == reconciler.env else {}

    @app.post(
        "/api/v1/environments/{env}/diff",
        tags=["status"],
        dependencies=_READ,
        responses=replies.errors(401, 413, 422),
        openapi_extra=_DIFF_BODY,
    )
    async def diff(env: str, request: Request) -> DiffReply:
        """What a sync of the posted desired state would change in ``env`` (a read)."""
        try:
            body = await replies.read_capped(request, MAX_DIFF_BYTES)
        except ClientDisconnect:
            raise HTTPException(CLIENT_CLOSED, "client closed the connection") from None
        if body is None:
            raise HTTPException(413, f"diff body is larger than {MAX_DIFF_BYTES} bytes")
        try:
            wanted = diffs.read_request(body)
            desired = wanted.desired_state()
        except ValidationError as exc:  # never, after the schema: a bug, said as one
            raise HTTPException(422, replies.invalid_body(exc)) from None
        except (ValueError, SlessError) as exc:  # the schema refused it, or runtimes/ lacks one
            raise HTTPException(422, str(exc)) from None
        return await run_in_threadpool(compare, env, desired, wanted.revision)

    app.include_router(logs_router(store, state_dir, getattr(reconciler, "backend", None)))
    if invocations is not None:
        app.include_router(invocations_router(invocations, authorize))
    app.include_router(notifications_router(notifications or list))
    app.include_router(
        revisions_router(reconciler, store, routes or RouteTable(), authorize, fn_url)
    )
    app.include_router(
        dashboard_router(
            reconciler,
            store,
            repo,
            branch,
            poll_interval,
            access,
            forge,
            scaling,
            invocations,
            routes,
            fn_url,
            trace_url,
        )
    )
    return app
