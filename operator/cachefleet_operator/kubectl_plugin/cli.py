"""``kubectl cachefleet`` (the executable ``kubectl-cachefleet``): the command line.

Thin: parses flags, calls :mod:`.cluster` for I/O and :mod:`.views` /
:mod:`.explain` for what is printed. ``main(argv)`` returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import yaml

from cachefleet_operator.api import (
    API_VERSION,
    DEFAULT_INVALIDATION_TIMEOUT_S,
    InvalidationPhase,
    SpecError,
    parse_invalidation_spec,
)
from cachefleet_operator.kubectl_plugin import explain, views
from cachefleet_operator.kubectl_plugin.cluster import (
    CACHES,
    INVALIDATIONS,
    Cluster,
    PluginError,
    Unreachable,
    connect,
    label_selector,
    read_sidecars,
)
from cachefleet_sidecar import keys, protocol

PROG = "kubectl cachefleet"
#: Exit statuses (1 is any error talking to the cluster, as kubectl's).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INVALIDATION_FAILED = 3
EXIT_TIMEOUT = 4
#: How often ``invalidate --wait`` reads the object, seconds.
POLL_S = 0.5
#: How long ``invalidate --wait`` waits past the acknowledgement timeout for the
#: operator to write the outcome, seconds.
RESULT_GRACE_S = 15.0
#: Longest acknowledgement timeout (the CRD's bound), seconds.
MAX_TIMEOUT_S = 3600

EXIT_CODES = f"""exit status:
  {EXIT_OK}  success
  {EXIT_ERROR}  error: cluster unreachable, CRDs not installed, object not found, forbidden
  {EXIT_USAGE}  bad flags or arguments
  {EXIT_INVALIDATION_FAILED}  invalidate --wait: the invalidation Failed (lagging pods named)
  {EXIT_TIMEOUT}  invalidate --wait: no outcome in time
"""


class UsageError(PluginError):
    exit_code = EXIT_USAGE


def parse_duration(text: str, flag: str) -> int:
    """``60s``, ``2m``, ``1h`` or plain seconds -> seconds (1 to 3600)."""
    found = re.fullmatch(r"\s*([0-9]+)\s*(s|m|h)?\s*", text)
    if found is None:
        raise UsageError(f"{flag} {text!r}: not a duration (e.g. 60s, 2m, 1h)")
    seconds = int(found.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[found.group(2)]
    if not 1 <= seconds <= MAX_TIMEOUT_S:
        raise UsageError(f"{flag} {text!r}: must be between 1s and {MAX_TIMEOUT_S}s")
    return seconds


# ------------------------------------------------------------------ parser


def _global_flags(parser: argparse.ArgumentParser, outputs: list[str]) -> None:
    """kubectl's connection flags (defaults suppressed so they work before or after the command)."""
    s = argparse.SUPPRESS
    parser.add_argument(
        "--kubeconfig",
        default=s,
        help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)",
    )
    parser.add_argument("--context", default=s, help="kubeconfig context to use")
    parser.add_argument(
        "-n", "--namespace", default=s, help="namespace (default: the context's, else default)"
    )
    if outputs:
        parser.add_argument(
            "-o",
            "--output",
            default=s,
            choices=outputs,
            help=f"output format: {', '.join(outputs)}",
        )


def _para(text: str) -> str:
    return textwrap.fill(text, width=78)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect and operate cachefleet's InferenceCaches.",
        epilog=EXIT_CODES,
        formatter_class=fmt,
    )
    _global_flags(parser, [])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    status = sub.add_parser(
        "status",
        help="per cache: tenants, class, shares, L1/L2 bytes, hit ratio, SLA, lagging sidecars",
        description=_para(
            "Per InferenceCache, from its status as the operator writes it: conditions, quota "
            "generation, SLA attainment, sidecars live / in sync (lagging = live minus in sync), "
            "epochs, the last CacheInvalidation (its lagging pods when it failed), and per tenant "
            "class, share, L1 bytes per pod, L2 bytes, observed hit ratio and SLA. Savings columns "
            "appear when the status carries savings. -o wide adds weight, p95, RPS and the "
            "allocation's reason."
        ),
        epilog=EXIT_CODES,
        formatter_class=fmt,
    )
    status.add_argument(
        "name", nargs="?", help="InferenceCache (default: every one in the namespace)"
    )
    status.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    _global_flags(status, ["wide", "json", "yaml"])

    top = sub.add_parser(
        "top",
        help="per pod: heartbeat, quota generation, epochs acknowledged, policy per tenant",
        description=_para(
            "Per pod of an InferenceCache. Pods, readiness and restarts come from the Kubernetes "
            "API (the cache's spec.selector). Sidecar columns come from the sidecars' heartbeats "
            "and epoch acknowledgements in the cache's Redis (spec.redis: its URL or Secret; "
            "--redis-url overrides it, e.g. through kubectl port-forward): HEARTBEAT is the age of "
            "the last heartbeat, QUOTAS the quota generation the sidecar applied against the "
            "status's quotaGeneration, EPOCHS whether it acknowledged every epoch in the status, "
            "REDIS whether the sidecar itself reaches Redis, POLICIES its L1 policy per tenant. "
            "'?' means that source could not be read (a warning says why)."
        ),
        epilog=EXIT_CODES,
        formatter_class=fmt,
    )
    top.add_argument(
        "name", nargs="?", help="InferenceCache (default: the only one in the namespace)"
    )
    top.add_argument("--redis-url", help="read heartbeats from this Redis instead of spec.redis")
    _global_flags(top, ["wide", "json", "yaml"])

    inv = sub.add_parser(
        "invalidate",
        help="create a CacheInvalidation; --wait follows it to Completed or Failed",
        description=_para(
            "Creates a CacheInvalidation of the InferenceCache NAME. With --wait, follows it like "
            "kubectl rollout status, printing each change, until Completed (exit 0), Failed "
            f"(exit {EXIT_INVALIDATION_FAILED}, lagging pods named) or no outcome within "
            f"--timeout plus {RESULT_GRACE_S:.0f}s for the operator to write it "
            f"(exit {EXIT_TIMEOUT})."
        ),
        epilog=EXIT_CODES,
        formatter_class=fmt,
    )
    inv.add_argument("name", help="InferenceCache")
    inv.add_argument("--scope", required=True, choices=["cache", "tenant", "model"])
    inv.add_argument("--tenant", help="tenant of --scope tenant")
    inv.add_argument(
        "--model", help="model of --scope model (default: the cache's spec.model.name)"
    )
    inv.add_argument("--reason", help="why (shown in the object's Events)")
    inv.add_argument(
        "--timeout",
        default=f"{DEFAULT_INVALIDATION_TIMEOUT_S}s",
        help=(
            "how long every live sidecar has to acknowledge "
            "(spec.timeoutSeconds; default %(default)s)"
        ),
    )
    inv.add_argument("--wait", action="store_true", help="wait for the outcome")
    _global_flags(inv, ["name", "json", "yaml"])

    key = sub.add_parser(
        "explain-key",
        help="the canonical form and digest of a request body; whether two bodies share an entry",
        description=_para(
            "Keys a request body (FILE, or - for stdin) with the sidecar's own code "
            "(cachefleet_sidecar.keys) and prints its canonical form, its xxh3-128 digest (the L1 "
            "index) and SHA-256 (the L2 entry), or why the sidecar would not cache it. With two "
            "files, says whether they share one entry and, if not, where their canonical forms "
            "first differ. The digest also depends on the tenant, the model version and, on a "
            "sidecar with Redis, the invalidation epochs (--epochs, from the cache's status); "
            "whether two bodies share an entry does not."
        ),
        epilog=EXIT_CODES,
        formatter_class=fmt,
    )
    key.add_argument("files", nargs="*", metavar="FILE", help="request body; - or none: stdin")
    key.add_argument(
        "--path", default=explain.DEFAULT_PATH, help="endpoint and query (default %(default)s)"
    )
    key.add_argument(
        "--tenant", default=explain.DEFAULT_TENANT, help="tenant (default %(default)s)"
    )
    key.add_argument("--model-version", default="", help="the sidecar's --model-version")
    key.add_argument(
        "--epochs", help="CACHE,TENANT,MODEL epochs of a sidecar with Redis, e.g. 0,2,1"
    )
    key.add_argument(
        "--collapse-whitespace", action="store_true", help="the tenant's collapseWhitespace"
    )
    key.add_argument(
        "--cache-nondeterministic", action="store_true", help="the tenant's cacheNondeterministic"
    )
    key.add_argument("-o", "--output", choices=["json", "yaml"], help="output format")
    return parser


# ---------------------------------------------------------------- commands


def _dump(doc: Any, fmt: str, out: TextIO) -> None:
    if fmt == "json":
        out.write(json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n")
    else:
        out.write(yaml.safe_dump(json.loads(json.dumps(doc, default=str)), sort_keys=False))


def _cluster(args: argparse.Namespace) -> Cluster:
    target = connect(
        getattr(args, "kubeconfig", None),
        getattr(args, "context", None),
        getattr(args, "namespace", None),
    )
    return Cluster(target)


def cmd_status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    cluster = _cluster(args)
    ns = None if args.all_namespaces else cluster.target.namespace
    if args.name:
        if ns is None:
            raise UsageError("a NAME and --all-namespaces do not go together")
        caches = [cluster.get(CACHES, ns, args.name)]
    else:
        caches = cluster.list_objects(CACHES, ns)
    if not caches:
        where = "any namespace" if ns is None else f"namespace {ns!r}"
        err.write(f"No InferenceCaches found in {where}.\n")
        return EXIT_OK
    invalidations = cluster.list_objects(INVALIDATIONS, ns)
    found = [views.cache_view(c, invalidations) for c in caches]
    output = getattr(args, "output", None)
    if output in ("json", "yaml"):
        _dump(views.status_document(found), output, out)
    else:
        out.write(views.render_status(found, time.time(), wide=output == "wide"))
    return EXIT_OK


def _only_cache(cluster: Cluster, name: str | None) -> dict[str, Any]:
    ns = cluster.target.namespace
    if name:
        return cluster.get(CACHES, ns, name)
    caches = cluster.list_objects(CACHES, ns)
    if len(caches) != 1:
        names = ", ".join(c["metadata"]["name"] for c in caches) or "none"
        raise UsageError(f"name an InferenceCache: namespace {ns!r} has {len(caches)} ({names})")
    return caches[0]


def cmd_top(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    cluster = _cluster(args)
    cache = _only_cache(cluster, args.name)
    ns, name = (
        cache["metadata"].get("namespace") or cluster.target.namespace,
        cache["metadata"]["name"],
    )
    spec, status = cache.get("spec") or {}, cache.get("status") or {}
    selector = label_selector(spec.get("selector") or {})
    sources: dict[str, str] = {}
    pods: list[views.PodInfo] | None = None
    if not selector:
        err.write("warning: spec.selector is empty: pods not listed\n")
    else:
        try:
            pods = [views.pod_info(p) for p in cluster.pods(ns, selector)]
            sources["pods"] = f"Kubernetes API, selector {selector}"
        except PluginError as exc:
            err.write(f"warning: pods not listed: {exc}\n")
    sidecars: list[views.SidecarSeen] | None = None
    try:
        url = args.redis_url or _redis_url(cluster, ns, spec)
        epochs = {str(k): int(v) for k, v in (status.get("epochs") or {}).items()}
        sidecars = read_sidecars(url, protocol.cache_ref(ns, name), epochs)
        sources["sidecars"] = f"heartbeats and acknowledgements in Redis {protocol.redact_url(url)}"
    except PluginError as exc:
        hint = ""
        if isinstance(exc, Unreachable) and not args.redis_url:
            hint = (
                " (from outside the cluster: kubectl port-forward to Redis, then "
                "--redis-url redis://127.0.0.1:PORT)"
            )
        err.write(f"warning: sidecar columns unknown: {exc}{hint}\n")
    rows = views.pod_rows(pods, sidecars, status.get("quotaGeneration"), time.time())
    output = getattr(args, "output", None)
    if output in ("json", "yaml"):
        _dump(views.top_document(ns, name, rows, sources), output, out)
    elif not rows:
        err.write(f"No pods match InferenceCache {ns}/{name} and no sidecar sends heartbeats.\n")
    else:
        out.write(views.render_top(rows, wide=output == "wide"))
    return EXIT_OK


def _redis_url(cluster: Cluster, namespace: str, spec: Mapping[str, Any]) -> str:
    redis = spec.get("redis") or {}
    if redis.get("url"):
        return str(redis["url"])
    ref = redis.get("secretRef") or {}
    if not ref.get("name"):
        raise PluginError("spec.redis names neither a url nor a secretRef")
    return cluster.secret_value(namespace, str(ref["name"]), str(ref.get("key") or "url"))


def invalidation_body(
    cache: Mapping[str, Any],
    scope: str,
    tenant: str | None,
    model: str | None,
    reason: str | None,
    timeout_s: int,
) -> dict[str, Any]:
    """The CacheInvalidation to create, validated with the CRD's own model."""
    name = str(cache["metadata"]["name"])
    raw_scope: dict[str, Any] = {"type": scope.capitalize()}
    if scope == "tenant":
        if not tenant:
            raise UsageError("--scope tenant needs --tenant")
        raw_scope["tenant"] = tenant
    elif tenant:
        raise UsageError(f"--tenant goes with --scope tenant, not --scope {scope}")
    if scope == "model":
        raw_scope["model"] = model or ((cache.get("spec") or {}).get("model") or {}).get("name")
        if not raw_scope["model"]:
            raise UsageError("--scope model needs --model (the cache's spec names no model)")
    elif model:
        raise UsageError(f"--model goes with --scope model, not --scope {scope}")
    spec: dict[str, Any] = {
        "cacheRef": {"name": name},
        "scope": raw_scope,
        "timeoutSeconds": timeout_s,
    }
    if reason:
        spec["reason"] = reason
    try:
        parse_invalidation_spec(spec)
    except SpecError as exc:
        flag = {
            "spec.scope.tenant": "--tenant",
            "spec.scope.model": "--model",
            "spec.reason": "--reason",
        }
        raise UsageError(f"{flag.get(exc.field, exc.field)}: {exc.message}") from exc
    generate = name[:52] + "-" if len(name) > 52 else name + "-"
    return {
        "apiVersion": API_VERSION,
        "kind": "CacheInvalidation",
        "metadata": {"generateName": generate},
        "spec": spec,
    }


def wait_for_outcome(
    read: Callable[[], Mapping[str, Any]],
    wait_s: float,
    progress: TextIO,
    *,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, views.InvalidationView]:
    """Follow a CacheInvalidation until Completed / Failed or ``wait_s`` passes.

    Prints a line whenever what it shows changes. Returns (exit status, last view).
    """
    deadline = clock() + wait_s
    last = ""
    while True:
        view = views.invalidation_view(read())
        line = views.progress_line(view)
        if line != last:
            progress.write(line + "\n")
            progress.flush()
            last = line
        if view.phase == InvalidationPhase.COMPLETED.value:
            return EXIT_OK, view
        if view.phase == InvalidationPhase.FAILED.value:
            return EXIT_INVALIDATION_FAILED, view
        now = clock()
        if now >= deadline:
            return EXIT_TIMEOUT, view
        sleep(min(poll_s, max(0.0, deadline - now)))


def cmd_invalidate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    timeout_s = parse_duration(args.timeout, "--timeout")
    cluster = _cluster(args)
    ns = cluster.target.namespace
    cache = cluster.get(CACHES, ns, args.name)
    body = invalidation_body(cache, args.scope, args.tenant, args.model, args.reason, timeout_s)
    created = cluster.create(INVALIDATIONS, ns, body)
    name = created["metadata"]["name"]
    output = getattr(args, "output", None)
    progress = err if output in ("json", "yaml", "name") else out
    scope = views.scope_text(body["spec"]["scope"])
    if output == "name":
        out.write(f"cacheinvalidation.cachefleet.io/{name}\n")
    else:
        progress.write(
            f"cacheinvalidation.cachefleet.io/{name} created ({scope} of {ns}/{args.name}, "
            f"acknowledgement timeout {timeout_s}s)\n"
        )
    if not args.wait:
        if output in ("json", "yaml"):
            _dump(created, output, out)
        return EXIT_OK
    try:
        code, view = wait_for_outcome(
            lambda: cluster.get(INVALIDATIONS, ns, name),
            timeout_s + RESULT_GRACE_S,
            progress,
        )
    except KeyboardInterrupt:
        err.write(
            f"interrupted: {name} goes on without us (kubectl get cacheinvalidation {name})\n"
        )
        return 130
    if output in ("json", "yaml"):
        _dump(cluster.get(INVALIDATIONS, ns, name), output, out)
    if code == EXIT_OK:
        progress.write(f"invalidation {name} completed\n")
    elif code == EXIT_INVALIDATION_FAILED:
        lagging = ", ".join(view.lagging_pods) or "none named"
        err.write(f"error: invalidation {name} failed: {view.message} (lagging pods: {lagging})\n")
    else:
        err.write(
            f"error: timed out after {timeout_s + RESULT_GRACE_S:.0f}s waiting for {name} "
            f"(phase {view.phase}; is the operator running?)\n"
        )
    return code


def _read_source(path: str, stdin: Any) -> tuple[str, bytes]:
    if path == "-":
        return "(stdin)", stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
    try:
        with open(path, "rb") as f:
            return path, f.read()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from exc


def cmd_explain_key(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: Any) -> int:
    files = list(args.files) or ["-"]
    if len(files) > 2:
        raise UsageError("explain-key takes one or two files")
    if files.count("-") > 1:
        raise UsageError("stdin (-) can be read once")
    epochs: tuple[int, ...] = ()
    if args.epochs:
        try:
            epochs = tuple(int(x) for x in args.epochs.split(","))
        except ValueError as exc:
            raise UsageError(f"--epochs {args.epochs!r}: three integers, e.g. 0,2,1") from exc
        if len(epochs) != 3 or min(epochs) < 0:
            raise UsageError(f"--epochs {args.epochs!r}: three integers, e.g. 0,2,1")
    request = explain.KeyRequest(
        path=args.path,
        tenant=args.tenant,
        model_version=args.model_version,
        epochs=epochs,
        options=keys.KeyOptions(
            collapse_whitespace=args.collapse_whitespace,
            cache_nondeterministic=args.cache_nondeterministic,
        ),
    )
    found = [
        explain.explain(raw, source, request)
        for source, raw in (_read_source(f, stdin) for f in files)
    ]
    comparison = explain.compare(found[0], found[1]) if len(found) == 2 else None
    if args.output:
        _dump(explain.document(found, comparison), args.output, out)
        return EXIT_OK
    out.write("\n".join(explain.render(e, request) for e in found))
    if comparison is not None:
        out.write("\n" + explain.render_comparison(comparison))
    return EXIT_OK


def main(
    argv: list[str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stdin: Any = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(err)
        return EXIT_USAGE
    try:
        if args.command == "status":
            return cmd_status(args, out, err)
        if args.command == "top":
            return cmd_top(args, out, err)
        if args.command == "invalidate":
            return cmd_invalidate(args, out, err)
        return cmd_explain_key(args, out, err, stdin or sys.stdin)
    except PluginError as exc:
        err.write(f"error: {exc}\n")
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
