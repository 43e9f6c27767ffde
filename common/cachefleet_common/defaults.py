"""Defaults the sidecar runs with and the operator publishes in the CRD: one value each.

A default that appears both in a program's flags and in ``InferenceCache``'s
schema lives here, so that the CRD never documents a number the sidecar does
not use. Room-local defaults stay beside their code.
"""

from __future__ import annotations

#: Connections open or opening to one upstream at once (``--upstream-max-connections``).
UPSTREAM_MAX_CONNECTIONS = 256
#: Requests that may wait for a connection (``--upstream-max-queued``); more get 503 at once.
UPSTREAM_MAX_WAITING = 1024
