"""Request classes and GIE's request headers: what the sidecar's admission and the router share.

The three priority classes of ``InferenceCache`` tenants, the defaults of the
admission thresholds the CRD publishes, how a request's objective may lower its
tenant's class (never raise it), and the ``objective=Class`` flag both programs
take. Pure: no I/O.
"""

from __future__ import annotations

#: GIE's request headers (the gateway sets them; flow-control docs of the Gateway API
#: Inference Extension): the InferenceObjective's name, and the request's fairness key.
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
#: Longest fairness id taken (a longer value is ignored: the tenant's own flow).
MAX_FAIRNESS_ID = 128

GUARANTEED = "Guaranteed"
STANDARD = "Standard"
BEST_EFFORT = "BestEffort"
CLASSES = (GUARANTEED, STANDARD, BEST_EFFORT)

#: Requests waiting for prefill at which the model server counts as saturated.
DEFAULT_MAX_WAITING = 8
#: KV cache usage (0..1) at which the model server counts as saturated (vLLM preempts when full).
DEFAULT_MAX_KV_USAGE = 0.95
#: Standard requests one sidecar lets wait at once (the next one gets 429).
DEFAULT_STANDARD_QUEUE = 64
#: Seconds a Standard request waits for room before it gets 503.
DEFAULT_STANDARD_MAX_WAIT_S = 10.0


def pairs(text: str) -> dict[str, str]:
    """``name=value,name=value`` (spaces around the items ignored) as a dict; ValueError
    names the item that is not such a pair, or a name given twice."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"expected name=value, got {item!r}")
        if name in out:
            raise ValueError(f"{name!r} is given twice")
        out[name] = value
    return out


def normal_class(priority_class: str | None) -> str:
    """The class admission applies: a tenant without one (or an unknown name) is Standard."""
    return priority_class if priority_class in (GUARANTEED, BEST_EFFORT) else STANDARD


_RANK = {BEST_EFFORT: 0, STANDARD: 1, GUARANTEED: 2}


def capped_class(tenant_class: str | None, objective_class: str | None) -> str | None:
    """A request's class: its tenant's, lowered to its objective's when that is lower.

    The objective (GIE's ``x-gateway-inference-objective``) comes with the request,
    so it may only ever lower the class its tenant's entry gives, never raise it;
    no objective (or one the table does not know: None) leaves the tenant's class.
    """
    if objective_class is None:
        return tenant_class
    if _RANK[normal_class(objective_class)] < _RANK[normal_class(tenant_class)]:
        return normal_class(objective_class)
    return tenant_class


def parse_objectives(text: str) -> dict[str, str]:
    """``objective=Class,...`` (the sidecar's and the router's flag), classes by name."""
    out = pairs(text)
    for name, cls in out.items():
        if cls not in CLASSES:
            raise ValueError(f"{name}: the class must be one of {', '.join(CLASSES)}, got {cls!r}")
    return out
