"""Time to first token and inter-token latency of one streamed model answer (pure).

A streamed answer (``text/event-stream``) is relayed as its chunks arrive;
:class:`EventTimes` is fed each chunk with its arrival time and counts the
SSE *data events* in it (a line starting ``data:``), so that

* the **first token** is the arrival of the first chunk holding a data event
  (its time minus the request's start is the time to first token, TTFT);
* the **inter-token latency** (ITL) is the mean gap between data events:
  (last event's arrival - first event's) / (events - 1). Events that came in
  one chunk arrived together (a gap of 0 between them), as the client saw them.

The ``data: [DONE]`` sentinel of the OpenAI API is not a token and is not
counted. A ``data:`` split between two chunks is found (the end of the last
chunk is kept); line ends ``\\n`` and ``\\r\\n`` are recognised (a bare ``\\r``
is not; a ``[DONE]`` split right after its ``data:`` is taken back, though
the arrival of that chunk stays the last one). The cost is two ``bytes.count``
passes over each chunk of a streamed miss; nothing runs for answers that are not
streamed, nor for hits.
"""

from __future__ import annotations

#: A data field at the start of a line.
_DATA = b"\ndata:"
#: The OpenAI stream's end sentinel (a data event that carries no token).
_DONE = b"\ndata: [DONE]"
#: Bytes of the previous chunk kept so a field split between chunks is still found.
_TAIL = len(_DONE) - 1


class EventTimes:
    """Arrival times of the data events of one streamed answer."""

    __slots__ = ("_tail", "events", "first", "last")

    def __init__(self) -> None:
        #: Arrival of the first chunk with a data event (None: none yet).
        self.first: float | None = None
        #: Arrival of the latest chunk with a data event.
        self.last = 0.0
        #: Data events seen ([DONE] not counted).
        self.events = 0
        self._tail = b"\n"  # the stream starts at the start of a line

    def feed(self, chunk: bytes, now: float) -> None:
        """Count the data events ``chunk`` completes, arrived at ``now``."""
        tail = self._tail
        joined = tail + chunk
        found = joined.count(_DATA) - tail.count(_DATA)
        found -= joined.count(_DONE) - tail.count(_DONE)
        self._tail = joined[-_TAIL:]
        if found > 0:
            if self.first is None:
                self.first = now
            self.last = now
            self.events += found
        elif found < 0:  # a [DONE] whose "data:" came in the last chunk, counted there
            self.events = max(0, self.events + found)

    def mean_gap(self) -> float | None:
        """The mean gap between data events, seconds (None: fewer than two)."""
        if self.first is None or self.events < 2:
            return None
        return (self.last - self.first) / (self.events - 1)
