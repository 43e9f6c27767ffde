"""Sizes as Kubernetes users write them: ``536870912``, ``512Mi``, ``2Gi``, ``1G``.

Every byte size of the CRDs is a :data:`ByteQuantity`: an integer or a Kubernetes
quantity string, parsed with the ``kubernetes`` package's own ``parse_quantity`` (the
same grammar as ``resources.limits``), stored in the model as a whole number of bytes.
In the CRD schema it is ``x-kubernetes-int-or-string`` with the quantity pattern, so
the API server refuses ``512 MB`` before the operator sees it. :func:`readable` prints
a byte count back the way a user would write it (``512Mi``).

Durations stay integers or numbers of seconds in fields named ``...Seconds``, as the
Kubernetes API conventions do (``terminationGracePeriodSeconds``).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

#: A non-negative Kubernetes quantity (the API's own grammar, without a sign).
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

_BINARY = (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20))
_BINARY_SMALL = (("Ki", 1 << 10),)


def parse_bytes(value: Any) -> int:
    """A whole number of bytes from an integer or a quantity string; ``ValueError`` if not."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte count or a quantity such as 512Mi, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a byte count or a quantity such as 512Mi, got {value!r}")
    from kubernetes.utils import quantity

    # unannotated in the kubernetes package: called through an Any-typed handle
    parse_quantity: Any = quantity.parse_quantity
    try:
        number = Decimal(parse_quantity(value.strip()))
    except (ValueError, TypeError, InvalidOperation) as exc:
        raise ValueError(
            f"{value!r} is not a quantity (write bytes as 536870912, 512Mi, 2Gi or 1G)"
        ) from exc
    if number != number.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(number)


def _before(value: Any) -> Any:
    # bool and other types go on to pydantic's own int validation and its message
    if isinstance(value, str | float) and not isinstance(value, bool):
        return parse_bytes(value)
    return value


#: A byte size field: integer or quantity on the wire, ``int`` in the model.
ByteQuantity = Annotated[
    int,
    BeforeValidator(_before),
    # minimum holds for the integer form, pattern (no sign) for the string form
    WithJsonSchema({"x-kubernetes-int-or-string": True, "minimum": 0, "pattern": QUANTITY_PATTERN}),
]


def readable(count: int) -> str:
    """``count`` bytes as a quantity a user would write: ``512Mi``, ``1536Ki``, ``1000``."""
    if count == 0:
        return "0"
    for suffix, unit in _BINARY + _BINARY_SMALL:
        if count % unit == 0 and count >= unit:
            return f"{count // unit}{suffix}"
    return str(count)
