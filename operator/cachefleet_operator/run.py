"""``cachefleet operator``: run the kopf operator (CLI, metrics and liveness server).

Logs in with ``--kubeconfig FILE``, else in a pod with its service account,
else with ``$KUBECONFIG`` / ``~/.kube/config`` (see :mod:`login`); it exits
with the reason when none of them works. It watches the given namespaces
(``--namespace``, repeatable) or all of them (``--all-namespaces``), and with
``--peering NAME`` takes part in kopf peering so that only one of several
replicas is active. Its own Prometheus metrics are served on
``--metrics-port`` at ``/metrics``, beside the ``/healthz`` liveness
endpoint. Every flag also has an environment form, ``CACHEFLEET_<FLAG>``
(:mod:`cachefleet_common.flags`; ``CACHEFLEET_NAMESPACE`` comma-separated).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cachefleet_common.flags import Flags
from cachefleet_operator import heap, login, webhook
from cachefleet_operator.login import DEFAULT_SERVICE_ACCOUNT_DIR
from cachefleet_operator.metrics import OperatorMetrics

#: Default port of /metrics and /healthz (not the sidecar's 8080/8081: the operator
#: may run beside a sidecar on one host or in one pod network namespace in tests).
DEFAULT_METRICS_PORT = 9180
#: Default bind address of /metrics and /healthz (all interfaces: Prometheus and the
#: kubelet reach the pod from outside).
DEFAULT_METRICS_HOST = "0.0.0.0"


def build_flags(environ: Mapping[str, str] | None = None) -> Flags:
    """The operator's flags, each also ``CACHEFLEET_<FLAG>`` (``--namespace``: comma-separated)."""
    flags = Flags("cachefleet operator", "Run the cachefleet kopf operator.", environ=environ)
    flags.add(
        "kubeconfig",
        "kubeconfig file (default: in-cluster service account, then $KUBECONFIG, "
        "then ~/.kube/config)",
    )
    flags.add(
        "service-account-dir",
        "where the pod's service-account token and ca.crt are mounted",
        default=DEFAULT_SERVICE_ACCOUNT_DIR,
    )
    flags.add("namespace", "namespace to watch (repeatable)", short="-n", repeat=True)
    flags.add("all-namespaces", "watch every namespace", short="-A", is_switch=True)
    flags.add("peering", "kopf peering name (HA: one active)", metavar="NAME")
    flags.add("metrics-host", "bind address of /metrics and /healthz", default=DEFAULT_METRICS_HOST)
    flags.add(
        "metrics-port",
        f"port of /metrics and /healthz (default {DEFAULT_METRICS_PORT})",
        default=DEFAULT_METRICS_PORT,
        parse=int,
    )
    flags.add("verbose", "debug logging", short="-v", is_switch=True)
    webhook.add_flags(flags)
    return flags


def parse_args(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """The parsed flags; exactly one of --namespace and --all-namespaces (exit 2 otherwise)."""
    flags = build_flags(environ)
    args = flags.parse(argv)
    if args.all_namespaces and args.namespace:
        flags.error("argument --all-namespaces/-A: not allowed with argument --namespace/-n")
    if not args.all_namespaces and not args.namespace:
        flags.error("one of the arguments --namespace/-n --all-namespaces/-A is required")
    return args


def metrics_app(metrics: OperatorMetrics) -> web.Application:
    """``/metrics`` (Prometheus text) and ``/healthz`` (200 while the event loop runs)."""

    async def serve_metrics(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(args: argparse.Namespace, stop_flag: threading.Event | None = None) -> None:
    import kopf

    import cachefleet_operator.handlers  # noqa: F401  (registers the handlers)
    from cachefleet_operator.k8s_secrets import KubernetesSecretReader
    from cachefleet_operator.reconcile import Reconciler

    login.install(login.CredentialSource(args.kubeconfig, args.service_account_dir))
    metrics = OperatorMetrics()
    reconciler = Reconciler(secrets=KubernetesSecretReader(), metrics=metrics)

    runner = web.AppRunner(metrics_app(metrics))
    await runner.setup()
    site = web.TCPSite(runner, args.metrics_host, args.metrics_port)
    await site.start()
    memo = kopf.Memo(reconciler=reconciler)
    if getattr(args, "webhook_port", None) is not None:
        webhook.register()
        memo["webhook"] = webhook.setup_from_args(args, webhook.KubernetesCacheReader())
    kwargs: dict[str, Any] = {
        "memo": memo,
        "standalone": args.peering is None,
        "stop_flag": stop_flag,
    }
    if args.peering is not None:
        kwargs["peering_name"] = args.peering
    if args.all_namespaces:
        kwargs["clusterwide"] = True
    else:
        kwargs["namespaces"] = args.namespace
    try:
        await kopf.operator(**kwargs)
    finally:
        await runner.cleanup()


class _RecordedIsNoError(logging.Filter):
    """An invalidation's planned step (intended epoch recorded, run again) is not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        from cachefleet_operator.invalidation import RECORDED_MARK

        if record.levelno >= logging.ERROR and RECORDED_MARK in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    objects = logging.getLogger("kopf.objects")
    objects.addFilter(_RecordedIsNoError())
    if not args.verbose:
        # kopf logs every handler and timer run at INFO ("Timer 'rebalance' succeeded"
        # each second per object); outcomes worth reading are Events and WARNINGs
        objects.setLevel(logging.WARNING)
    # the rebalances' numpy temporaries reuse freed pages instead of faulting in new ones
    heap.keep_freed_memory()
    try:
        asyncio.run(serve(args))
    except login.CredentialsUnavailable as exc:
        print(f"cachefleet operator: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
