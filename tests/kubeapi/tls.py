"""HTTPS for the fake API server: a certificate authority of its own, made at start.

``kubectl`` sends a bearer token only over TLS, so a server that ``kubectl`` is to use
(``scripts/run-kube``) serves HTTPS with a server certificate for 127.0.0.1 and
``localhost``; the kubeconfig carries the CA as ``certificate-authority-data``, as a
cluster's does. The certificates live in memory only (``trustme``).
"""

from __future__ import annotations

import base64
import socket
import ssl
from typing import Any

import trustme


class ServerTLS:
    """A CA and a certificate it issued for the loopback names."""

    def __init__(self) -> None:
        self.ca = trustme.CA(organization_name="fake-kube")
        self._cert = self.ca.issue_cert("127.0.0.1", "localhost")

    def wrap(self, listening: socket.socket) -> ssl.SSLSocket:
        """The listening socket with TLS; the handshake runs in the connection's own thread
        (on its first read), so a client that never finishes one blocks no one else."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._cert.configure_cert(context)
        return context.wrap_socket(listening, server_side=True, do_handshake_on_connect=False)

    def cluster_fields(self) -> dict[str, Any]:
        """What a kubeconfig's ``cluster`` needs to trust this server."""
        pem = self.ca.cert_pem.bytes()
        return {"certificate-authority-data": base64.b64encode(pem).decode("ascii")}

    def ca_pem(self) -> bytes:
        return self.ca.cert_pem.bytes()
