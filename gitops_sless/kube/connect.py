"""Putting the Kubernetes backend together: credentials, checks, and how the proxy gets in.

In a cluster the invoke proxy goes straight to a function's Service
(``http://<name>.<namespace>.svc:80``). Outside one (a laptop with a
kubeconfig) it goes through the API server's service proxy with the
kubeconfig's credentials, as ``kubectl proxy`` would.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from ..errors import SlessError
from ..plan.backend import CronRun
from ..state.routes import Gateway, Route, RouteTable
from .backend import KubeBackend
from .builds import Builds
from .client import KubeClient, api_host
from .settings import KubeSettings, StartupError, check
from .storage import ContextStore

__all__ = ["connect", "route_maker"]

SERVICE_PORT = 80


def route_maker(client: KubeClient) -> Callable[[str, str, str, float], Route]:
    """How the proxy reaches a function's Service from where this process runs."""
    if client.in_cluster:

        def direct(env: str, name: str, namespace: str, timeout: float) -> Route:
            return Route(env, name, timeout, ((f"{name}.{namespace}.svc", SERVICE_PORT),))

        return direct
    host, port, tls = api_host(client)
    configuration = client.api.configuration
    # asked on every call, never waiting: the reconciler's own requests renew a token that
    # expires or is refused, and the proxy takes the renewed one from the next call on
    authorization = client.credentials.cached
    context = _ssl_context(configuration) if tls else None

    def through_api_server(env: str, name: str, namespace: str, timeout: float) -> Route:
        gateway = Gateway(
            host=host,
            port=port,
            path_prefix=f"/api/v1/namespaces/{namespace}/services/{name}:{SERVICE_PORT}/proxy",
            authorization=authorization,
            ssl=context,
            server_hostname=configuration.tls_server_name or host,
        )
        return Route(env, name, timeout, ((host, port),), gateway=gateway)

    return through_api_server


def _ssl_context(configuration: object) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=getattr(configuration, "ssl_ca_cert", None))
    if not getattr(configuration, "verify_ssl", True):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    cert, key = getattr(configuration, "cert_file", None), getattr(configuration, "key_file", None)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def connect(
    settings: KubeSettings,
    routes: RouteTable,
    *,
    on_cron: Callable[[CronRun], None] | None = None,
    build_retry_sec: float = 300.0,
) -> KubeBackend:
    """A checked backend; raises StartupError (one line) when something it needs is missing."""
    try:
        client = KubeClient.from_config(settings.kubeconfig, settings.context)
    except SlessError as exc:
        raise StartupError(str(exc)) from exc
    client.own_namespace = settings.namespace
    contexts = ContextStore(settings.s3)
    check(client, settings, contexts.check)
    config = settings.render_config()
    builds = Builds(client, contexts, config, retry_sec=build_retry_sec)
    return KubeBackend(client, builds, config, routes, route_maker(client), on_cron=on_cron)
