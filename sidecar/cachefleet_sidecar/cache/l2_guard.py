"""The L2 tier's health: each Redis node behind its own circuit breaker, and the
tier's counters.

The cache must never make a request fail or wait long: every L2 operation
goes through :meth:`L2Guard._run` (a script) or :meth:`L2Guard._call` (a
plain command), bounded by ``op_timeout_s``, and a :class:`CircuitBreaker`
*per Redis node* stops calling a node after ``failure_threshold``
consecutive failures on it, so once a node is known to be down an operation
on its tenants returns at once (:data:`FAILED`) while the other nodes of a
cluster keep serving (their successes do not reset the dead node's
breaker). After ``cooldown_s`` one probe is let through; when it succeeds
the node is back without a new object (the client reconnects by itself).
An operation whose budget runs out while its connection is still being made
is a miss that does not count against the breaker.

:class:`cachefleet_sidecar.cache.l2.RedisL2` builds its operations on this.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from cachefleet_common import resp

#: The L2 tier's one log, whichever of its modules writes.
log = logging.getLogger("cachefleet_sidecar.cache.l2")

#: Consecutive failures that open the breaker.
DEFAULT_FAILURE_THRESHOLD = 3
#: How long an open breaker refuses calls before letting one probe through, s.
DEFAULT_COOLDOWN_S = 1.0

State = Literal["ok", "degraded", "down"]


class CircuitBreaker:
    """Closed -> open after N consecutive failures -> half-open probe after a cool-down.

    ``allow()`` says whether a call may go out now; the caller reports the
    outcome with ``success()`` or ``failure()``. In half-open state exactly
    one probe is allowed; its outcome closes or re-opens the breaker.
    """

    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> Literal["closed", "open", "half_open"]:
        if self._opened_at is None:
            return "closed"
        if self._probing or self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def allow(self) -> bool:
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def failure(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
        self._probing = False

    def neither(self) -> None:
        """The call said nothing about the node (still connecting): a probe may go again."""
        self._probing = False

    def copy(self) -> CircuitBreaker:
        """A fresh breaker with the same settings (one per Redis node)."""
        return CircuitBreaker(self.failure_threshold, self.cooldown_s, self._clock)


@dataclass
class L2Counters:
    """What the tier has seen since it was created (exported as metrics)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    refused: int = 0
    evictions: int = 0
    reclaimed_expired: int = 0
    errors: int = 0
    timeouts: int = 0
    short_circuited: int = 0
    #: Operations whose budget ran out while their connection was still being made.
    not_ready: int = 0
    #: Reads and writes refused because their epochs were behind the fence.
    stale_refused: int = 0


class Failed(enum.Enum):
    """Marks an operation the breaker, the timeout or an error cut short."""

    FAILED = "failed"


FAILED: Final = Failed.FAILED


class L2Guard:
    """The nodes of one L2 tier's Redis, each behind its breaker, and the tier's counters.

    ``client`` reaches the nodes; ``breaker`` is the template of the per-node
    breakers (the first node uses that very object).
    """

    def __init__(
        self,
        client: resp.RespClient,
        cache: str,
        *,
        op_timeout_s: float,
        breaker: CircuitBreaker | None,
    ) -> None:
        self._client = client
        self.cache = cache
        self.op_timeout_s = op_timeout_s
        first = breaker if breaker is not None else CircuitBreaker()
        self._breakers: dict[resp.Address, CircuitBreaker] = {client.address_for(None): first}
        self.counters = L2Counters()
        self._last_error: str | None = None

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker of the first node (the only one of a standalone Redis)."""
        return self._breakers[self._client.address_for(None)]

    def breaker_for(self, address: resp.Address) -> CircuitBreaker:
        """The breaker of the node at ``address`` (made on first use)."""
        breaker = self._breakers.get(address)
        if breaker is None:
            breaker = self._breakers[address] = self.breaker.copy()
        return breaker

    def node_states(self) -> dict[str, str]:
        """``host:port`` -> breaker state of every node this tier has used."""
        return {f"{h}:{p}": b.state for (h, p), b in sorted(self._breakers.items())}

    @property
    def state(self) -> State:
        """``down`` while every node's breaker is open, ``degraded`` after recent failures."""
        states = [b.state for b in self._breakers.values()]
        if all(state == "open" for state in states):
            return "down"
        if any(
            state != "closed" or b.consecutive_failures
            for state, b in zip(states, self._breakers.values(), strict=True)
        ):
            return "degraded"
        return "ok"

    @property
    def last_error(self) -> str | None:
        return self._last_error

    # --------------------------------------------------------------- guards

    async def _run(
        self,
        script: resp.Script,
        keys: list[str],
        args: Sequence[Any],
        timeout_s: float | None = None,
        *,
        packed: bytes | None = None,
    ) -> Any | Literal[Failed.FAILED]:
        """Run ``script`` on its keys' node through that node's breaker; never raises.

        ``packed`` is the whole command when the caller has packed it already
        (:func:`resp.pack_script`); ``keys`` then needs only the first key.
        """
        breaker = self.breaker_for(self._client.address_for(keys[0]))
        if not breaker.allow():
            self.counters.short_circuited += 1
            return FAILED
        try:
            if packed is None:
                reply = await self._client.run_script(
                    script, keys, args, timeout_s=timeout_s or self.op_timeout_s
                )
            else:
                reply = await self._client.run_packed(
                    script, keys[0], packed, timeout_s=timeout_s or self.op_timeout_s
                )
        except Exception as exc:  # a cache fault must never fail a request
            return self._fault(breaker, exc)
        self._succeeded(breaker)
        return reply

    async def _call(self, key: str | None, args: tuple[Any, ...]) -> Any:
        """One plain command on ``key``'s node through its breaker; FAILED on any fault."""
        breaker = self.breaker_for(self._client.address_for(key))
        if not breaker.allow():
            self.counters.short_circuited += 1
            return FAILED
        try:
            reply = await self._client.execute(*args, key=key, timeout_s=self.op_timeout_s)
        except Exception as exc:  # a cache fault must never fail a request
            return self._fault(breaker, exc)
        self._succeeded(breaker)
        return reply

    def _succeeded(self, breaker: CircuitBreaker) -> None:
        if breaker.state != "closed":
            log.info("L2 %s: Redis answers again", self.cache)
        breaker.success()

    def _fault(self, breaker: CircuitBreaker, exc: Exception) -> Literal[Failed.FAILED]:
        if isinstance(exc, resp.NotReady):
            # Connection set-up is not the operation's cost: a miss, not a node failure.
            self.counters.not_ready += 1
            breaker.neither()
            return FAILED
        if isinstance(exc, resp.CommandTimeout):
            self.counters.timeouts += 1
            self._fail(breaker, "timeout")
            return FAILED
        # ReplyError, ConnectionLost, or a reply of an unexpected shape.
        self.counters.errors += 1
        self._fail(breaker, f"{type(exc).__name__}: {exc}")
        return FAILED

    def _fail(self, breaker: CircuitBreaker, reason: str) -> None:
        was_open = breaker.state != "closed"
        breaker.failure()
        if self._last_error is None or not was_open:
            log.warning("L2 %s: %s (state %s)", self.cache, reason, self.state)
        self._last_error = reason
