"""Parsing specs off the wire: the first bad field named in a :class:`~.base.SpecError`."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cachefleet_operator.api.base import SpecError, _spec_error
from cachefleet_operator.api.invalidation import CacheInvalidationSpec
from cachefleet_operator.api.resources import RedisEndpoint
from cachefleet_operator.api.spec import InferenceCacheSpec


def parse_spec(raw: dict[str, Any]) -> InferenceCacheSpec:
    """Parse an InferenceCache spec; raise :class:`SpecError` naming the first bad field.

    Only the wire (camelCase) names are accepted, and a field the CRD does not
    declare is an error: the operator refuses what a strict API server refuses.
    """
    try:
        return InferenceCacheSpec.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _spec_error(exc) from exc


def parse_redis_endpoint(raw: Any) -> RedisEndpoint:
    """Parse ``spec.redis`` alone (cleanup needs only it); :class:`SpecError` if it is bad."""
    try:
        return RedisEndpoint.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        err = _spec_error(exc)
        raise SpecError(err.field.replace("spec", "spec.redis", 1), err.message) from exc


def parse_invalidation_spec(raw: dict[str, Any]) -> CacheInvalidationSpec:
    """Parse a CacheInvalidation spec; raise :class:`SpecError` naming the first bad field."""
    try:
        return CacheInvalidationSpec.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _spec_error(exc) from exc
