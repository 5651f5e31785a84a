"""Run the fake API server as its own process (for benchmarks):

    python -m tests.kubeapi --port 0 --kubeconfig PATH [--token T] [--tls] [--crd FILE ...]
        [--preload IMAGE ...]

prints ``listening http://127.0.0.1:PORT`` on one line and serves until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .fake import FakeKube


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kubeapi", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default="test-token")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for the server here")
    parser.add_argument("--namespace", default="default", help="the kubeconfig's namespace")
    parser.add_argument(
        "--tls", action="store_true", help="serve HTTPS with a CA of its own (for kubectl)"
    )
    parser.add_argument("--crd", nargs="*", default=[], help="CRD files to install at start")
    parser.add_argument("--preload", nargs="*", default=[], help="images that pull without a build")
    args = parser.parse_args(argv)
    kube = FakeKube(token=args.token, host=args.host, port=args.port, tls=args.tls)
    kube.preloaded_images = set(args.preload)
    for crd in args.crd:
        kube.install_crd(Path(crd))
    kube.start()
    if args.kubeconfig:
        kube.write_kubeconfig(args.kubeconfig, namespace=args.namespace)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"listening {kube.url}", flush=True)
    while not done.wait(0.5):
        pass
    kube.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
