"""The kaniko build of the fake kubelet: a Job pod whose container has
``--context=s3://BUCKET/KEY`` reads that tarball from S3 with boto3 (path-style, signature
v4, the endpoint and credentials of the container's environment) and "pushes" its
``--destination`` images."""

from __future__ import annotations

import io
import tarfile
from typing import Any

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
            return {
                "container": c,
                "context": context,
                "destinations": [v for f, v in flat if f == "--destination"],
                "dockerfile": next((v for f, v in flat if f == "--dockerfile"), "Dockerfile"),
            }
    return None


def run_build(
    build: dict[str, Any],
    env: dict[str, str],
    failing: list[tuple[str, str]],
    contexts: dict[str, list[str]],
) -> tuple[bool, str]:
    """(succeeded, log) of one kaniko build; records the context's member names."""
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
            for m in members:
                if m.name.removeprefix("./") == wanted and m.isfile():
                    dockerfile = (
                        (tar.extractfile(m) or io.BytesIO()).read().decode(errors="replace")
                    )
    except (tarfile.TarError, OSError, EOFError) as exc:
        return False, f"error: unpacking build context: {exc}"
    contexts[key] = names
    if dockerfile is None:
        return False, "error: Dockerfile not found in build context"
    for dest in build["destinations"]:
        for substring, log in failing:
            if substring in dest:
                return False, log
    base = next(
        (
            ln.split()[1]
            for ln in dockerfile.splitlines()
            if ln.strip().upper().startswith("FROM ") and len(ln.split()) > 1
        ),
        "scratch",
    )
    lines = [
        f"INFO[0000] Retrieving image manifest {base}",
        "INFO[0000] Built cross stage deps: map[]",
        "INFO[0000] Executing 0 build triggers",
        "INFO[0001] Taking snapshot of full filesystem...",
    ]
    for dest in build["destinations"]:
        lines.append(f"INFO[0001] Pushing image to {dest}")
        lines.append(f"INFO[0001] Pushed {dest}")
    return True, "\n".join(lines) + "\n"
