"""How the HTTP app is served (uvicorn with httptools and uvloop): the port bound before the model loads, a read
timeout for clients that never finish sending a request, and a bounded drain of in-flight requests on shutdown."""

import asyncio
import functools
import logging
import signal
import socket
from typing import Callable, Optional

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)
_CANCEL_GRACE_S = 10.0  # after the drain's aborts: time for handlers to send their last bytes
# A request's head (request line and headers) larger than this is refused with a 431: httptools' parser buffers a head
# without a bound of its own (h11 refused one over 16 KB), so one client could grow this process's memory for as long
# as the read deadline lets it send. Far above any real head, and above what one read of the socket can overcount.
MAX_REQUEST_HEAD_BYTES = 1 << 20
_HEAD_MESSAGE = b"request line and headers over %d bytes together" % MAX_REQUEST_HEAD_BYTES
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_HEAD_MESSAGE), _HEAD_MESSAGE)
)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (listening starts when serving does, so until the model is ready a
    client is refused rather than left waiting). ``ValueError`` naming the flags when it cannot be bound."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]  # fmt: skip
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"--host {host!r}: cannot listen there ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no obstacle
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


class ReadTimeoutHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (a C parser and writer: on uvloop the HTTP process spent 17 % less CPU per streamed
    token than with h11's pure-Python one on asyncio, benchmarks/host_overhead.py), plus a deadline for reading each
    request: from the connection's start (or its previous response) the client has ``read_timeout_s`` to send the
    whole request, headers and body, or the connection is closed. uvicorn has none, so half-sent headers would hold a
    connection forever."""

    def __init__(self, *args, read_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self._read_deadline = None
        self._reading = True  # a request is due or begun and not yet whole (a new connection owes its first)
        self._unanswered = 0  # requests read whole whose responses have not ended (more than one: pipelined)
        self._in_head, self._head_bytes = True, 0  # reading a request's head; bytes received while it lasts

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_read_deadline()

    def connection_lost(self, exc) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():  # the head still incomplete after all of data
            self._head_bytes += len(data)
            if self._head_bytes > MAX_REQUEST_HEAD_BYTES:
                logger.debug("closing a connection from %s: a request head over %d bytes",
                             "%s:%d" % self.client if self.client else "?", MAX_REQUEST_HEAD_BYTES)  # fmt: skip
                self.transport.write(_HEAD_TOO_LARGE)
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = self._in_head = True

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = False
        self._unanswered += 1

    def on_response_complete(self) -> None:
        self._unanswered -= 1
        super().on_response_complete()
        # the next request on a kept-alive connection gets its own deadline (an idle one: uvicorn's keep-alive
        # timeout closes it first; a pipelined one already read whole: the deadline passes it by)
        self._arm_read_deadline()

    def _arm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def only_sending_a_request(self) -> bool:
        """A request is coming in and no response is under way on this connection: closing it loses no answer."""
        return self._reading and self._unanswered == 0 and not self.transport.is_closing()

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self._reading and not self.transport.is_closing():
            logger.debug("closing a connection from %s: no whole request within %gs (--request_read_timeout_s)",
                         "%s:%d" % self.client if self.client else "?", self.read_timeout_s)  # fmt: skip
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting and waits for in-flight requests without a bound. Here it waits
    ``drain_s`` seconds, then ``abort_rest()`` ends the remaining requests (their clients get finish_reason
    "abort"), connections still sending a request are closed, and anything still open after a short grace is
    cancelled. A second Ctrl+C ends the drain at once the same way (uvicorn's own, which it invites with "CTRL+C to
    force quit", cancels every handler mid-response: streams cut without their end, a traceback each); a third is
    uvicorn's force quit."""

    def __init__(self, config: uvicorn.Config, drain_s: float, abort_rest: Callable[[], None]):
        config.timeout_graceful_shutdown = int(drain_s + _CANCEL_GRACE_S) + 1
        super().__init__(config)
        self.drain_s = drain_s
        self.abort_rest = abort_rest
        self._draining: Optional[asyncio.AbstractEventLoop] = None  # the loop, once the drain has begun
        self._cut_short = False  # a second Ctrl+C came (maybe before the drain began: uvicorn looks every 0.1 s)
        self._drained = False  # the drain is over: by its timer or a second Ctrl+C

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self.should_exit and not self._drained and not self._cut_short:
            self._cut_short = True
            if self._draining is not None:  # else shutdown() ends the drain as it begins
                self._draining.call_soon_threadsafe(self._drain_over, True)  # a signal handler: the loop runs it next
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self._draining = asyncio.get_running_loop()
        timer = self._draining.call_later(self.drain_s, self._drain_over)
        if self._cut_short:
            self._draining.call_soon(self._drain_over, True)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain_over(self, cut_short: bool = False) -> None:
        if self._drained:
            return
        self._drained = True
        if cut_short:
            logger.warning("shutdown: Ctrl+C again; aborting the %d request(s) still running (once more: quit at once, "
                           "without their ends)", len(self.server_state.tasks))  # fmt: skip
        elif self.server_state.tasks:
            logger.warning("shutdown: %d request(s) still running after %gs (--shutdown_drain_s); aborting them",
                           len(self.server_state.tasks), self.drain_s)  # fmt: skip
        self.abort_rest()
        # A request not yet whole (its body still coming) has nothing to abort: its handler waits for the body until
        # the grace runs out and is cancelled then (a 500 and a traceback). Closed, it sees the client leave.
        for connection in list(self.server_state.connections):
            if isinstance(connection, ReadTimeoutHttpTools) and connection.only_sending_a_request():
                connection.transport.close()


def http_stack(read_timeout_s: float) -> dict:
    """uvicorn's ``http`` and ``loop`` settings of the server: httptools with the read deadline, on uvloop (asyncio's
    loop where uvloop is not installed: not Linux or macOS)."""
    return {"http": functools.partial(ReadTimeoutHttpTools, read_timeout_s=read_timeout_s), "loop": "auto"}


def serve(app, sock: socket.socket, read_timeout_s: float, drain_s: float, abort_rest: Callable[[], None],
          on_start: Optional[Callable[[uvicorn.Server], None]] = None) -> None:  # fmt: skip
    """Serve ``app`` on the bound ``sock`` until SIGTERM/SIGINT, then drain (see DrainingServer). ``on_start``
    gets the uvicorn server first (setting its ``should_exit`` stops serving, with the same drain)."""
    config = uvicorn.Config(app, log_level="info", **http_stack(read_timeout_s))
    host, port = sock.getsockname()[:2]
    logger.info("serving on http://%s:%d", host, port)
    server = DrainingServer(config, drain_s, abort_rest)
    if on_start is not None:
        on_start(server)
    server.run(sockets=[sock])
