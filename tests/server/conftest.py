"""One server on the built-in tiny model for the whole session: the API tests and the real-client tests share
it (CI is a busy 2-core machine; every start loads the model again)."""

import pytest
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
