"""``kubectl cachefleet`` (the executable ``kubectl-cachefleet``): the command line.

Thin: parses flags (:mod:`cachefleet_common.flags`, none with an environment
form: :func:`build_flags` says why), calls :mod:`.cluster` for I/O and
:mod:`.views` / :mod:`.explain` for what is printed. ``main(argv)`` returns
the exit status.
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

from cachefleet_common import keys
from cachefleet_common.contract.names import cache_ref, valid_name
from cachefleet_common.contract.urls import parse_redis_url, redact_url
from cachefleet_common.flags import Flags
from cachefleet_operator.api import (
    API_VERSION,
    DEFAULT_INVALIDATION_TIMEOUT_S,
    InvalidationPhase,
    ScopeType,
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


#: ``invalidate --scope`` -> the ``spec.scope`` fields it needs and those it may take.
SCOPE_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cache": ((), ()),
    "tenant": (("tenant",), ()),
    "model": (("model",), ()),  # defaults to the cache's spec.model.name
    "namespace": (("tenant", "namespace"), ()),
    "key": (("key",), ("tenant",)),
}
#: ``spec.scope`` field -> the flag of ``invalidate`` that sets it (``--namespace-value``:
#: ``-n/--namespace`` is kubectl's, the Kubernetes namespace).
FIELD_FLAGS = {
    "tenant": "--tenant",
    "model": "--model",
    "namespace": "--namespace-value",
    "key": "--key",
}
NAME_RULE = "1-63 of [A-Za-z0-9._-], starting with a letter or digit"
KEY_HINT = " (the X-Cache-Key response header; kubectl cachefleet explain-key prints it)"


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


def _global_flags(flags: Flags, outputs: tuple[str, ...]) -> None:
    """kubectl's connection flags (before or after the command) and ``-o`` of a command."""
    flags.add("kubeconfig", "kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)")
    flags.add("context", "kubeconfig context to use")
    flags.add("namespace", "namespace (default: the context's, else default)", short="-n")
    if outputs:
        flags.add(
            "output",
            f"output format: {', '.join(outputs)}",
            short="-o",
            choices=outputs,
        )


def _para(text: str) -> str:
    return textwrap.fill(text, width=78)


def build_flags() -> Flags:
    """The plugin's flags. None has an environment form: kubectl and its plugins read none
    but ``KUBECONFIG``, and ``CACHEFLEET_NAMESPACE``, ``CACHEFLEET_REDIS_URL``,
    ``CACHEFLEET_MODEL_VERSION`` are the operator's and the sidecar's: a shell set up to
    run one of those would silently point the plugin elsewhere (for ``invalidate``, at
    another tenant's, model's or namespace's entries)."""
    flags = Flags(
        PROG,
        "Inspect and operate cachefleet's InferenceCaches.",
        env_prefix=None,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _global_flags(flags, ())
    for add in (_status_flags, _top_flags, _invalidate_flags, _explain_key_flags):
        add(flags)
    return flags


def _command(flags: Flags, name: str, summary: str, description: str) -> Flags:
    return flags.command(
        name,
        help=summary,
        description=_para(description),
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _status_flags(flags: Flags) -> None:
    status = _command(
        flags,
        "status",
        "per cache: tenants, class, shares, L1/L2 bytes, hit ratio, SLA, lagging sidecars",
        "Per InferenceCache, from its status as the operator writes it: conditions, quota "
        "generation, SLA attainment, sidecars live / in sync (lagging = live minus in sync), "
        "epochs, the last CacheInvalidation (its lagging pods when it failed), and per tenant "
        "class, share, L1 bytes per pod, L2 bytes, observed hit ratio and SLA. Savings columns "
        "appear when the status carries savings. -o wide adds weight, p95, RPS and the "
        "allocation's reason.",
    )
    status.parser.add_argument(
        "name", nargs="?", help="InferenceCache (default: every one in the namespace)"
    )
    status.add("all-namespaces", "every namespace", short="-A", is_switch=True)
    _global_flags(status, ("wide", "json", "yaml"))


def _top_flags(flags: Flags) -> None:
    top = _command(
        flags,
        "top",
        "per pod: heartbeat, quota generation, epochs acknowledged, policy per tenant",
        "Per pod of an InferenceCache. Pods, readiness and restarts come from the Kubernetes "
        "API (the cache's spec.selector). Sidecar columns come from the sidecars' heartbeats "
        "and epoch acknowledgements in the cache's Redis (spec.redis: its URL or Secret; "
        "--redis-url overrides it, e.g. through kubectl port-forward): HEARTBEAT is the age of "
        "the last heartbeat, QUOTAS the quota generation the sidecar applied against the "
        "status's quotaGeneration, EPOCHS whether it acknowledged every epoch in the status, "
        "REDIS whether the sidecar itself reaches Redis, POLICIES its L1 policy per tenant. "
        "'?' means that source could not be read (a warning says why).",
    )
    top.parser.add_argument(
        "name", nargs="?", help="InferenceCache (default: the only one in the namespace)"
    )
    top.add("redis-url", "read heartbeats from this Redis instead of spec.redis")
    _global_flags(top, ("wide", "json", "yaml"))


def _invalidate_flags(flags: Flags) -> None:
    inv = _command(
        flags,
        "invalidate",
        "create a CacheInvalidation; --wait follows it to Completed or Failed",
        "Creates a CacheInvalidation of the InferenceCache NAME: --scope cache (everything), "
        "tenant (--tenant), model (--model), namespace (one cache namespace of a tenant: "
        "--tenant and --namespace-value, the X-Cache-Namespace header's value; -n/--namespace "
        "stays the Kubernetes namespace) or key (one entry: --key, the X-Cache-Key header "
        "of a response, optionally --tenant). The flags are checked before the API is "
        "asked (a bad one exits 2 even when the cluster is out of reach). With --wait, "
        "follows it like kubectl rollout status, printing each change, until Completed "
        "(exit 0), Failed "
        f"(exit {EXIT_INVALIDATION_FAILED}, lagging pods named) or no outcome within "
        f"--timeout plus {RESULT_GRACE_S:.0f}s for the operator to write it "
        f"(exit {EXIT_TIMEOUT}).",
    )
    inv.parser.add_argument("name", help="InferenceCache")
    inv.add("scope", "what to invalidate", choices=tuple(SCOPE_FLAGS), required=True)
    inv.add(
        "tenant",
        "tenant of --scope tenant and namespace; with --scope key, only that tenant's entry",
    )
    inv.add("model", "model of --scope model (default: the cache's spec.model.name)")
    inv.add(
        "namespace-value",
        "cache namespace of --scope namespace: the X-Cache-Namespace header's value "
        "(not -n/--namespace, which names the Kubernetes namespace of the cache)",
        metavar="NS",
    )
    inv.add(
        "key",
        "entry of --scope key: the X-Cache-Key response header, 64 hex digits "
        "(explain-key prints it)",
        metavar="DIGEST",
    )
    inv.add("reason", "why (shown in the object's Events)")
    timeout = f"{DEFAULT_INVALIDATION_TIMEOUT_S}s"
    inv.add(
        "timeout",
        f"how long every live sidecar has to acknowledge (spec.timeoutSeconds; default {timeout})",
        default=timeout,
    )
    inv.add("wait", "wait for the outcome", is_switch=True)
    _global_flags(inv, ("name", "json", "yaml"))


def _explain_key_flags(flags: Flags) -> None:
    key = _command(
        flags,
        "explain-key",
        "the canonical form and digest of a request body; whether two bodies share an entry",
        "Keys a request body (FILE, or - for stdin) with the sidecar's own code "
        "(cachefleet_common.keys) and prints its canonical form, its xxh3-128 "
        "digest (the L1 index) and SHA-256 (the L2 entry: the X-Cache-Key response header, "
        "what invalidate "
        "--scope key --key takes; -o key prints only it), or why the sidecar would not cache "
        "it. With two files, says whether they share one entry and, if not, where their "
        "canonical forms first differ. The digest also depends on the tenant, the cache "
        "namespace (--namespace-value: the X-Cache-Namespace header), the model version and, "
        "on a sidecar with Redis, the invalidation epochs (--epochs, from the cache's "
        "status); whether two bodies share an entry does not.",
    )
    key.parser.add_argument(
        "files", nargs="*", metavar="FILE", help="request body; - or none: stdin"
    )
    key.add(
        "path",
        f"endpoint and query (default {explain.DEFAULT_PATH})",
        default=explain.DEFAULT_PATH,
    )
    key.add(
        "tenant",
        f"tenant ({NAME_RULE}, as the sidecar accepts; default {explain.DEFAULT_TENANT})",
        default=explain.DEFAULT_TENANT,
    )
    key.add(
        "namespace-value",
        "the request's X-Cache-Namespace header (not -n/--namespace; default: none)",
        default="",
        metavar="NS",
    )
    key.add("model-version", "the sidecar's --model-version", default="")
    key.add(
        "epochs",
        "CACHE,TENANT,MODEL epochs of a sidecar with Redis, e.g. 0,2,1; with "
        "--namespace-value, CACHE,TENANT,MODEL,NAMESPACE",
    )
    key.add("collapse-whitespace", "the tenant's collapseWhitespace", is_switch=True)
    key.add(
        "cache-nondeterministic",
        "the tenant's cacheNondeterministic",
        is_switch=True,
    )
    key.add(
        "output",
        "output format; key: only the X-Cache-Key digest, one line per FILE",
        short="-o",
        choices=("json", "yaml", "key"),
    )


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
    if args.redis_url is not None:
        try:
            parse_redis_url(args.redis_url)
        except ValueError as exc:
            raise UsageError(f"--redis-url: {exc}") from exc
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
        sidecars = read_sidecars(url, cache_ref(ns, name), epochs)
        sources["sidecars"] = f"heartbeats and acknowledgements in Redis {redact_url(url)}"
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


#: Stands for the cache's ``spec.model.name`` while the flags are checked before the API
#: is asked (``--scope model`` without ``--model`` takes it from the cache).
_MODEL_OF_THE_CACHE = object()


def invalidation_body(
    cache: Mapping[str, Any],
    scope: str,
    reason: str | None,
    timeout_s: int,
    **given: str | None,
) -> dict[str, Any]:
    """The CacheInvalidation to create, validated with the CRD's own model.

    ``given`` holds the scope flags by their ``spec.scope`` field (``tenant``,
    ``model``, ``namespace``, ``key``); a flag the scope does not take, or a
    missing one it needs, is an error naming the flag.
    """
    default = ((cache.get("spec") or {}).get("model") or {}).get("name")
    return _invalidation(
        str(cache["metadata"]["name"]), scope, reason, timeout_s, default or None, given
    )


def check_invalidation_flags(
    name: str, scope: str, reason: str | None, timeout_s: int, **given: str | None
) -> None:
    """:func:`invalidation_body`'s checks of the flags alone, before any API call: a usage
    error is one whatever the cluster (the cache adds only ``--scope model``'s default)."""
    _invalidation(name, scope, reason, timeout_s, _MODEL_OF_THE_CACHE, given)


def _invalidation(
    name: str,
    scope: str,
    reason: str | None,
    timeout_s: int,
    default_model: object,
    given: Mapping[str, str | None],
) -> dict[str, Any]:
    if scope not in SCOPE_FLAGS:
        raise UsageError(f"--scope {scope!r}: one of {', '.join(SCOPE_FLAGS)}")
    needed, optional = SCOPE_FLAGS[scope]
    values = {f: v for f, v in given.items() if v is not None and v != ""}
    for field_name in values:
        if field_name not in needed + optional:
            takes = [s for s, (n, o) in SCOPE_FLAGS.items() if field_name in n + o]
            raise UsageError(
                f"{FIELD_FLAGS[field_name]} goes with --scope {' or '.join(takes)}, "
                f"not --scope {scope}"
            )
    if scope == "model" and "model" not in values:
        if default_model is None:
            raise UsageError("--scope model needs --model (the cache's spec names no model)")
        # checked before the API is asked: any name stands for the cache's (no rule on it)
        values["model"] = "model" if default_model is _MODEL_OF_THE_CACHE else str(default_model)
    missing = [FIELD_FLAGS[f] for f in needed if f not in values]
    if missing:
        hint = KEY_HINT if "--key" in missing else ""
        raise UsageError(f"--scope {scope} needs {' and '.join(missing)}{hint}")
    if "key" in values:
        # the header is lower-case hex; the same digest typed in capitals is still it
        values["key"] = str(values["key"]).strip().lower()
    raw_scope: dict[str, Any] = {"type": ScopeType(scope.capitalize()).value}
    raw_scope.update((f, values[f]) for f in ("tenant", "model", "namespace", "key") if f in values)
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
        flag = {f"spec.scope.{f}": flag for f, flag in FIELD_FLAGS.items()}
        flag["spec.reason"] = "--reason"
        message = exc.message
        if exc.field == "spec.scope.key":
            message = f"{values.get('key')!r} is not 64 hex digits{KEY_HINT}"
        elif exc.field == "spec.scope.namespace":
            message = f"{values.get('namespace')!r}: {NAME_RULE} (what a sidecar accepts)"
        raise UsageError(f"{flag.get(exc.field, exc.field)}: {message}") from exc
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
    flags = {
        "tenant": args.tenant,
        "model": args.model,
        "namespace": args.namespace_value,
        "key": args.key,
    }
    check_invalidation_flags(args.name, args.scope, args.reason, timeout_s, **flags)
    cluster = _cluster(args)
    ns = cluster.target.namespace
    cache = cluster.get(CACHES, ns, args.name)
    body = invalidation_body(cache, args.scope, args.reason, timeout_s, **flags)
    # as a manifest names it (the API server would fill it in from the path anyway)
    body["metadata"]["namespace"] = ns
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
    if not valid_name(args.tenant):
        # what the sidecar answers 400 to (``a/b`` would also read as tenant a, namespace b)
        raise UsageError(f"--tenant {args.tenant!r}: {NAME_RULE}")
    namespace = args.namespace_value
    if namespace and not valid_name(namespace):
        # what the sidecar answers 400 to
        raise UsageError(f"--namespace-value {namespace!r}: {NAME_RULE}")
    epochs: tuple[int, ...] = ()
    if args.epochs:
        # a sidecar with Redis keys a namespaced request by the namespace's epoch too
        want, example = (4, "0,2,1,3") if namespace else (3, "0,2,1")
        wanted = f"{want} integers (cache, tenant, model" + (", namespace)" if namespace else ")")
        try:
            epochs = tuple(int(x) for x in args.epochs.split(","))
        except ValueError as exc:
            raise UsageError(f"--epochs {args.epochs!r}: {wanted}, e.g. {example}") from exc
        if len(epochs) != want or min(epochs) < 0:
            raise UsageError(f"--epochs {args.epochs!r}: {wanted}, e.g. {example}")
    request = explain.KeyRequest(
        path=args.path,
        tenant=args.tenant,
        namespace=namespace,
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
    if args.output == "key":
        for e in found:
            if e.key is None:
                raise PluginError(f"{e.source} is not cached, so it has no X-Cache-Key: {e.reason}")
        out.write("".join(f"{e.key.sha256_hex}\n" for e in found if e.key is not None))
        return EXIT_OK
    if args.output:
        _dump(explain.document(found, comparison, request), args.output, out)
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
    flags = build_flags()
    try:
        args = flags.parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command is None:
        flags.parser.print_help(err)
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
