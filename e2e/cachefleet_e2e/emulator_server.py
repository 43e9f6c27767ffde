"""``python -m cachefleet_e2e.emulator_server``: the Kubernetes API emulator as a server.

For trying the operator the way a user runs it, without a cluster: it serves
:class:`cachefleet_e2e.k8s.Emulator` (InferenceCache, CacheInvalidation,
namespaces, Events) on loopback and writes a kubeconfig for it, so that::

    python -m cachefleet_e2e.emulator_server --kubeconfig /tmp/emu.kubeconfig &
    cachefleet operator --kubeconfig /tmp/emu.kubeconfig -n default
    kubectl --kubeconfig /tmp/emu.kubeconfig apply --validate=false -f my-cache.yaml

work. It prints ``ready <url>`` once serving and stops on SIGTERM / Ctrl-C.
The emulator stores and serves objects; it validates nothing (see docs/testing.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from cachefleet_e2e.k8s import run_emulator, write_kubeconfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachefleet_e2e.emulator_server")
    parser.add_argument("--kubeconfig", required=True, help="where to write its kubeconfig")
    parser.add_argument("--token", default="emulator", help="bearer token in the kubeconfig")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with run_emulator() as handle:
        write_kubeconfig(args.kubeconfig, handle.url, args.token)
        print(f"ready {handle.url}", flush=True)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
