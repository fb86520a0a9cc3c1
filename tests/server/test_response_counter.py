"""The HTTP response counter middleware (metrics.ResponseCounter) on a small app of its own, as the server installs it
(outermost, around the body limit, with the server's error handlers)."""

import re

from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, generate_latest

from lightllm.server.http_guards import BadRequest, BodyLimit, install_error_handlers
from lightllm.server.metrics import ResponseCounter


def _app():
    registry = CollectorRegistry()
    counter = Counter("responses", "responses", ["route", "status"], registry=registry)
    app = FastAPI()
    app.add_middleware(BodyLimit, limit=100)
    app.add_middleware(ResponseCounter, counter=counter)
    install_error_handlers(app)

    @app.get("/items/{item_id}")
    async def item(item_id: int):
        if item_id == 0:
            raise BadRequest("item_id: expected a positive id, got 0")
        if item_id == 13:
            raise RuntimeError("a handler's bug")
        return {"id": item_id}

    @app.post("/echo")
    async def echo(body: dict):
        return body

    return app, registry


def _counts(registry) -> dict:
    sample = re.compile(r'^responses_total\{route="(.*?)",status="(\d+)"\} (\S+)$', re.M)
    return {(r, s): float(v) for r, s, v in sample.findall(generate_latest(registry).decode())}


def test_responses_are_counted_by_declared_route_and_status_with_a_bounded_label_set():
    app, registry = _app()
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/items/1").status_code == 200
        assert client.get("/items/2").status_code == 200
        assert client.get("/items/0").status_code == 400
        assert client.get("/items/x").status_code == 400  # a validation error
        assert client.get("/items/13").status_code == 500  # raised past every handler: Starlette's outer 500
        assert client.post("/echo", content=b"{" + b" " * 200 + b"}").status_code == 413  # refused before routing
        assert client.get("/items").status_code == 404
        assert client.get("/" + "x" * 100).status_code == 404
        assert client.delete("/echo").status_code == 405
    assert _counts(registry) == {
        ("/items/{item_id}", "200"): 2,
        ("/items/{item_id}", "400"): 2,
        ("/items/{item_id}", "500"): 1,
        ("/echo", "413"): 1,
        ("other", "404"): 2,
        ("/echo", "405"): 1,
    }
