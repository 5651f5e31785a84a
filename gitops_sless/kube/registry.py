"""An image registry, as garbage collection uses it: the OCI distribution API, three calls.

``GET /v2/<name>/tags/list`` (every tag, page by page), ``HEAD /v2/<name>/manifests/<ref>``
(the digest a tag names now) and ``DELETE /v2/<name>/manifests/<digest>``. A registry
refuses deletion unless its operator enabled it (distribution's ``storage.delete``):
that answer is a :class:`RegistryError` saying so.

Credentials come from a docker config (the push Secret's ``.dockerconfigjson``): sent
as Basic, or exchanged for a Bearer token when the registry answers with a token
challenge (Docker Hub, GHCR, Harbor). Plain HTTP is used where kaniko's library
(go-containerregistry) uses it: localhost, loopback and private addresses.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..errors import PermanentError, TransientError

__all__ = [
    "MANIFEST_TYPES",
    "Image",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "credentials_from_docker_config",
    "split_repository",
]

TIMEOUT_SEC = 15.0
PAGE = 1000
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
_NEXT = re.compile(r"<([^>]+)>")


class RegistryError(PermanentError):
    """The registry refuses (credentials, deletion disabled, a bad name)."""


class RegistryUnavailable(TransientError):
    """The registry cannot be reached now, or answered 5xx / 429."""


@dataclass(frozen=True)
class Image:
    repository: str  # e.g. sless/functions
    tag: str
    digest: str
    size: int  # the manifest's bytes plus the config and layers it names


def split_repository(ref: str) -> tuple[str, str]:
    """``host[:port]/path`` -> (host, path), as image references read."""
    host, _, path = ref.partition("/")
    return host, path


def credentials_from_docker_config(config: Mapping[str, Any], host: str) -> tuple[str, str] | None:
    """(username, password) for ``host`` from a docker ``config.json``, if it has any."""
    auths = config.get("auths") or {}
    for key in (host, f"https://{host}", f"http://{host}", f"https://{host}/v1/"):
        entry = auths.get(key)
        if not entry:
            continue
        if entry.get("username"):
            return str(entry["username"]), str(entry.get("password") or "")
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            return user, password
    return None


def scheme_for(host: str) -> str:
    """http for localhost, loopback and private addresses (as go-containerregistry), else https."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]")
    if name == "localhost" or name.endswith(".local"):
        return "http"
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return "https"
    return "http" if address.is_loopback or address.is_private else "https"


@dataclass
class Registry:
    """One registry host; ``credentials``: (username, password), or None for anonymous."""

    host: str
    credentials: tuple[str, str] | None = field(default=None, repr=False)
    base_url: str | None = None  # None: from the host (see scheme_for)
    transport: httpx.BaseTransport | None = None
    _tokens: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.base_url = self.base_url or f"{scheme_for(self.host)}://{self.host}"
        self._http = httpx.Client(timeout=TIMEOUT_SEC, transport=self.transport)

    def close(self) -> None:
        self._http.close()

    # --- the three calls -------------------------------------------------------------

    def tags(self, repository: str) -> list[str]:
        """Every tag of ``repository`` ([] when the repository does not exist)."""
        found: list[str] = []
        url: str | None = f"/v2/{repository}/tags/list?n={PAGE}"
        while url:
            answer = self._call("GET", url, repository, missing_ok=True)
            if answer is None:
                return found
            found += (answer.json() or {}).get("tags") or []
            url = _next_page(answer.headers.get("Link", ""))
        return found

    def digest(self, repository: str, reference: str) -> str | None:
        """The digest ``reference`` (a tag or digest) names, or None when it names nothing."""
        answer = self._call(
            "HEAD", f"/v2/{repository}/manifests/{reference}", repository, missing_ok=True
        )
        if answer is None:
            return None
        return answer.headers.get("Docker-Content-Digest") or None

    def image(self, repository: str, tag: str) -> Image | None:
        """The image ``tag`` names, with its size (one GET of its manifest), or None."""
        path = f"/v2/{repository}/manifests/{tag}"
        answer = self._call("GET", path, repository, missing_ok=True)
        if answer is None:
            return None
        digest = answer.headers.get("Docker-Content-Digest") or ""
        return Image(repository, tag, digest, len(answer.content) + _blob_bytes(answer.content))

    def delete(self, repository: str, digest: str) -> bool:
        """Delete the manifest ``digest`` (and with it every tag naming it); False: gone already."""
        path = f"/v2/{repository}/manifests/{digest}"
        answer = self._call("DELETE", path, repository, missing_ok=True, delete=True)
        return answer is not None

    # --- transport -------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        repository: str,
        *,
        missing_ok: bool = False,
        delete: bool = False,
    ) -> httpx.Response | None:
        answer = self._send(method, path, repository, delete)
        if answer.status_code == 401 and self.credentials is not None:
            self._authenticate(answer, repository, delete)
            answer = self._send(method, path, repository, delete)
        if answer.status_code == 404 and missing_ok:
            return None
        if answer.is_success:
            return answer
        raise self._error(method, path, answer)

    def _send(self, method: str, path: str, repository: str, delete: bool) -> httpx.Response:
        headers = {"Accept": ", ".join(MANIFEST_TYPES)}
        token = self._tokens.get(_scope(repository, delete))
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif self.credentials is not None and "basic" in self._tokens:
            headers["Authorization"] = _basic(self.credentials)
        try:
            return self._http.request(method, f"{self.base_url}{path}", headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"registry {self.host}: {method} {path}: {exc}") from exc

    def _authenticate(self, answer: httpx.Response, repository: str, delete: bool) -> None:
        """Answer a challenge: Basic as it is, Bearer by asking its realm for a token."""
        assert self.credentials is not None
        challenge = answer.headers.get("WWW-Authenticate", "")
        if not challenge.lower().startswith("bearer"):
            self._tokens["basic"] = "yes"
            return
        params = dict(_CHALLENGE.findall(challenge))
        query = {"scope": _scope(repository, delete)}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": _basic(self.credentials)}
        try:
            reply = self._http.get(params.get("realm", ""), params=query, headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"registry {self.host}: token: {exc}") from exc
        if not reply.is_success:
            raise self._error("GET", "token", reply)
        body = reply.json()
        self._tokens[_scope(repository, delete)] = body.get("token") or body.get("access_token")

    def _error(
        self, method: str, path: str, answer: httpx.Response
    ) -> RegistryError | RegistryUnavailable:
        code = answer.status_code
        detail = _error_code(answer)
        line = f"registry {self.host}: {method} {path}: HTTP {code}" + (
            f" {detail}" if detail else ""
        )
        if code == 405 and method == "DELETE":
            line += " (deletion is disabled: the registry needs storage.delete.enabled)"
        if code >= 500 or code == 429:
            return RegistryUnavailable(line)
        return RegistryError(line)


def _scope(repository: str, delete: bool) -> str:
    return f"repository:{repository}:" + ("delete,pull" if delete else "pull")


def _basic(credentials: tuple[str, str]) -> str:
    return "Basic " + base64.b64encode(":".join(credentials).encode()).decode()


def _next_page(link: str) -> str | None:
    found = _NEXT.search(link) if 'rel="next"' in link else None
    return found.group(1) if found else None


def _error_code(answer: httpx.Response) -> str:
    try:
        errors = answer.json().get("errors") or []
    except (ValueError, AttributeError):
        return ""
    return ", ".join(str(e.get("code")) for e in errors if isinstance(e, dict))


def _blob_bytes(manifest: bytes) -> int:
    """The config and layer sizes a manifest names (0 for an index: its images count apart)."""
    try:
        parsed = json.loads(manifest)
    except ValueError:
        return 0
    return sum(int(b.get("size") or 0) for b in _blobs(parsed))


def _blobs(parsed: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    if isinstance(parsed.get("config"), dict):
        yield parsed["config"]
    for layer in parsed.get("layers") or []:
        if isinstance(layer, dict):
            yield layer
