"""The body-size limit, driven as ASGI middleware: a body without a Content-Length is refused as soon as the
bytes received pass the limit, and a body within it reaches the app whole."""

import asyncio
import json

import pytest

from lightllm.server.http_guards import BodyLimit


def run(limit, chunks, headers=()):
    """Send ``chunks`` (then a disconnect) through BodyLimit: (what the app received, what was sent back, the
    messages BodyLimit left unread)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    messages.append({"type": "http.disconnect"})
    received, sent, app_got = list(messages), [], []

    async def receive():
        return received.pop(0)

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        app_got.append(await receive())
        app_got.append(await receive())

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": list(headers)}
    asyncio.run(BodyLimit(app, limit)(scope, receive, send))
    return app_got, sent, received


def test_a_streamed_body_over_the_limit_is_refused_without_reading_the_rest():
    app_got, sent, unread = run(250, [b"x" * 100] * 5)
    assert app_got == [] and len(unread) == 3  # never parsed; the last two chunks and the disconnect unread
    assert sent[0]["status"] == 413
    error = json.loads(sent[1]["body"])["error"]
    assert error == {"message": "body: 300 bytes received so far, more than --max_request_body_bytes (250)",
                     "type": "invalid_request_error", "code": 413}  # fmt: skip


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read():
    app_got, sent, unread = run(250, [b"x" * 10], headers=[(b"content-length", b"1000")])
    assert app_got == [] and sent[0]["status"] == 413 and len(unread) == 2  # not one message read
    assert (
        json.loads(sent[1]["body"])["error"]["message"] == "body: 1000 bytes, more than --max_request_body_bytes (250)"
    )


def test_a_body_within_the_limit_reaches_the_app_whole_then_the_clients_own_messages():
    app_got, sent, _ = run(250, [b"x" * 100, b"y" * 150])
    assert app_got == [{"type": "http.request", "body": b"x" * 100 + b"y" * 150, "more_body": False},
                       {"type": "http.disconnect"}]  # fmt: skip
    assert sent == []


def test_the_body_limit_flag(capsys):
    from lightllm.server.args import parse_args

    assert parse_args(["--device", "cpu", "--max_request_body_bytes", "1000"])[0].max_request_body_bytes == 1000
    assert parse_args(["--device", "cpu"])[0].max_request_body_bytes == 4 << 20
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--device", "cpu", "--max_request_body_bytes", "0"])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --max_request_body_bytes expected a positive integer, got 0"]


def test_an_unhandled_error_is_a_500_in_the_error_shape():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from lightllm.server.http_guards import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise KeyError("oops")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal error (KeyError); the server log has the details",
                                  "type": "server_error", "code": 500}}  # fmt: skip
