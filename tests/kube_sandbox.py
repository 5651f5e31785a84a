"""``scripts/run-kube``: ``serve --backend kubernetes`` against the test API server and real S3.

No cluster can run here, so this starts the test Kubernetes API server
(tests/kubeapi: it validates every object strictly and plays the kubelet, the
controllers and kaniko, but runs no containers) and a real S3 server (SeaweedFS),
writes a kubeconfig, and runs ``gitops-sless serve --backend kubernetes`` on
``sample-repo/`` with the settings a cluster install would use. Calls to
``/fn/...`` go through the API server's service proxy, which answers with an
echo of the request instead of the function.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from gitops_sless.kube.client import KubeClient

from .kubeapi import FakeKube
from .s3server import start_weed

NAMESPACE = "gitops-sless"
PROD = "sless-prod"  # the namespace of the environment `prod`
CRD = "deploy/crd-functions.yaml"  # the Function resources, as `kubectl apply -f deploy/` has it


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="sless-kube-") as scratch:
        # HTTPS: kubectl sends the token only over TLS, and the kubeconfig is for kubectl too
        kube = FakeKube(tls=True).start()
        try:
            kube.install_crd(root / CRD)
            # `kubectl get fn` shows the tracked branch's functions without -n
            kubeconfig = kube.write_kubeconfig(Path(scratch) / "kubeconfig", namespace=PROD)
            client = KubeClient.from_config(str(kubeconfig), calls=None)
            client.create(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
            )
            with start_weed(Path(scratch) / "s3") as s3:
                env = {
                    **os.environ,
                    "KUBECONFIG": str(kubeconfig),
                    "SLESS_NAMESPACE": NAMESPACE,
                    "SLESS_REGISTRY": "registry.sandbox/team",
                    "SLESS_S3_ENDPOINT": s3.endpoint,
                    "SLESS_S3_BUCKET": s3.bucket,
                    "SLESS_S3_REGION": s3.region,
                    "AWS_ACCESS_KEY_ID": s3.access_key,
                    "AWS_SECRET_ACCESS_KEY": s3.secret_key,
                }
                print(
                    f"test API server: {kube.url} (kubeconfig {kubeconfig})\n"
                    f"S3: {s3.endpoint}, bucket {s3.bucket}\n"
                    f"kubectl: export KUBECONFIG={kubeconfig}; kubectl get fn",
                    file=sys.stderr,
                    flush=True,
                )
                command = [
                    sys.executable, "-m", "gitops_sless", "serve", "--backend", "kubernetes",
                    "--repo", "sample-repo", "--state-dir", ".sless-kube-state",
                    "--poll-interval", "2", *argv,
                ]  # fmt: skip
                serve = subprocess.Popen(command, cwd=root, env=env)
                signal.signal(signal.SIGTERM, lambda *_: serve.terminate())
                try:
                    return serve.wait()
                except KeyboardInterrupt:
                    serve.terminate()
                    return serve.wait()
        finally:
            kube.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
