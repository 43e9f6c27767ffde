"""cachefleet's endpoint picker: which model-server pod a request should reach.

The model servers' KV prefix caches decide most of a GPU's work, and only the
pod that holds a prompt's prefix can skip its prefill. ``cachefleet router``
is a Gateway API Inference Extension endpoint picker (Envoy ``ext_proc`` over
gRPC) that sends each request to the ready endpoint with the least expected
time to first token.

Rooms:

* :mod:`cachefleet_router.endpoints` — the records every room shares: an
  endpoint, what its model server's metrics say, a request reduced to what
  routing needs, and the :class:`~cachefleet_router.endpoints.Picker` seam
  between the gRPC service and the scoring.
* :mod:`cachefleet_router.prefix` — the per-endpoint LRU index of the prompt
  prefixes (chained block hashes) an endpoint is believed to hold.
* :mod:`cachefleet_router.scoring` — :class:`~cachefleet_router.scoring.ScoringPicker`,
  the least expected time to first token with a bounded load (docs/routing.md).
* :mod:`cachefleet_router.schedule`, :mod:`cachefleet_router.profiles` — the
  scheduling seam (scorers, filters, a picker) and the named profiles
  ``--profile`` runs: ``default``, ``least-loaded``, ``round-robin``, ``gie-like``.
* :mod:`cachefleet_router.kvevents`, :mod:`cachefleet_router.kvindex`,
  :mod:`cachefleet_router.kvsub` — the model servers' KV-cache events decoded,
  the precise per-endpoint prefix index they build, and the ZMQ subscriber.
* :mod:`cachefleet_router.tokens` — real token ids (the endpoints' ``/tokenize``
  or a local tokenizer) before the pick.
"""
