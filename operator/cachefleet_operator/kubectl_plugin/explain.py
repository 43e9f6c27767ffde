"""``explain-key``: how the sidecar keys a request body, and why two do or do not share (pure).

Every step is the sidecar's own code in :mod:`cachefleet_common.keys`, in
the order the sidecar runs it: the endpoint (:data:`~cachefleet_common.keys.CACHEABLE_PATHS`,
the query string kept byte for byte), :func:`~cachefleet_common.keys.keyable_body`
(size bound and strict parsing), :func:`~cachefleet_common.keys.make_key`
(scope, canonical form, determinism, digests), the scope built as the
sidecar's ``SidecarCore._key_for`` builds it (tenant, ``X-Cache-Namespace``,
model version, epochs). Nothing here decides what a key is; this module only
shows it and compares two of them. The SHA-256 it shows is the sidecar's
``X-Cache-Key`` header, what ``invalidate --scope key --key`` takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cachefleet_common import keys

#: Default endpoint of explain-key.
DEFAULT_PATH = "/v1/chat/completions"
#: Default tenant of explain-key (the digest depends on it; whether two bodies share does not).
DEFAULT_TENANT = "default"
#: Characters of canonical form shown on each side of a difference.
SNIPPET_CHARS = 40


@dataclass(frozen=True, slots=True)
class KeyRequest:
    """What the sidecar would know besides the body: endpoint, tenant, namespace, version,
    epochs."""

    path: str = DEFAULT_PATH
    tenant: str = DEFAULT_TENANT
    model_version: str = ""
    #: (cache, tenant, model[, namespace]) epochs of a Redis-backed sidecar (the
    #: namespace's only for a namespaced request); () for one without Redis.
    epochs: tuple[int, ...] = ()
    options: keys.KeyOptions = field(default_factory=keys.KeyOptions)
    #: The request's cache namespace (the ``X-Cache-Namespace`` header); "" for none.
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class Explanation:
    """One body as the sidecar keys it: its key, or why it is not cached."""

    source: str
    path: str
    kind: str | None
    key: keys.CacheKey | None
    reason: str | None
    #: The canonical body (top-level keys sorted), when it was keyed.
    body: dict[str, Any] | None = None

    @property
    def cacheable(self) -> bool:
        return self.key is not None


@dataclass(frozen=True, slots=True)
class Difference:
    """Where two canonical forms first differ."""

    #: JSON path in the canonical body (``messages[0].content``); "" when the bodies agree.
    field: str
    left: str
    right: str
    #: Byte offset in the canonical form and the text around it on each side.
    offset: int
    left_snippet: str
    right_snippet: str
    #: Characters of the snippets before the first differing byte.
    caret: int = 0


@dataclass(frozen=True, slots=True)
class Comparison:
    """Whether two bodies share one cache entry, and if not, why."""

    left: Explanation
    right: Explanation
    shared: bool
    reason: str
    difference: Difference | None = None


def explain(raw: bytes, source: str, request: KeyRequest) -> Explanation:
    """Key ``raw`` as the sidecar does for a POST to ``request.path``."""
    path, _, query = request.path.encode("utf-8", "surrogateescape").partition(b"?")
    kind = keys.CACHEABLE_PATHS.get(path)
    if kind is None:
        cached = ", ".join(p.decode() for p in keys.CACHEABLE_PATHS)
        reason = f"{keys.NOT_CACHED_ENDPOINT} (cached: {cached})"
        return Explanation(source, request.path, None, None, reason)
    body = keys.keyable_body(raw)
    if isinstance(body, str):
        return Explanation(source, request.path, kind, None, body)
    # the scope exactly as the sidecar builds it (SidecarCore._key_for)
    scope = keys.Scope(request.tenant, request.model_version, request.epochs, request.namespace)
    try:
        key = keys.make_key(body, kind, scope, request.options, query=query)
    except keys.Uncacheable as exc:
        return Explanation(source, request.path, kind, None, exc.reason)
    canonical = keys.canonical_body(body, kind, request.options)
    return Explanation(source, request.path, kind, key, None, canonical)


_MISSING = object()


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    return json.dumps(value, ensure_ascii=False)


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for name in sorted(set(a) | set(b)):
            sub = f"{path}.{name}" if path else name
            if name not in a or name not in b:
                return sub, a.get(name, _MISSING), b.get(name, _MISSING)
            found = _first_difference(a[name], b[name], sub)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            sub = f"{path}[{i}]"
            if i >= len(a) or i >= len(b):
                return sub, a[i] if i < len(a) else _MISSING, b[i] if i < len(b) else _MISSING
            found = _first_difference(a[i], b[i], sub)
            if found is not None:
                return found
        return None
    if type(a) is not type(b) or a != b:
        return path or "(body)", a, b
    return None


def _text(canonical: bytes) -> str:
    return canonical.decode("utf-8", "backslashreplace")


def compare(left: Explanation, right: Explanation) -> Comparison:
    """Whether ``left`` and ``right`` share an entry; the first difference when not."""
    for side in (left, right):
        if side.key is None:
            return Comparison(left, right, False, f"{side.source} is not cached: {side.reason}")
    assert left.key is not None
    assert right.key is not None
    if left.key.canonical == right.key.canonical:
        return Comparison(left, right, True, "same canonical form")
    a, b = left.key.canonical, right.key.canonical
    offset = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    start = max(0, offset - SNIPPET_CHARS)
    found = _first_difference(left.body, right.body, "")
    if found is None:  # bodies agree: the scope, endpoint or query string differ
        name, lv, rv = "", "", ""
        reason = "the canonical forms differ before the body (scope, endpoint or query string)"
    else:
        name, lv_raw, rv_raw = found
        lv, rv = _show(lv_raw), _show(rv_raw)
        reason = f"first difference at {name}"
    difference = Difference(
        field=name,
        left=lv,
        right=rv,
        offset=offset,
        left_snippet=_text(a[start : offset + SNIPPET_CHARS]),
        right_snippet=_text(b[start : offset + SNIPPET_CHARS]),
        caret=len(_text(a[start:offset])),
    )
    return Comparison(left, right, False, reason, difference)


# ----------------------------------------------------------------- rendering


def digest_hex(key: keys.CacheKey) -> str:
    """The xxh3-128 digest (the L1 index) as 32 hex digits."""
    return f"{key.digest:032x}"


def purge_command(key: keys.CacheKey) -> str:
    """The ``invalidate`` that purges this entry (CACHE: the InferenceCache's name)."""
    return f"kubectl cachefleet invalidate CACHE --scope key --key {key.sha256_hex}"


def render(explanation: Explanation, request: KeyRequest) -> str:
    """What ``explain-key FILE`` prints for one body."""
    e = explanation
    epochs = ",".join(str(x) for x in request.epochs) or "none (a sidecar without Redis)"
    lines = [
        f"source:         {e.source}",
        f"endpoint:       {e.path}" + (f" ({e.kind})" if e.kind else ""),
        f"tenant:         {request.tenant}",
        f"namespace:      {request.namespace or '(none: no X-Cache-Namespace header)'}",
        f"model version:  {request.model_version or '(none)'}",
        f"epochs:         {epochs}",
        f"options:        collapse-whitespace={str(request.options.collapse_whitespace).lower()}"
        f" cache-nondeterministic={str(request.options.cache_nondeterministic).lower()}",
    ]
    if e.key is None:
        lines.append(f"cacheable:      no: {e.reason}")
        return "\n".join(lines) + "\n"
    lines += [
        "cacheable:      yes",
        f"model:          {e.key.model}",
        f"stream:         {str(e.key.stream).lower()}",
        f"digest:         {digest_hex(e.key)}  (xxh3-128: the L1 index)",
        f"sha256:         {e.key.sha256_hex}  (X-Cache-Key: the L2 entry in Redis)",
        f"purge it:       {purge_command(e.key)}",
        f"canonical form: {_text(e.key.canonical)}",
        "canonical body:",
    ]
    body = json.dumps(e.body, ensure_ascii=False, indent=2)
    lines += ["  " + line for line in body.splitlines()]
    return "\n".join(lines) + "\n"


def render_comparison(c: Comparison) -> str:
    """The verdict line(s) of ``explain-key A B``."""
    a, b = c.left.source, c.right.source
    if c.shared:
        assert c.left.key is not None
        return f"{a} and {b} share one cache entry (digest {digest_hex(c.left.key)})\n"
    lines = [f"{a} and {b} do NOT share a cache entry: {c.reason}"]
    d = c.difference
    if d is not None:
        width = max(len(a), len(b)) + 1
        la, lb = f"{a}:".ljust(width), f"{b}:".ljust(width)
        if d.field:
            lines += [f"  {la} {d.left}", f"  {lb} {d.right}"]
        lines += [
            f"  canonical form, first differing byte {d.offset}:",
            f"  {la} ...{d.left_snippet}",
            f"  {lb} ...{d.right_snippet}",
            "  " + " " * (width + 4 + d.caret) + "^",
        ]
    return "\n".join(lines) + "\n"


def document(
    explanations: list[Explanation], comparison: Comparison | None, request: KeyRequest
) -> dict[str, Any]:
    """The same facts for ``-o json|yaml`` (``sha256`` is the ``X-Cache-Key`` header)."""
    items = []
    for e in explanations:
        item: dict[str, Any] = {
            "source": e.source,
            "path": e.path,
            "kind": e.kind,
            "namespace": request.namespace,
            "cacheable": e.cacheable,
        }
        if e.key is None:
            item["reason"] = e.reason
        else:
            item.update(
                model=e.key.model,
                stream=e.key.stream,
                digest=digest_hex(e.key),
                sha256=e.key.sha256_hex,
                canonical=_text(e.key.canonical),
                body=e.body,
            )
        items.append(item)
    out: dict[str, Any] = {"requests": items}
    if comparison is not None:
        verdict: dict[str, Any] = {"shared": comparison.shared, "reason": comparison.reason}
        if comparison.difference is not None:
            d = comparison.difference
            verdict["difference"] = {
                "field": d.field,
                "left": d.left,
                "right": d.right,
                "offset": d.offset,
            }
        out["comparison"] = verdict
    return out
