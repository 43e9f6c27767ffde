"""The records the router's rooms share, and the seam between service and scoring.

Pure: no I/O. The gRPC service (ext_proc) reduces a request body to a
:class:`RouteRequest`, discovery keeps a list of :class:`Endpoint` with the
:class:`EndpointMetrics` their model servers export
(:mod:`cachefleet_common.modelserver` parses them), and a :class:`Picker`
chooses among them. Several router replicas never need to agree: a picker
learns from what it routes (:meth:`Picker.pick`, :meth:`Picker.done`) and
from what the metrics say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cachefleet_common.modelserver import ModelServerMetrics

#: What one endpoint's model server says (one scrape); parsed by
#: :func:`cachefleet_common.modelserver.parse_metrics`, shared with the sidecar's admission.
EndpointMetrics = ModelServerMetrics

#: Tokens in one KV block of the prefix index (vLLM's prefix caching hashes
#: 16-token blocks; the index works at a coarser grain, as the Mooncake traces do).
DEFAULT_BLOCK_TOKENS = 512


@dataclass(slots=True)
class Endpoint:
    """A model-server pod the router may send a request to."""

    #: ``host:port`` as the gateway must dial it (the picker's answer)
    address: str
    ready: bool = True
    metrics: EndpointMetrics | None = None
    #: monotonic time of the last successful scrape (0: never)
    scraped_at: float = 0.0
    #: the pod's name when discovery knows it (Kubernetes), else the address
    name: str = ""


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """A request reduced to what routing needs."""

    #: chained hashes of the prompt's blocks: ``blocks[i]`` depends on blocks 0..i,
    #: so two prompts share ``blocks[:n]`` exactly when they share their first n blocks
    blocks: tuple[int, ...] = ()
    #: the prompt's length in tokens (estimated when no tokenizer is at hand)
    tokens: int = 0
    #: the prompt's token ids as the model server's tokenizer makes them (empty: not
    #: tokenized); the precise prefix index matches them against the servers' KV events
    token_ids: Sequence[int] = ()
    model: str | None = None
    tenant: str | None = None
    #: ``Guaranteed`` / ``Standard`` / ``BestEffort``; None: Standard
    priority_class: str | None = None
    #: the sidecar's exact-answer cache key, when the request is cacheable (a tie-breaker)
    answer_key: str | None = None
    #: the session the client named in the ``--session-header`` header (None: none); the
    #: ``session-affinity`` filter keeps a session on one endpoint while it is not overloaded
    session: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Decision:
    """Where a request goes, and why (for logs, metrics and tests)."""

    address: str
    #: expected time to first token on that endpoint, seconds
    expected_ttft_s: float = 0.0
    #: leading blocks of the prompt the index believes the endpoint holds
    matched_blocks: int = 0
    reason: str = ""


class Picker(Protocol):
    """The seam between the gRPC service and the scoring."""

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        """Choose among ``endpoints`` (already filtered to ready ones); None when empty.

        Records the choice: the chosen endpoint now holds the prompt's blocks and
        carries its prefill work until :meth:`done`.
        """
        ...

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        """The request's first answer bytes came back (``ok``) or it failed."""
        ...
