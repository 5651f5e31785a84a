"""Request bodies read as they come, through ``/fn/`` (issue 30, item 3): a real
``gitops-sless serve`` on the local backend, the runtimes in the sandbox with their
memory limit. An upload several times the function's memory flows through to a handler
that reads it piece by piece; ``maxBodyBytes`` stops one that is too large with a 413
before more than the limit has been passed on."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import pytest

from .test_serve import git_daemon, git_root, setup  # noqa: F401

PYTHON = """\
import hashlib


def main(event, context):
    digest, total = hashlib.sha256(), 0
    try:
        for chunk in event["_stream"]:
            digest.update(chunk)
            total += len(chunk)
    finally:
        print(f"read {total} bytes", flush=True)
    return {"bytes": total, "sha256": digest.hexdigest()}
"""
NODE = """\
const crypto = require('crypto');

exports.main = async (event) => {
  const digest = crypto.createHash('sha256');
  let total = 0;
  try {
    for await (const chunk of event._stream) {
      digest.update(chunk);
      total += chunk.length;
    }
  } finally {
    console.log(`read ${total} bytes`);
  }
  return { bytes: total, sha256: digest.digest('hex') };
};
"""
CODE = {"python3.11": ("handler.py", PYTHON), "nodejs20": ("handler.js", NODE)}
MIB = 1 << 20


def upload(runtime: str, limit: int = 512 * MIB) -> dict[str, str]:
    name, code = CODE[runtime]
    manifest = (
        "functions:\n"
        "  - name: upload\n"
        f"    runtime: {runtime}\n"
        "    entrypoint: handler.main\n"
        "    memoryMB: 128\n"
        "    stream: {request: true}\n"
        f"    maxBodyBytes: {limit}\n"  # past the proxy's 1 MiB: a streamed body may
        "    triggers: [{type: http}]\n"
    )
    return {"upload/sless.yaml": manifest, f"upload/{name}": code}


def pieces(total: int, size: int = 256 * 1024) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield bytes([start // size % 251]) * min(size, total - start)


@pytest.mark.parametrize("runtime", sorted(CODE))
def test_an_upload_larger_than_the_functions_memory_flows_through(setup, runtime):  # noqa: F811
    setup.push(upload(runtime))
    served = setup.serve()
    total = 320 * MIB  # the function has 128 MiB: read whole, it would be OOM-killed
    digest = hashlib.sha256()
    for piece in pieces(total):
        digest.update(piece)
    reply = served.client.post("/fn/prod/upload/", content=pieces(total), timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"bytes": total, "sha256": digest.hexdigest()}


def test_max_body_bytes_stops_a_streamed_upload_before_the_limit_is_passed_on(setup):  # noqa: F811
    setup.push(upload("python3.11", limit=2 * MIB))
    served = setup.serve()
    reply = served.client.post("/fn/prod/upload/", content=pieces(8 * MIB, 64 * 1024), timeout=60)
    assert reply.status_code == 413, reply.text
    assert f"larger than {2 * MIB} bytes" in reply.json()["error"]
    log = served.state_dir / "logs" / "prod" / "upload.log"
    read = served.wait(lambda: re.search(r"read (\d+) bytes", log.read_text()), "its count")
    assert int(read.group(1)) <= 2 * MIB  # what reached the function: never past the limit
