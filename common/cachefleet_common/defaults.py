"""The upstream bounds the sidecar runs with and the operator publishes in the CRD.

Every default that is both a program's flag and a field of ``InferenceCache``'s
schema lives in the kernel, so that the CRD never documents a number the
sidecar does not use: these two here, the others beside the fact they belong
to (the admission thresholds in :mod:`.classes`, the fleet sample rate in
:mod:`.contract.fleet`, the staleness bound in :mod:`.epochs`, the guests'
share in :mod:`.contract.lua`). Room-local defaults stay beside their code.
"""

from __future__ import annotations

#: Connections open or opening to one upstream at once (``--upstream-max-connections``).
UPSTREAM_MAX_CONNECTIONS = 256
#: Requests that may wait for a connection (``--upstream-max-queued``); more get 503 at once.
UPSTREAM_MAX_WAITING = 1024
