"""The kaniko build of the fake kubelet: a Job pod whose container has
``--context=s3://BUCKET/KEY`` reads that tarball from S3 with boto3 (path-style, signature
v4, the endpoint and credentials of the container's environment); one with
``--context=tar:///PATH`` reads the tarball its init container fetched there (the double
runs that ``curl ... --output PATH URL`` itself: a plain GET, no credentials, so only a
presigned URL works). It "pushes" its ``--destination`` images and ends with the digest
as its termination message (``--digest-file=/dev/termination-log``); a destination on a
registry the test named (``Kubelet.oci_registries``) is pushed for real, through the OCI
distribution API (:func:`push_oci`).

A gitops-sless build pod (labelled with a build tag) is held to the rule that it holds
no storage credential: :func:`violations` names any ``AWS_*`` variable, any variable
whose name says KEY or SECRET, any Secret volume other than the registry push
credential at ``/kaniko/.docker``, and any string the test said must stay out.

As kaniko does, it refuses flags it does not know and ``COPY`` sources missing from the
context, and with ``--cache=true`` it keeps each ``RUN`` layer in the cache repository
(``--cache-repo``, else ``<destination>/cache``) under a key made of the base image and
every instruction so far, with the content of the files each ``COPY`` copied: a later
build whose instructions and copied files up to a ``RUN`` are the same logs "Using
caching version of cmd" for it instead of running it."""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

BUILD_LABEL = "gitops-sless.dev/build-tag"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
PUSH_CREDENTIAL_PATH = "/kaniko/.docker"

# the executor's flags (kaniko v1.23); any other one is "Error: unknown flag"
KNOWN_FLAGS = frozenset(
    {
        "--build-arg",
        "--cache",
        "--cache-copy-layers",
        "--cache-dir",
        "--cache-repo",
        "--cache-run-layers",
        "--cache-ttl",
        "--cleanup",
        "--compressed-caching",
        "--compression",
        "--compression-level",
        "--context",
        "--context-sub-path",
        "--custom-platform",
        "--destination",
        "--digest-file",
        "--dockerfile",
        "--force",
        "--git",
        "--ignore-path",
        "--ignore-var-run",
        "--image-fs-extract-retry",
        "--image-name-tag-with-digest-file",
        "--image-name-with-digest-file",
        "--insecure",
        "--insecure-pull",
        "--insecure-registry",
        "--kaniko-dir",
        "--label",
        "--log-format",
        "--log-timestamp",
        "--no-push",
        "--no-push-cache",
        "--oci-layout-path",
        "--push-retry",
        "--registry-certificate",
        "--registry-client-cert",
        "--registry-map",
        "--registry-mirror",
        "--reproducible",
        "--single-snapshot",
        "--skip-push-permission-check",
        "--skip-tls-verify",
        "--skip-tls-verify-pull",
        "--skip-tls-verify-registry",
        "--skip-unused-stages",
        "--snapshot-mode",
        "--tar-path",
        "--target",
        "--use-new-run",
        "--verbosity",
    }
)

Obj = dict[str, Any]


def build_args(pod: Obj) -> dict[str, Any] | None:
    """The kaniko arguments of a pod whose container has ``--context=s3://...``."""
    for c in pod["spec"].get("containers") or ():
        args = [str(a) for a in (c.get("args") or [])]
        flat: list[tuple[str, str]] = []
        for i, arg in enumerate(args):
            if arg.startswith("--") and "=" in arg:
                flag, value = arg.split("=", 1)
                flat.append((flag, value))
            elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
                flat.append((arg, args[i + 1]))
        context = next((v for f, v in flat if f == "--context"), "")
        if context.startswith(("s3://", "tar://")):
            flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
            cache = next(
                (v for f, v in flat if f == "--cache"), "true" if "--cache" in flags else ""
            )
            return {
                "container": c,
                "context": context,
                "destinations": [v for f, v in flat if f == "--destination"],
                "dockerfile": next((v for f, v in flat if f == "--dockerfile"), "Dockerfile"),
                "unknown_flags": [f for f in flags if f not in KNOWN_FLAGS],
                "cache": cache.lower() == "true",
                "cache_repo": next((v for f, v in flat if f == "--cache-repo"), ""),
                "digest_file": next((v for f, v in flat if f == "--digest-file"), ""),
            }
    return None


def fetch_context(pod: Obj, path: str) -> tuple[bytes | None, int, str]:
    """Run the init container that writes ``path``: (data, exit code, log)."""
    for c in pod["spec"].get("initContainers") or ():
        words = [str(w) for w in (c.get("command") or []) + (c.get("args") or [])]
        if path not in words:
            continue
        urls = [w for w in words if w.startswith(("http://", "https://"))]
        if not words or words[0] != "curl" or len(urls) != 1:
            return None, 2, f"fetch: expected curl with one URL, got {words!r}"
        try:
            with urllib.request.urlopen(urls[0], timeout=10) as answer:
                return answer.read(), 0, ""
        except urllib.error.HTTPError as exc:
            return None, 22, f"curl: (22) The requested URL returned error: {exc.code}"
        except OSError as exc:
            return None, 7, f"curl: (7) Failed to connect: {exc}"
    return None, 1, f"error resolving source context: no init container writes {path}"


def context_key(pod: Obj) -> str:
    """The bucket key a presigned URL of the pod's init container reads (path-style)."""
    for c in pod["spec"].get("initContainers") or ():
        for word in (c.get("command") or []) + (c.get("args") or []):
            if str(word).startswith(("http://", "https://")):
                path = urllib.parse.urlsplit(str(word)).path.lstrip("/")
                return urllib.parse.unquote(path.partition("/")[2])
    return ""


def violations(pod: Obj, keep_out: set[str]) -> list[str]:
    """Why a gitops-sless build pod breaks the no-storage-credential rule (empty: it does not)."""
    found = []
    spec = pod["spec"]
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    for c in containers:
        for env in c.get("env") or ():
            name = str(env.get("name", ""))
            if name.startswith("AWS_") or "KEY" in name.upper() or "SECRET" in name.upper():
                found.append(f"container {c['name']}: env {name}")
        for source in c.get("envFrom") or ():
            found.append(f"container {c['name']}: envFrom {json.dumps(source, sort_keys=True)}")
    credential_volumes = {
        m["name"]
        for c in containers
        for m in c.get("volumeMounts") or ()
        if m.get("mountPath") == PUSH_CREDENTIAL_PATH
    }
    for volume in spec.get("volumes") or ():
        if "secret" in volume and volume["name"] not in credential_volumes:
            found.append(f"volume {volume['name']}: Secret {volume['secret'].get('secretName')}")
    text = json.dumps(pod)
    found.extend(f"the pod holds {s[:4]}..." for s in keep_out if s and s in text)
    return found


def image_digest(data: bytes, destination: str) -> str:
    """What the fake registry calls the image a build of ``data`` pushes to ``destination``."""
    repo = destination.rsplit(":", 1)[0] if ":" in destination.rsplit("/", 1)[-1] else destination
    return "sha256:" + hashlib.sha256(repo.encode() + b"\0" + data).hexdigest()


def push_oci(registry_url: str, destination: str, data: bytes) -> str:
    """Push an image of ``data`` (one layer) as ``destination`` to a real registry at
    ``registry_url`` through the OCI distribution API, as kaniko does; its digest."""
    host_path, _, tag = destination.rpartition(":")
    repository = host_path.partition("/")[2]
    config = json.dumps(
        {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}
    ).encode()
    blobs = [_push_blob(registry_url, repository, blob) for blob in (config, data)]
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, **blobs[0]},
            "layers": [{"mediaType": OCI_LAYER, **blobs[1]}],
        }
    ).encode()
    request = urllib.request.Request(
        f"{registry_url}/v2/{repository}/manifests/{tag}",
        data=manifest,
        method="PUT",
        headers={"Content-Type": OCI_MANIFEST},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(answer.headers["Docker-Content-Digest"])


def _push_blob(registry_url: str, repository: str, blob: bytes) -> dict[str, Any]:
    """POST an upload, PUT the blob with its digest (monolithic upload)."""
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    start = urllib.request.Request(
        f"{registry_url}/v2/{repository}/blobs/uploads/", data=b"", method="POST"
    )
    with urllib.request.urlopen(start, timeout=10) as answer:
        location = urllib.parse.urljoin(registry_url, answer.headers["Location"])
    joiner = "&" if "?" in location else "?"
    put = urllib.request.Request(
        f"{location}{joiner}digest={urllib.parse.quote(digest)}",
        data=blob,
        method="PUT",
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(put, timeout=10):
        pass
    return {"digest": digest, "size": len(blob)}


def run_build(
    build: dict[str, Any],
    env: dict[str, str],
    failing: list[tuple[str, str]],
    contexts: dict[str, list[str]],
    layer_cache: dict[str, set[str]] | None = None,
    fetched: tuple[str, bytes] | None = None,
) -> tuple[bool, str]:
    """(succeeded, log) of one kaniko build; records the context's member names.

    ``layer_cache``: cache repository -> keys of the RUN layers pushed there.
    ``fetched``: (key, data) of a ``tar://`` context its init container fetched.
    """
    if build.get("unknown_flags"):
        return False, f"Error: unknown flag: {build['unknown_flags'][0]}"
    if fetched is not None:
        return _build_from(build, fetched[0], fetched[1], failing, contexts, layer_cache)
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    context = build["context"]
    bucket, _, key = context[len("s3://") :].partition("/")
    try:
        client = boto3.client(
            "s3",
            endpoint_url=env.get("S3_ENDPOINT") or None,
            region_name=env.get("AWS_REGION") or "us-east-1",
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 2},
                connect_timeout=5,
                read_timeout=30,
            ),
        )
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "Error")
        return False, f"error resolving source context: {code}: {context}"
    except BotoCoreError as exc:
        return False, f"error resolving source context: {exc}"
    return _build_from(build, key, data, failing, contexts, layer_cache)


def _build_from(
    build: dict[str, Any],
    key: str,
    data: bytes,
    failing: list[tuple[str, str]],
    contexts: dict[str, list[str]],
    layer_cache: dict[str, set[str]] | None,
) -> tuple[bool, str]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            names = sorted(
                {m.name[2:] if m.name.startswith("./") else m.name for m in members} - {".", ""}
            )
            dockerfile = None
            wanted = build["dockerfile"].removeprefix("./")
            digests: dict[str, str] = {}
            for m in members:
                name = m.name.removeprefix("./")
                data = (tar.extractfile(m) or io.BytesIO()).read() if m.isfile() else b""
                digests[name] = hashlib.sha256(m.linkname.encode() + data).hexdigest()
                if name == wanted and m.isfile():
                    dockerfile = data.decode(errors="replace")
    except (tarfile.TarError, OSError, EOFError) as exc:
        return False, f"error: unpacking build context: {exc}"
    contexts[key] = names
    if dockerfile is None:
        return False, "error: Dockerfile not found in build context"
    for dest in build["destinations"]:
        for substring, log in failing:
            if substring in dest:
                return False, log
    instructions = _instructions(dockerfile)
    missing = _missing_copy_source(instructions, set(names))
    if missing is not None:
        where = f"/kaniko/buildcontext/{missing}"
        return False, (
            "error building image: error building stage: failed to get files used from "
            f"context: failed to get fileinfo for {where}: lstat {where}: no such file or directory"
        )
    base = next((i.split()[1] for i in instructions if i.upper().startswith("FROM ")), "scratch")
    lines = [
        f"INFO[0000] Retrieving image manifest {base}",
        "INFO[0000] Built cross stage deps: map[]",
        "INFO[0000] Executing 0 build triggers",
    ]
    if build.get("cache") and layer_cache is not None:
        repo = build.get("cache_repo") or _inferred_cache_repo(build["destinations"])
        lines += _cached_runs(instructions, digests, layer_cache.setdefault(repo, set()), repo)
    lines.append("INFO[0001] Taking snapshot of full filesystem...")
    for dest in build["destinations"]:
        lines.append(f"INFO[0001] Pushing image to {dest}")
        lines.append(f"INFO[0001] Pushed {dest}")
    return True, "\n".join(lines) + "\n"


def _instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out: list[str] = []
    current = ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append((current + line).strip())
        current = ""
    if current:
        out.append(current.strip())
    return out


def _copy_sources(instruction: str) -> list[str] | None:
    """The context paths a COPY/ADD reads; None for other instructions or ``--from``."""
    if instruction.split(None, 1)[0].upper() not in ("COPY", "ADD"):
        return None
    words = shlex.split(instruction)
    flags = [w for w in words[1:] if w.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        return None
    paths = [w for w in words[1:] if not w.startswith("--")]
    return [p.removeprefix("./").rstrip("/") for p in paths[:-1]]


def _missing_copy_source(instructions: list[str], names: set[str]) -> str | None:
    # a folder exists once a member lies below it, listed itself or not
    names = names | {n.rsplit("/", i)[0] for n in names for i in range(1, n.count("/") + 1)}
    for instruction in instructions:
        for source in _copy_sources(instruction) or []:
            if source not in ("", ".") and source not in names:
                return source
    return None


def _inferred_cache_repo(destinations: list[str]) -> str:
    repo = destinations[0].rsplit(":", 1)[0] if destinations else "cache"
    return f"{repo}/cache"


def _cached_runs(
    instructions: list[str], digests: dict[str, str], cached: set[str], repo: str
) -> list[str]:
    """kaniko's RUN layer cache: the log lines, and the layers pushed into ``cached``."""
    composite = hashlib.sha256()
    lines = []
    for instruction in instructions:
        composite.update(instruction.encode() + b"\0")
        for source in _copy_sources(instruction) or []:
            for name in sorted(digests):
                if source in ("", ".") or name == source or name.startswith(source + "/"):
                    composite.update(f"{name}\0{digests[name]}\0".encode())
        if not instruction.upper().startswith("RUN "):
            continue
        key = composite.copy().hexdigest()
        lines.append(f"INFO[0001] Checking for cached layer {repo}:{key}...")
        if key in cached:
            lines.append(f"INFO[0001] Using caching version of cmd: {instruction}")
        else:
            lines.append(f"INFO[0001] No cached layer found for cmd {instruction}")
            lines.append(f"INFO[0001] Pushing layer {repo}:{key} to cache now")
            cached.add(key)
    return lines
