"""The kinds this package uses, and where the API server serves each (group, version, plural).

What it may do with each is the calls table, ``CALLS`` in :mod:`.client`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

__all__ = ["KINDS", "Kind", "kind_of"]


@dataclass(frozen=True)
class Kind:
    name: str
    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        return base + (f"/{quote(name, safe='')}" if name is not None else "")


KINDS = {
    kind.name: kind
    for kind in (
        Kind("Namespace", "", "v1", "namespaces", namespaced=False),
        Kind("Secret", "", "v1", "secrets"),
        Kind("ConfigMap", "", "v1", "configmaps"),
        Kind("ServiceAccount", "", "v1", "serviceaccounts"),
        Kind("Service", "", "v1", "services"),
        Kind("Pod", "", "v1", "pods"),
        Kind("Deployment", "apps", "v1", "deployments"),
        Kind("Job", "batch", "v1", "jobs"),
        Kind("CronJob", "batch", "v1", "cronjobs"),
        Kind("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
        Kind("Lease", "coordination.k8s.io", "v1", "leases"),
        Kind("Function", "gitops-sless.dev", "v1alpha1", "functions"),
        # the Gateway API, with --gateway only (its CRDs come with the cluster's gateway)
        Kind("HTTPRoute", "gateway.networking.k8s.io", "v1", "httproutes"),
        Kind("Gateway", "gateway.networking.k8s.io", "v1", "gateways"),
        # lets the HTTPRoutes of the environments send idle functions' calls to the
        # reconciler's Service, in its own namespace
        Kind("ReferenceGrant", "gateway.networking.k8s.io", "v1beta1", "referencegrants"),
    )
}


def kind_of(name: str) -> Kind:
    return KINDS[name]
