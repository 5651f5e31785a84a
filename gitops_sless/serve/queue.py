"""Which queue engine a server's asynchronous invocations use, from ``--queue``.

The local backend defaults to SQLite in the state folder (``scripts/run`` gets async
with nothing to install). The Kubernetes backend has no default: a pod's disk does
not outlive the pod, so without ``--queue nats://`` submissions are refused (503)
with a message that says so, and ``--queue sqlite`` is refused at start.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Sequence

from ..errors import SlessError
from ..invocations.callbacks import CallbackSecrets
from ..invocations.engine import Engine
from ..invocations.service import Invocations, Network
from ..invocations.worker import Caller
from ..state.routes import RouteTable
from .config import ServeConfig

__all__ = ["NO_QUEUE_ON_KUBERNETES", "QueueRefused", "invocations", "queue_refusal"]

NO_QUEUE_ON_KUBERNETES = (
    "asynchronous invocations on the Kubernetes backend need --queue nats://HOST:PORT "
    "(a pod's disk is not durable): this server runs without them"
)


class QueueRefused(SlessError):
    """``--queue`` names something this server cannot use: it does not start."""


def queue_refusal(queue: str | None, backend: str) -> str | None:
    """Why ``--queue`` cannot be used with ``backend`` (None: it can)."""
    if queue is None:
        return None
    if queue == "sqlite":
        if backend == "kubernetes":
            return (
                "--queue sqlite: the Kubernetes backend needs nats:// (a pod's disk is not durable)"
            )
        return None
    if queue.startswith(("nats://", "tls://")) and len(queue.split("://", 1)[1]) > 0:
        return None
    return f"--queue {queue}: expected sqlite or nats://HOST:PORT"


def _networks(values: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(v, strict=False) for v in values)


def _own_networks(config: ServeConfig) -> tuple[Network, ...]:
    """Addresses that are this server's or its cluster's, beyond the private ranges that
    callbacks never reach anyway: the API server's Service, the address it listens on."""
    own: list[Network] = []
    for value in (os.environ.get("KUBERNETES_SERVICE_HOST"), config.host):
        with contextlib.suppress(ValueError):
            own.append(ipaddress.ip_network(value or "", strict=False))
    return tuple(n for n in own if not n.is_unspecified)


def invocations(config: ServeConfig, routes: RouteTable, call: Caller) -> Invocations:
    """The server's asynchronous invocations (QueueRefused for an unusable --queue)."""
    refused = queue_refusal(config.queue, config.backend)
    if refused is not None:
        raise QueueRefused(refused)
    queue = config.queue or ("sqlite" if config.backend == "local" else None)
    engine: Engine | None = None
    if queue == "sqlite":
        from ..invocations.sqlite import SqliteEngine

        engine = SqliteEngine(
            config.state_dir / "invocations.db", retention_sec=config.invocation_retention
        )
    elif queue is not None:
        from ..invocations.nats import NatsEngine  # nats-py loads only when asked for

        engine = NatsEngine(queue, main_env=config.env, retention_sec=config.invocation_retention)
    return Invocations(
        engine,
        routes,
        call,
        CallbackSecrets(config.secrets_dir, config.preview_secrets_dir, config.state_dir),
        max_body_bytes=config.max_body_bytes,
        retention_sec=config.invocation_retention,
        callback_allow=_networks(config.callback_allow),
        own_networks=_own_networks(config),
        unavailable=NO_QUEUE_ON_KUBERNETES if engine is None else None,
    )
