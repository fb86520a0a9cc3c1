"""The read deadline and the head limit of the server's HTTP protocol (``serving.ReadTimeoutHttpTools``), driven by
hand: what the deadline does when it fires, at every point of a connection's life, with no clock involved (the
end-to-end check that a real server closes a slow client is test_liveness's), and which heads are refused."""

import asyncio

import uvicorn
from uvicorn.server import ServerState

from lightllm.server import serving
from lightllm.server.serving import ReadTimeoutHttpTools


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.closed = False
        self.written = b""

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def _answering(scope, receive, send):  # an app still answering whenever the deadline fires
    await asyncio.Event().wait()


def _connection(chunks, complete_response=False, fire=True):
    """The transport of a connection whose client sent ``chunks`` (then its first answer ended, with
    ``complete_response``), after its read deadline fired (``fire``)."""

    async def main():
        config = uvicorn.Config(_answering, log_level="warning")
        config.load()
        protocol = ReadTimeoutHttpTools(config=config, server_state=ServerState(), app_state={},
                                        _loop=asyncio.get_running_loop(), read_timeout_s=60.0)  # fmt: skip
        transport = _Transport()
        protocol.connection_made(transport)
        for chunk in chunks:
            if not transport.closed:
                protocol.data_received(chunk)
        if complete_response:
            protocol.on_response_complete()
        if fire:
            protocol._read_timed_out()
        seen = _Transport()
        seen.closed, seen.written = transport.closed, transport.written
        for task in protocol.tasks:
            task.cancel()
        protocol.connection_lost(None)  # (it closes the transport itself)
        return seen

    return asyncio.run(main())


def _fire_after(*chunks, complete_response=False):
    """Whether the connection is closed when its deadline fires after the client sent ``chunks``."""
    return _connection(chunks, complete_response).closed


WHOLE = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


def test_a_connection_that_never_sends_a_whole_request_is_closed():
    assert _fire_after()  # nothing at all
    assert _fire_after(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Ty")  # half the headers
    assert _fire_after(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{}")  # a short body


def test_a_whole_request_still_being_answered_is_not_cut_off():
    assert not _fire_after(WHOLE)
    assert not _fire_after(WHOLE[:20], WHOLE[20:])  # arrived in pieces, whole in the end


def test_the_next_request_on_a_kept_alive_connection_owes_its_own_deadline():
    # after the first answer, a second request begun and not finished is closed; one already read whole is not
    assert _fire_after(WHOLE, WHOLE[:30], complete_response=True)
    assert not _fire_after(WHOLE + WHOLE, complete_response=True)  # pipelined: the second read whole


def test_a_request_head_over_the_limit_is_refused_with_a_431():
    limit = serving.MAX_REQUEST_HEAD_BYTES
    big = [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"a" * (limit // 2), b"a" * (limit // 2)]
    seen = _connection(big, fire=False)
    assert seen.closed and seen.written.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert seen.written.endswith(b"\r\n\r\nrequest line and headers over %d bytes together" % limit)
    # a head just under it, sent in pieces, is read; so is a body far over it arriving in the head's own read
    pad = b"a" * (limit - 1000)
    assert not _connection([b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ", pad[:1000], pad[1000:], b"\r\n\r\n"],
                           fire=False).closed  # fmt: skip
    body = b"x" * (2 * limit)
    whole = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    assert not _connection([whole], fire=False).closed
    # and the next head on a kept-alive connection counts from its own start
    assert not _connection([WHOLE, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad[:-200] + b"\r\n\r\n"],
                           complete_response=True, fire=False).closed  # fmt: skip
