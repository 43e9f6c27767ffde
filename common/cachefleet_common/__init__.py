"""The shared kernel: the facts the sidecar, the operator and the router all keep.

Each program stands on this package and none on another: the Redis contract
(names, Lua, ACLs, messages, the one client factory), the RESP client, epochs
and cache-key rules, the model-server metrics reader, the sampler's hash space,
prices, tenants' limits, request classes, and the defaults the CRD publishes
for the sidecar. Nothing here imports a program (``cachefleet_sidecar``,
``cachefleet_operator``, ``cachefleet_router``): an import contract says so.
"""
