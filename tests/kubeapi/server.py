"""The HTTP layer of the fake API server: bearer-token auth, routing of the Kubernetes REST
paths (resources, subresources, cluster-wide lists, discovery), watches as chunked event
streams, pods/log, services/proxy, injected failures, request counting, ``/_test`` hooks."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import sys
import traceback
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from . import scale, watch
from .patches import APPLY, parse_body
from .resources import BY_KIND, VERSION_INFO, ApiError, Res, not_found
from .routes import Route, discovery_versions, route
from .runtimes import forward
from .store import matches
from .tables import table, wants_table

if TYPE_CHECKING:
    from .fake import FakeKube

WRITES = {"create", "update", "patch", "apply", "delete", "deletecollection"}
PUBLIC = {"/version", "/healthz", "/livez", "/readyz"}
WEBSOCKET_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _true(value: str | None) -> bool:
    return value is not None and value.lower() in ("true", "1")


def _warning(text: str) -> str:
    """A ``Warning`` header value (RFC 7234), as the API server sends them."""
    return '299 - "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def present(res: Res, obj: Any) -> Any:
    """``obj`` as version ``res.version`` serves it (a CRD's kind is stored in one version)."""
    if (
        isinstance(obj, dict)
        and obj.get("kind") == res.kind
        and res.api_version != obj.get("apiVersion")
    ):
        return dict(obj, apiVersion=res.api_version)
    return obj


class Handler(BaseHTTPRequestHandler):
    """One connection of the fake API server; ``server.fake`` is the ``FakeKube``."""

    protocol_version = "HTTP/1.1"
    server_version = "fake-kube-apiserver"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def fake(self) -> FakeKube:
        return self.server.fake  # type: ignore[attr-defined]

    # ---- responses
    def send(
        self,
        code: int,
        body: Any,
        headers: dict[str, str] | None = None,
        ctype: str = "application/json",
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self._headers_buffer.append(b"\r\n" + data)  # type: ignore[attr-defined]
        self.flush_headers()  # headers and body in one write

    def fail(self, err: ApiError) -> None:
        self.send(err.code, err.status(), err.headers)

    def do_GET(self) -> None:
        self.handle_any("GET")

    def do_POST(self) -> None:
        self.handle_any("POST")

    def do_PUT(self) -> None:
        self.handle_any("PUT")

    def do_PATCH(self) -> None:
        self.handle_any("PATCH")

    def do_DELETE(self) -> None:
        self.handle_any("DELETE")

    def do_OPTIONS(self) -> None:
        self.handle_any("OPTIONS")

    def handle_any(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = (
            url.path.rstrip("/")
            if url.path not in ("/",) and "/proxy/" not in url.path
            else url.path
        )
        try:
            if path.startswith("/_test/"):
                code, body = self.fake.test_hook(method, path, query, raw)
                self.send(code, body)
                return
            if path in PUBLIC:
                self.send(200, VERSION_INFO) if path == "/version" else self.send(
                    200, b"ok", ctype="text/plain"
                )
                return
            if not self.fake.accepts(self.headers.get("Authorization")):
                raise ApiError(401, "Unauthorized", "Unauthorized")
            found = route(path, self.fake.store.kinds)
            if isinstance(found, dict):
                if found.get("_discovery") == "versions":
                    found = discovery_versions(f"127.0.0.1:{self.server.server_address[1]}")
                self.send(200, found)
                return
            self.dispatch(method, found, query, raw, url.query)
        except ApiError as err:
            self.fail(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.fail(ApiError(500, "InternalError", f"Internal error occurred: {exc}"))

    def dispatch(
        self, method: str, r: Route, query: dict[str, str], raw: bytes, raw_query: str
    ) -> None:
        ctype = self.headers.get("Content-Type") or ""
        verb = self._verb(method, r, query, ctype)
        kind = r.res.kind + (f"/{r.sub}" if r.sub in ("status", "scale") else "")
        if r.sub == "log":
            kind = "Pod"
        if r.sub == "proxy":
            kind = r.res.kind
        injected = self.fake.count_request(verb, kind)
        if injected is not None:
            self.fail(injected)
            return
        fake, api, res = self.fake, self.fake.api, r.res
        ns = r.ns or ""
        manager = query.get("fieldManager") or None
        dry = "dryRun" in query
        headers: dict[str, str] = {}
        api.begin(query.get("fieldValidation"))
        if verb == "proxy":
            self.proxy(r, method, raw, raw_query)
            return
        if verb == "log":
            self.send(200, fake.pod_log(ns, r.name or "", query).encode(), ctype="text/plain")
            return
        if verb == "watch":
            self.watch(r, query)
            return
        if verb == "list":
            body = api.list(res, r.ns, query.get("labelSelector"), query.get("fieldSelector"))
            self.send(200, self.printed(res, body, query))
            return
        if verb == "get" and r.sub == "scale":
            self.send(200, scale.read(api, res, ns, r.name or ""))
            return
        if verb == "get":
            self.send(200, self.printed(res, present(res, api.get(res, ns, r.name or "")), query))
            return
        name = r.name or ""
        code = 200
        if r.sub == "scale":
            if verb not in ("update", "patch", "apply"):
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            out = scale.write(
                api,
                res,
                ns,
                name,
                raw,
                None if verb == "update" else ctype,
                (manager or "") if verb == "apply" else manager or self._ua_manager(),
                _true(query.get("force")),
            )
        elif r.sub == "status" and verb in ("update", "patch", "apply"):
            out = api.write_status(
                res,
                ns,
                name,
                raw,
                None if verb == "update" else ctype,
                manager if verb == "apply" else manager or self._ua_manager(),
                _true(query.get("force")),
            )
        elif verb == "create":
            out, code = (
                api.create(res, ns, parse_body(raw), manager or self._ua_manager(), dry),
                201,
            )
        elif verb == "update":
            out = api.replace(res, ns, name, parse_body(raw), manager or self._ua_manager(), dry)
        elif verb in ("patch", "apply"):
            if verb == "patch":
                manager = manager or self._ua_manager()
            code, out = api.patch(
                res, ns, name, raw, ctype, manager, _true(query.get("force")), dry
            )
        elif verb == "delete":
            options = parse_body(raw) if raw else {}
            options = dict(
                options or {}, **{k: query[k] for k in ("propagationPolicy",) if k in query}
            )
            out, headers = api.delete(res, ns, name, options)
        else:
            options = {k: query[k] for k in ("propagationPolicy",) if k in query}
            out = api.delete_collection(
                res, r.ns, query.get("labelSelector"), query.get("fieldSelector"), options
            )
        fake.count_write(verb, kind)
        fake.controllers.process()
        warnings = api.warnings()
        if warnings:
            headers["Warning"] = ", ".join(_warning(w) for w in warnings)
        self.send(code, present(res, out), headers)

    def printed(self, res: Res, body: Any, query: dict[str, str]) -> Any:
        """``body``, or the Table of it that ``kubectl get`` asks for (see ``tables``)."""
        if not wants_table(self.headers.get("Accept")):
            return body
        return table(self.fake.store, res, body, query.get("includeObject"))

    def _ua_manager(self) -> str:
        agent = self.headers.get("User-Agent") or ""
        return agent.split("/", 1)[0][:128] or "unknown"

    def _verb(self, method: str, r: Route, query: dict[str, str], ctype: str) -> str:
        if r.sub == "proxy":
            return "proxy"
        if r.sub == "log":
            if method != "GET":
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            return "log"
        if method == "GET":
            if r.name is None:
                return "watch" if _true(query.get("watch")) else "list"
            return "get"
        if method == "POST" and r.name is None and (r.ns is not None or not r.res.namespaced):
            return "create"
        if method == "PUT" and r.name is not None:
            return "update"
        if method == "PATCH" and r.name is not None:
            return "apply" if ctype.split(";")[0].strip() == APPLY else "patch"
        if method == "DELETE":
            return "delete" if r.name is not None else "deletecollection"
        raise ApiError(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )

    # ---- pods/proxy: to the pod's runtime process (see ``runtimes``)
    def pod_proxy(self, r: Route, method: str, raw: bytes, raw_query: str) -> None:
        ns, target = r.ns or "", r.name or ""
        name = target.split(":")[0]
        pod = self.fake.store.peek("Pod", ns, name)
        if pod is None:
            raise not_found(BY_KIND["Pod"], name)
        port = self.fake.kubelet.runtimes.port(pod["metadata"]["uid"])
        if port is None:
            message = f"error trying to reach service: dial tcp {target}: connection refused"
            raise ApiError(503, "ServiceUnavailable", message)
        skip = ("authorization", "host", "content-length", "connection")
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        path = r.tail + (f"?{raw_query}" if raw_query else "")
        code, body, ctype = forward(port, method, path, headers, raw)
        self.send(code, body, ctype=ctype)

    # ---- services/proxy
    def proxy(self, r: Route, method: str, raw: bytes, raw_query: str) -> None:
        if r.res.kind == "Pod":
            self.pod_proxy(r, method, raw, raw_query)
            return
        ns = r.ns or ""
        target = r.name or ""
        parts = target.split(":")
        name = parts[1] if len(parts) == 3 else parts[0]
        port = parts[-1] if len(parts) > 1 else None
        trace = self.fake.trace
        if trace is not None:
            trace("proxy", {"namespace": ns, "service": name, "method": method, "path": r.tail})
        svc = self.fake.store.peek("Service", ns, name)
        if svc is None:
            raise not_found(BY_KIND["Service"], name)
        spec = svc.get("spec") or {}
        ports = spec.get("ports") or []
        port_ok = port is None or any(
            port in (str(p.get("name")), str(p.get("port"))) for p in ports
        )
        selector = spec.get("selector") or {}
        ready = [
            p
            for p in self.fake.store.scan("Pod", ns)
            if selector
            and port_ok
            and matches(
                [(k, "=", (v,)) for k, v in selector.items()], p["metadata"].get("labels") or {}
            )
            and (p.get("status") or {}).get("phase") == "Running"
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions") or ()
            )
        ]
        if not ready:
            raise ApiError(
                503, "ServiceUnavailable", f'no endpoints available for service "{target}"'
            )
        if (self.headers.get("Upgrade") or "").strip().lower() == "websocket":
            self.upgraded(name)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() != "authorization"}
        echo = {
            "namespace": ns,
            "service": name,
            "method": method,
            "path": r.tail,
            "query": raw_query,
            "headers": headers,
            "body": raw.decode(errors="replace"),
        }
        self.send(200, echo)

    def upgraded(self, service: str) -> None:
        """A WebSocket upgrade through services/proxy (the API server's proxy passes
        upgrades on): answered 101 for the service, then every byte is echoed as it is."""
        key = (self.headers.get("Sec-WebSocket-Key") or "").encode()
        accept = base64.b64encode(hashlib.sha1(key + WEBSOCKET_GUID).digest())
        self.wfile.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\nX-Service: " + service.encode() + b"\r\n\r\n"
        )
        self.wfile.flush()
        self.close_connection = True
        while data := self.rfile.read1(65536):  # what the head's read took in first
            self.wfile.write(data)
            self.wfile.flush()

    # ---- watch
    def watch(self, r: Route, query: dict[str, str]) -> None:
        watch.serve(self, r, query)
