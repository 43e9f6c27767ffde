"""The sidecar-injection webhook: kopf's admission server plus one mutating handler.

:func:`register` adds ``inject-sidecar``, a ``@kopf.on.mutate`` handler for
Pods labelled ``cachefleet.io/cache``, and a startup hook that starts the
admission server; ``run.py`` calls it only when ``--webhook-port`` is given
(importing this module registers nothing). The handler reads the InferenceCache
named by the label (Kubernetes API, in a thread, bounded by
:data:`CACHE_READ_TIMEOUT_S`) and applies :func:`injection.injection_patch`.
A cache that cannot be read does not block the Pod: the sidecar is injected
with what the label says and runs L1-only, and the API server shows a warning.

TLS, two ways (the chart picks one):

* ``--webhook-certfile/--webhook-keyfile`` (cert-manager mounts them): the
  chart's own MutatingWebhookConfiguration points at the Service, and
  cert-manager's CA injector fills its ``caBundle``;
* neither: the operator generates a self-signed certificate for the
  Service's DNS names at startup (:func:`write_self_signed`) and, with
  ``--webhook-managed NAME``, kopf writes the MutatingWebhookConfiguration
  itself (with the CA bundle and a ``service`` client config, see
  :class:`ServiceWebhookServer`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import kopf
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cachefleet_common.flags import Flags
from cachefleet_operator import injection
from cachefleet_operator.api import GROUP, VERSION

#: Lifetime of the self-signed webhook certificate (regenerated at every start).
SELF_SIGNED_DAYS = 365
#: Handler id; also the last component of the webhook's URL path (``/inject-sidecar``).
WEBHOOK_ID = "inject-sidecar"
#: Timeout of the InferenceCache read during admission, seconds (the API server waits <= 10 s).
CACHE_READ_TIMEOUT_S = 3.0
#: Default port of the webhook Service.
DEFAULT_SERVICE_PORT = 443

#: Reads ``namespace/name`` of an InferenceCache; None when it does not exist.
CacheReader = Callable[[str, str], Awaitable[dict[str, Any] | None]]


class KubernetesCacheReader:
    """Reads an InferenceCache with the ``kubernetes`` client in a worker thread."""

    def __init__(self, api: Any | None = None, timeout_s: float = CACHE_READ_TIMEOUT_S) -> None:
        if api is None:
            from kubernetes import client

            api = client.CustomObjectsApi()
        self._api = api
        self._timeout_s = timeout_s

    def _read(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            obj = self._api.get_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                "inferencecaches",
                name,
                _request_timeout=self._timeout_s,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return obj if isinstance(obj, dict) else None

    async def __call__(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.wait_for(
            asyncio.to_thread(self._read, namespace, name), self._timeout_s
        )


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names a Service is reached by inside the cluster."""
    host = f"{service}.{namespace}.svc"
    return [service, f"{service}.{namespace}", host, f"{host}.cluster.local"]


def write_self_signed(names: list[str], directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for ``names``; returns (cert, key) paths.

    kopf can make one itself, but through certbuilder/oscrypto, which fail to
    load on OpenSSL 3; ``cryptography`` is the maintained way.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


class ServiceWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS server, announced to the API server as a Service, not a URL.

    The API server reaches webhooks through the Service proxy; a ``url``
    client config with a ``.svc`` name would need cluster DNS on the API
    server, which many clusters lack.
    """

    def __init__(self, *, service: str, namespace: str, service_port: int, **kw: Any) -> None:
        sans = service_names(service, namespace)
        super().__init__(host=sans[2], extra_sans=sans, **kw)
        self.service = service
        self.namespace = namespace
        self.service_port = service_port

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async for config in super().__call__(fn):
            out = kopf.WebhookClientConfig(
                service={
                    "name": self.service,
                    "namespace": self.namespace,
                    "port": self.service_port,
                    "path": self.path or "",
                }
            )
            if config.get("caBundle"):
                out["caBundle"] = config["caBundle"]
            yield out


@dataclass
class WebhookSetup:
    """Everything the admission side needs, kept in the operator's memo."""

    sidecar: injection.SidecarSettings
    server: Any
    managed: str | None
    reader: CacheReader | None


def add_flags(flags: Flags) -> None:
    """The ``cachefleet operator`` flags of the injection webhook."""
    group = "sidecar injection webhook"
    flags.add(
        "webhook-port",
        "serve the injection webhook on this port (off if unset)",
        parse=int,
        group=group,
    )
    flags.add("webhook-host", "bind address of the webhook", default="0.0.0.0", group=group)
    flags.add(
        "webhook-service",
        "Service that fronts the webhook (for TLS names and the config)",
        group=group,
    )
    flags.add(
        "webhook-service-namespace",
        "namespace of that Service (default $POD_NAMESPACE)",
        default=flags.environ.get("POD_NAMESPACE"),
        group=group,
    )
    flags.add(
        "webhook-service-port",
        f"port of that Service (default {DEFAULT_SERVICE_PORT})",
        default=DEFAULT_SERVICE_PORT,
        parse=int,
        group=group,
    )
    flags.add("webhook-certfile", "TLS certificate (PEM); self-signed if unset", group=group)
    flags.add("webhook-keyfile", "TLS private key (PEM)", group=group)
    flags.add(
        "webhook-managed",
        "let the operator write the MutatingWebhookConfiguration NAME itself",
        metavar="NAME",
        group=group,
    )
    flags.add(
        "sidecar-config",
        "YAML/JSON of the injected sidecar's settings (image, ports, resources)",
        metavar="FILE",
        group=group,
    )


def load_sidecar_settings(path: str | None) -> injection.SidecarSettings:
    """Parse ``--sidecar-config``; a missing file means the defaults and a required image."""
    if path is None:
        raise SystemExit("cachefleet operator: --webhook-port needs --sidecar-config FILE")
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return injection.SidecarSettings.model_validate(data)


def setup_from_args(args: argparse.Namespace, reader: CacheReader | None) -> WebhookSetup:
    """Build the server and settings from the parsed flags (exits on inconsistent flags)."""
    if bool(args.webhook_certfile) != bool(args.webhook_keyfile):
        raise SystemExit("cachefleet operator: give both --webhook-certfile and --webhook-keyfile")
    server_kw: dict[str, Any] = {"addr": args.webhook_host, "port": args.webhook_port}
    if args.webhook_certfile:
        server_kw.update(certfile=args.webhook_certfile, pkeyfile=args.webhook_keyfile)
    else:
        names = [args.webhook_host or "localhost"]
        if args.webhook_service and args.webhook_service_namespace:
            names = service_names(args.webhook_service, args.webhook_service_namespace)
        cert, key = write_self_signed(names, Path(tempfile.mkdtemp(prefix="cachefleet-webhook-")))
        server_kw.update(certfile=str(cert), pkeyfile=str(key), cafile=str(cert))
    server: Any
    if args.webhook_service:
        if not args.webhook_service_namespace:
            raise SystemExit(
                "cachefleet operator: --webhook-service needs --webhook-service-namespace "
                "(or $POD_NAMESPACE)"
            )
        server = ServiceWebhookServer(
            service=args.webhook_service,
            namespace=args.webhook_service_namespace,
            service_port=args.webhook_service_port,
            **server_kw,
        )
    else:
        server = kopf.WebhookServer(**server_kw)
    return WebhookSetup(
        sidecar=load_sidecar_settings(args.sidecar_config),
        server=server,
        managed=args.webhook_managed,
        reader=reader,
    )


def _setup(memo: Any) -> WebhookSetup:
    setup = memo.get("webhook")
    if not isinstance(setup, WebhookSetup):
        raise kopf.PermanentError("operator misconfigured: no webhook setup in memo")
    return setup


async def configure_admission(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Start kopf's admission server (and let it manage the configuration if asked)."""
    setup = _setup(memo)
    settings.admission.server = setup.server
    if setup.managed:
        settings.admission.managed = setup.managed


async def inject_sidecar(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: Any,
    warnings: list[str],
    logger: Any,
    **_: Any,
) -> None:
    """Add the sidecar to a labelled Pod (a no-op for one that already has it)."""
    setup = _setup(memo)
    pod = dict(body)
    name = injection.requested_cache(pod)
    namespace = body.metadata.namespace or ""
    if name is None or injection.already_injected(pod):
        return
    if not namespace:
        raise kopf.AdmissionError("cachefleet: the Pod has no namespace; cannot inject")
    cache: injection.CacheInfo | None = None
    if setup.reader is not None:
        try:
            obj = await setup.reader(namespace, name)
        except Exception as exc:  # the API server may be slow; the Pod must still start
            logger.warning("InferenceCache %s/%s unreadable: %s", namespace, name, exc)
            warnings.append(f"cachefleet: InferenceCache {namespace}/{name} unreadable; L1 only")
        else:
            if obj is None:
                warnings.append(f"cachefleet: no InferenceCache {namespace}/{name}; L1 only")
            else:
                cache = injection.cache_info(obj)
    try:
        ops = injection.injection_patch(pod, namespace, setup.sidecar, cache)
    except injection.InjectionError as exc:
        raise kopf.AdmissionError(str(exc)) from exc
    if ops:
        patch.fns.append(lambda raw: jsonpatch.apply_patch(raw, ops, in_place=True))


def register(registry: Any | None = None) -> None:
    """Register the startup hook and the mutating handler (kopf's default registry if None)."""
    reg = registry if registry is not None else kopf.get_default_registry()
    kopf.on.startup(registry=reg, id="configure-admission")(configure_admission)
    kopf.on.mutate(
        "v1",
        "pods",
        id=WEBHOOK_ID,
        operations=["CREATE"],
        labels={injection.CACHE_LABEL: kopf.PRESENT},
        ignore_failures=True,
        registry=reg,
    )(inject_sidecar)
