"""The public URL of the functions when a Gateway (Gateway API) serves ``/fn/``.

Read from the Gateway object itself: the address its controller published
(``status.addresses[0].value``), or the hostname of its HTTP(S) listener when that
names one host (a request to the bare address would match no route), with the
listener's scheme and port.
"""

from __future__ import annotations

import ipaddress
from typing import Any

__all__ = ["gateway_url"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def gateway_url(gateway: dict[str, Any]) -> str | None:
    """``scheme://host[:port]`` of ``gateway``; None until its controller gave it an address."""
    addresses = (gateway.get("status") or {}).get("addresses") or []
    address = str((addresses[0] or {}).get("value") or "") if addresses else ""
    if not address:
        return None
    listener = _listener(gateway)
    scheme = "https" if str(listener.get("protocol", "")).upper() == "HTTPS" else "http"
    hostname = str(listener.get("hostname") or "")
    host = hostname if hostname and "*" not in hostname else _host(address)
    port = int(listener.get("port") or _DEFAULT_PORTS[scheme])
    return f"{scheme}://{host}" + ("" if port == _DEFAULT_PORTS[scheme] else f":{port}")


def _listener(gateway: dict[str, Any]) -> dict[str, Any]:
    """The first listener that speaks HTTP or HTTPS (HTTPRoutes attach to those only)."""
    for listener in (gateway.get("spec") or {}).get("listeners") or []:
        if str(listener.get("protocol", "")).upper() in ("HTTP", "HTTPS"):
            return dict(listener)
    return {}


def _host(address: str) -> str:
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address  # a hostname (a cloud load balancer's DNS name)
