"""The kinds of value more than one program's flags take, each parsed one way.

A parser takes the flag's text and returns the value, or raises ``ValueError``
saying what was expected (:class:`cachefleet_common.flags.Flags` adds the
flag's name and where the value came from).
"""

from __future__ import annotations

from cachefleet_common.contract.names import valid_name

_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def byte_size(value: str) -> int:
    """``268435456``, ``256Mi`` or ``256M`` (binary units: Ki, Mi, Gi; a trailing B allowed)."""
    text = value.strip().lower().removesuffix("b")
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * _UNITS[suffix]
    if text.isdigit():
        return int(text)
    raise ValueError(f"expected a byte count such as 268435456 or 256Mi, got {value!r}")


def cache_ref(value: str) -> str:
    """``NAMESPACE/NAME`` of an InferenceCache, both Kubernetes names."""
    namespace, sep, name = value.partition("/")
    if not sep or not valid_name(namespace) or not valid_name(name):
        raise ValueError(f"expected NAMESPACE/NAME, got {value!r}")
    return value


def otlp_url(value: str) -> str:
    """An OTLP/HTTP collector's http(s) URL, or empty (tracing off)."""
    url = value.strip()
    if url and not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    return url
