"""A request's ``Cache-Control`` directives (RFC 9111 5.2.1), as the sidecar obeys them (pure).

The sidecar honours four request directives:

* ``no-cache``: do not answer from the cache; the answer goes upstream and
  refreshes the entry;
* ``no-store``: do not store the answer;
* ``max-age=N``: accept only an entry filled at most ``N`` seconds ago;
* ``only-if-cached``: answer from the cache or with ``504``; never call upstream.

Which of them a tenant may use is the InferenceCache's per-tenant
``cacheControl`` (:class:`Allowed`): a tenant that may not bypass the cache
has its ``no-cache`` / ``no-store`` ignored, and ``max-age=0`` too (no entry
is 0 s old when read: it is a bypass, taken as ``no-cache`` where bypassing is
allowed); one that may not choose freshness has its ``max-age`` ignored; each
ignored directive is counted. Several ``Cache-Control`` field lines are one
list (RFC 9110 5.3): the caller joins them before :func:`parse`.
``only-if-cached`` never costs the model anything and is always obeyed.
Unknown directives and malformed values are ignored, as RFC 9111 asks.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The directives :data:`Directives.ignored` may name (the metric's label values).
BYPASS_DIRECTIVES = ("no-cache", "no-store")
MAX_AGE = "max-age"


@dataclass(frozen=True, slots=True)
class Allowed:
    """The request directives one tenant may use (the CRD's ``tenants[].cacheControl``)."""

    bypass: bool = True
    max_age: bool = True


#: Every directive allowed: the default of a tenant that sets nothing.
ALL_ALLOWED = Allowed()


@dataclass(frozen=True, slots=True)
class Directives:
    """What a request's ``Cache-Control`` asks, after the tenant's allowances."""

    no_cache: bool = False
    no_store: bool = False
    #: Seconds; None: any age the tenant's TTL allows.
    max_age: int | None = None
    only_if_cached: bool = False
    #: Directives the request sent that the tenant may not use (ignored, to be counted).
    ignored: tuple[str, ...] = ()


NONE = Directives()


def _delta_seconds(value: bytes) -> int | None:
    """RFC 9111 delta-seconds (``1*DIGIT``, optionally quoted); None when malformed."""
    value = value.strip()
    if len(value) >= 2 and value[:1] == b'"' and value[-1:] == b'"':
        value = value[1:-1]
    if not value or not value.isdigit():
        return None
    # RFC 9111 1.2.2: a value too large to hold is taken as 2**31.
    return min(int(value[:12]), 2**31)


def parse(header: bytes | None, allowed: Allowed = ALL_ALLOWED) -> Directives:
    """The directives of one ``Cache-Control`` request header value, under ``allowed``."""
    if not header:
        return NONE
    no_cache = no_store = only_if_cached = False
    max_age: int | None = None
    ignored: list[str] = []
    for part in header.lower().split(b","):
        name, sep, value = part.strip().partition(b"=")
        name = name.strip()
        if name == b"no-cache":
            no_cache = True
        elif name == b"no-store":
            no_store = True
        elif name == b"only-if-cached":
            only_if_cached = True
        elif name == b"max-age" and sep:
            seconds = _delta_seconds(value)
            if seconds is not None:  # the smallest of repeated max-ages wins
                max_age = seconds if max_age is None else min(max_age, seconds)
    if max_age == 0:
        # no entry is 0 s old when it is read: a bypass, under the bypass allowance
        max_age = None
        if allowed.bypass:
            no_cache = True
        else:
            ignored.append(MAX_AGE)
    if not allowed.bypass:
        if no_cache:
            ignored.append("no-cache")
            no_cache = False
        if no_store:
            ignored.append("no-store")
            no_store = False
    if not allowed.max_age and max_age is not None:
        ignored.append(MAX_AGE)
        max_age = None
    return Directives(no_cache, no_store, max_age, only_if_cached, tuple(ignored))
