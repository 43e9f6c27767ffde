"""Least-privilege Redis ACL rules for the two kinds of Redis user.

``ACL SETUSER <user> on ><password> <rules...>``; docs/security.md shows them
and a test runs under them.
"""

from __future__ import annotations

#: Commands a sidecar sends (connection set-up, L2 scripts, control sync, heartbeats,
#: the rate limits counting live pods, the warm-up sizing values before it reads them).
SIDECAR_COMMANDS = (
    "+hello", "+auth", "+ping", "+select", "+client|setname",
    "+readonly", "+cluster|slots", "+cluster|shards", "+cluster|nodes",
    "+eval", "+evalsha", "+script|load",
    "+get", "+mget", "+strlen", "+hget", "+hmget", "+hgetall", "+hset", "+hdel",
    "+sadd", "+smembers",
    "+zrangebyscore", "+zcount", "+zrem", "+del",
    "+publish", "+spublish", "+subscribe", "+unsubscribe", "+ssubscribe", "+sunsubscribe",
    "+xadd",
)  # fmt: skip
#: Commands the L2 and control Lua scripts run on the caller's behalf.
SCRIPT_COMMANDS = (
    "+set", "+hexists", "+hincrby", "+time", "+unlink",
    "+zadd", "+zrange", "+zremrangebyscore", "+zscore",
    "+exists", "+pexpire",
)  # fmt: skip
#: Further commands of the operator (cleanup of a deleted cache scans its keys; the
#: key-purge script trims the purge log; the fleet curves read the fleet-sample stream).
OPERATOR_COMMANDS = ("+scan", "+zcard", "+zremrangebyrank", "+xrange")


def _cache_patterns(cache: str) -> list[str]:
    escaped = cache.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")
    escaped = escaped.replace("?", "\\?")
    return [f"~cf:{{cf:{escaped}}}:*", f"~cf:{{cf:{escaped}|*"]


def sidecar_acl(cache: str) -> list[str]:
    """ACL rules of a sidecar user: its cache's keys and channels, nothing else."""
    escaped = cache.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")
    return [
        "resetkeys",
        *_cache_patterns(cache),
        "resetchannels",
        f"&cf:{{cf:{escaped}}}:*",
        "nocommands",
        *SIDECAR_COMMANDS,
        *SCRIPT_COMMANDS,
    ]


def operator_acl() -> list[str]:
    """ACL rules of the operator's user: every cache's keys and channels (it serves them all)."""
    return [
        "resetkeys",
        "~cf:*",
        "resetchannels",
        "&cf:*",
        "nocommands",
        *SIDECAR_COMMANDS,
        *SCRIPT_COMMANDS,
        *OPERATOR_COMMANDS,
    ]
