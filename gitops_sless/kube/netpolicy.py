"""What the environments' NetworkPolicies allow, from two settings.

Every function namespace admits ingress from its own pods and from the
reconciler's pods only: a ``from`` entry that selects the reconciler's
namespace *and* its pods' labels, so the build pods that share that namespace
are not let in. Preview namespaces also deny egress except DNS (to the
cluster's DNS pods), their own namespace and the CIDRs the operator lists in
``SLESS_PREVIEW_EGRESS``. A wide CIDR never opens the link-local range (cloud
metadata, 169.254.169.254): an operator who wants an address there lists it
itself.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "DEFAULT_RECONCILER_LABELS",
    "DNS_NAMESPACE",
    "DNS_POD_LABELS",
    "METADATA_BLOCKS",
    "ip_blocks",
    "parse_cidrs",
    "parse_labels",
]

# the labels of the reconciler's pods in deploy/deployment.yaml
DEFAULT_RECONCILER_LABELS: tuple[tuple[str, str], ...] = (
    ("app.kubernetes.io/name", "gitops-sless"),
)
# CoreDNS keeps kube-dns's label on kubeadm, GKE, EKS and AKS
DNS_NAMESPACE = "kube-system"
DNS_POD_LABELS = {"k8s-app": "kube-dns"}
# link-local (cloud metadata, node-local services) and AWS's IPv6 metadata address
METADATA_BLOCKS = (
    ipaddress.ip_network("169.254.0.0/16"),
    ipaddress.ip_network("fd00:ec2::254/128"),
)

_LABEL_NAME = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def parse_cidrs(text: str) -> tuple[str, ...]:
    """``10.0.0.0/8, 203.0.113.7/32`` -> normalised CIDRs; ValueError names the bad one."""
    found = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "/" not in item:
            raise ValueError(f"{item!r} is not a CIDR: write it with its prefix, e.g. {item}/32")
        try:
            network = ipaddress.ip_network(item, strict=True)
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a CIDR ({exc})") from exc
        if str(network) not in found:
            found.append(str(network))
    return tuple(found)


def ip_blocks(cidrs: Iterable[str]) -> list[dict[str, Any]]:
    """One ``ipBlock`` per CIDR, with the metadata ranges it strictly contains left out."""
    blocks = []
    for cidr in cidrs:
        network = ipaddress.ip_network(cidr)
        holes = [
            str(hole)
            for hole in METADATA_BLOCKS
            if hole.version == network.version and hole != network and hole.subnet_of(network)  # type: ignore[arg-type]
        ]
        blocks.append({"ipBlock": {"cidr": cidr, **({"except": holes} if holes else {})}})
    return blocks


def parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    """``key=value,key=value`` -> sorted pairs; ValueError for an empty or malformed one."""
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _label_key(key) or not (value == "" or _label_value(value)):
            raise ValueError(f"{item!r} is not a label: expected key=value")
        pairs[key] = value
    if not pairs:
        raise ValueError("no labels: at least one key=value must select the reconciler's pods")
    return tuple(sorted(pairs.items()))


def _label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return _label_value(name)


def _label_value(value: str) -> bool:
    return len(value) <= 63 and _LABEL_NAME.fullmatch(value) is not None
