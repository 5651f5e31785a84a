"""A small NetworkPolicy evaluator: given policies and two ends, may this connection open?

It follows the networking.k8s.io/v1 rules a CNI implements: a pod no policy of a
direction selects is open in that direction; a selected pod admits a connection when
any rule of any selecting policy matches it (every ``from``/``to`` entry is an OR, the
namespace and pod selectors inside one entry an AND; no ``ports`` means every port).
``ipBlock`` is matched against endpoints outside the cluster only: what a CNI does
with pod addresses there is implementation-defined, so the tests never rely on it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """A pod (``namespace`` set) or an address outside the cluster (``namespace`` None)."""

    namespace: str | None = None
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ip: str = "10.244.0.10"

    def ns_labels(self) -> dict[str, str]:
        # the API server sets this label on every namespace (Kubernetes >= 1.22)
        return {**self.namespace_labels, "kubernetes.io/metadata.name": self.namespace or ""}


def pod(namespace: str, labels: Mapping[str, str] | None = None, **ns_labels: str) -> Endpoint:
    return Endpoint(namespace, dict(labels or {}), dict(ns_labels))


def outside(ip: str) -> Endpoint:
    return Endpoint(None, {}, {}, ip)


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics; an empty selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.namespace is not None:
            return False
        block = peer["ipBlock"]
        address = ipaddress.ip_address(other.ip)
        network = ipaddress.ip_network(block["cidr"])
        if address.version != network.version or address not in network:
            return False
        return not any(
            address in ipaddress.ip_network(hole)
            for hole in block.get("except") or []
            if ipaddress.ip_network(hole).version == address.version
        )
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != policy_ns:
        return False  # a podSelector alone selects pods of the policy's own namespace
    return selects(peer.get("podSelector"), other.pod_labels)


def _port_matches(ports: Iterable[Mapping[str, Any]] | None, port: int, protocol: str) -> bool:
    ports = list(ports or [])
    return not ports or any(
        p.get("protocol", "TCP") == protocol and p.get("port") in (None, port) for p in ports
    )


def _allows(
    policies: Iterable[Mapping[str, Any]],
    direction: str,
    subject: Endpoint,
    other: Endpoint,
    port: int,
    protocol: str,
) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], subject.pod_labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            ns = policy["metadata"]["namespace"]
            if (not peers or any(_peer_matches(p, ns, other) for p in peers)) and _port_matches(
                rule.get("ports"), port, protocol
            ):
                return True
    return False


def connects(
    policies: Iterable[Mapping[str, Any]],
    source: Endpoint,
    target: Endpoint,
    port: int = 8080,
    protocol: str = "TCP",
) -> bool:
    """Whether ``source`` may open a connection to ``target``: its egress and their ingress."""
    policies = list(policies)
    egress = source.namespace is None or _allows(policies, "Egress", source, target, port, protocol)
    ingress = target.namespace is None or _allows(
        policies, "Ingress", target, source, port, protocol
    )
    return egress and ingress
