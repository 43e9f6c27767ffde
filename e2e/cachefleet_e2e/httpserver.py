"""The stdlib HTTP server the stand-in model servers run on, with a model server's backlog.

``http.server.ThreadingHTTPServer`` listens with ``socketserver``'s default backlog
of 5. When more connections than that arrive at once (the demo's first requests:
every sidecar opens its upstream connections together), Linux drops the handshakes
that find the accept queue full (``TcpExtListenOverflows``), and each of those
clients gets its connection only with the SYN-ACK's retransmission, one second
later: the whole request waits that second. Real model servers do not do that
(uvicorn, which serves vLLM, listens with a backlog of 2048), so the stand-ins
(:mod:`.fake_upstream`, :mod:`.modelserver_sim`) listen with :data:`LISTEN_BACKLOG`.
"""

from __future__ import annotations

from http.server import ThreadingHTTPServer

#: Listen backlog of the stand-in servers (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 2048


class StandInHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with :data:`LISTEN_BACKLOG` and daemon handler threads."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True
