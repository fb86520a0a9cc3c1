"""One server on the built-in tiny model for the whole session: the API tests and the real-client tests share
it (CI is a busy 2-core machine; every start loads the model again). Also the in-process ``server`` over the
fake model (``fake_model.py``) and its ``client``, which a test file overrides with its own where it needs another."""

import pytest
from fake_model import make_server
from fastapi.testclient import TestClient
from server_helpers import MAX_BODY, MAX_LEN, MODEL, running_server


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """The base URL of the served tiny model (CPU, float32); stopped with its children at the session's end."""
    home = tmp_path_factory.mktemp("server")
    args = ["--data_type", "fp32", "--device", "cpu", "--batch_max_tokens", "128", "--max_req_total_len", str(MAX_LEN),
            "--running_max_req_size", "8", "--max_request_body_bytes", str(MAX_BODY),
            "--model_name", MODEL, "--reasoning_parser", "qwen3", "--tool_call_parser", "qwen25"]  # fmt: skip
    with running_server(home, args) as base:
        yield base


@pytest.fixture
def server():
    return make_server()


@pytest.fixture
def client(server):
    with TestClient(server.app) as c:
        yield c
