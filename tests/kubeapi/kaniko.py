"""The kaniko build of the fake kubelet: a Job pod whose container has
``--context=s3://BUCKET/KEY`` reads that tarball from S3 with boto3 (path-style, signature
v4, the endpoint and credentials of the container's environment) and "pushes" its
``--destination`` images.

As kaniko does, it refuses flags it does not know and ``COPY`` sources missing from the
context, and with ``--cache=true`` it keeps each ``RUN`` layer in the cache repository
(``--cache-repo``, else ``<destination>/cache``) under a key made of the base image and
every instruction so far, with the content of the files each ``COPY`` copied: a later
build whose instructions and copied files up to a ``RUN`` are the same logs "Using
caching version of cmd" for it instead of running it."""

from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
from typing import Any

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
        if context.startswith("s3://"):
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
            }
    return None


def run_build(
    build: dict[str, Any],
    env: dict[str, str],
    failing: list[tuple[str, str]],
    contexts: dict[str, list[str]],
    layer_cache: dict[str, set[str]] | None = None,
) -> tuple[bool, str]:
    """(succeeded, log) of one kaniko build; records the context's member names.

    ``layer_cache``: cache repository -> keys of the RUN layers pushed there.
    """
    if build.get("unknown_flags"):
        return False, f"Error: unknown flag: {build['unknown_flags'][0]}"
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
