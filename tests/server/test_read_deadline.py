"""The read deadline of the server's HTTP protocol (``serving.ReadTimeoutHttpTools``), driven by hand: what the
deadline does when it fires, at every point of a connection's life, with no clock involved (the end-to-end check
that a real server closes a slow client is test_liveness's)."""

import asyncio

import uvicorn
from uvicorn.server import ServerState

from lightllm.server.serving import ReadTimeoutHttpTools


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data):
        pass

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


def _fire_after(*chunks, complete_response=False):
    """Whether the connection is closed when its deadline fires after the client sent ``chunks``."""

    async def main():
        config = uvicorn.Config(_answering, log_level="warning")
        config.load()
        protocol = ReadTimeoutHttpTools(config=config, server_state=ServerState(), app_state={},
                                        _loop=asyncio.get_running_loop(), read_timeout_s=60.0)  # fmt: skip
        transport = _Transport()
        protocol.connection_made(transport)
        for chunk in chunks:
            protocol.data_received(chunk)
        if complete_response:
            protocol.on_response_complete()
        protocol._read_timed_out()
        closed = transport.closed
        for task in protocol.tasks:
            task.cancel()
        protocol.connection_lost(None)  # (it closes the transport itself)
        return closed

    return asyncio.run(main())


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
