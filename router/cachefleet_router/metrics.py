"""The router's Prometheus metrics, all in one place (a registry per instance, none global).

* ``cachefleet_router_decisions_total{endpoint, reason}``: requests answered;
  ``endpoint`` is the chosen ``host:port`` (empty when none was), ``reason``
  the picker's reason, or ``no-endpoint`` / ``subset-empty`` when the answer
  was a 503 (fail-closed) or a refusal (fail-open).
* ``cachefleet_router_decision_seconds``: time from the request's last
  awaited message to the answer (parsing, hashing and picking), seconds.
* ``cachefleet_router_endpoints``: endpoints known, and ``..._endpoints_ready``:
  those a request may go to.
* ``cachefleet_router_scrape_failures_total{endpoint}``: failed ``/metrics`` reads.
* ``cachefleet_router_served_mismatch_total``: the gateway reported a served
  endpoint other than the one picked (a retry or a gateway ignoring the pick).
* ``cachefleet_router_refusals_total{reason}``: a limit applied to a request:
  ``streams`` (refused: too many ext_proc streams open), ``body-size`` (its body
  is past the per-request limit) or ``body-memory`` (the bodies held across
  streams are at their budget); the last two are routed by load on what was
  read, their body passed on unread.
* ``cachefleet_router_streams``: ext_proc streams open; ``..._body_bytes_held``:
  request body bytes held across them, waiting for their ``end_of_stream``.

Label sets are bounded by the pool's size, and ``reason`` by the code.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: decision latency buckets, seconds (a decision is expected well under a millisecond)
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter(
            "cachefleet_router_decisions_total",
            "Requests answered by the endpoint picker, by chosen endpoint and reason",
            ["endpoint", "reason"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "cachefleet_router_decision_seconds",
            "Time to reduce a request and pick its endpoint, seconds",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.endpoints = Gauge(
            "cachefleet_router_endpoints",
            "Endpoints known to the router (static or discovered)",
            registry=self.registry,
        )
        self.endpoints_ready = Gauge(
            "cachefleet_router_endpoints_ready",
            "Endpoints a request may be sent to now",
            registry=self.registry,
        )
        self.scrape_failures = Counter(
            "cachefleet_router_scrape_failures_total",
            "Failed reads of an endpoint's /metrics",
            ["endpoint"],
            registry=self.registry,
        )
        self.served_mismatch = Counter(
            "cachefleet_router_served_mismatch_total",
            "Responses the gateway says another endpoint than the picked one served",
            registry=self.registry,
        )

        self.refusals = Counter(
            "cachefleet_router_refusals_total",
            "Requests a limit applied to: refused (streams) or routed by load unread (body-*)",
            ["reason"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "cachefleet_router_streams",
            "ext_proc streams open (HTTP requests through the gateway)",
            registry=self.registry,
        )
        self.body_bytes_held = Gauge(
            "cachefleet_router_body_bytes_held",
            "Request body bytes held across streams until their end_of_stream, bytes",
            registry=self.registry,
        )

    def forget_endpoint(self, address: str) -> None:
        """Drop the per-endpoint series of an endpoint that left the pool (bounded labels)."""
        for labels in list(self.decisions._metrics):  # client_python has no listing API
            if labels[0] == address:
                self.decisions.remove(*labels)
        with contextlib.suppress(KeyError):
            self.scrape_failures.remove(address)
