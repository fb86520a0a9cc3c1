"""The served model's id (--model_name) and the /v1/models endpoints, sampling defaults from the model's
generation_config.json, and --eos_id: in-process, over a fake runner (no model forward)."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from lightllm.engine.args import EngineArgs
from lightllm.common.kv_cache import KVCacheManager
from lightllm.server.http_server import Server
from lightllm.server.generation_defaults import read_sampling_defaults
from lightllm.tools.make_tiny_model import make_tiny_qwen3

VOCAB = 8
NEXT = 5  # the token the fake model always predicts


class FakeRunner:
    """Enough of a ModelRunner for the engine: every forward predicts token NEXT."""

    def __init__(self):
        self.args = EngineArgs(batch_max_tokens=64, max_req_total_len=64, running_max_req_size=4)
        self.config = SimpleNamespace(eos_token_ids=(), vocab_size=VOCAB)
        self.device = torch.device("cpu")
        self.kv = KVCacheManager(1000, 4, 64, "cpu")

    def add_request(self, prefix=()):
        return 0

    def free(self, slot, last_token=None):
        pass

    def _logits(self, n):
        logits = torch.zeros(n, VOCAB)
        logits[:, NEXT] = 10.0
        return logits

    def prefill(self, slots, prompts, publish=(), following=()):
        return self._logits(len(slots))

    def decode(self, slots, last_tokens):
        return self._logits(len(slots))


TOKENIZER = SimpleNamespace(eos_token_id=None, decode=lambda ids, **kw: "x" * len(ids))


def make_server(**kwargs):
    """A server over FakeRunner whose submitted requests' sampling parameters land in ``server.submitted``."""
    server = Server(FakeRunner(), TOKENIZER, kwargs.pop("model_name", "org/tiny"), **kwargs)
    server.submitted = []
    submit = server.engine.submit

    def recording_submit(req):
        server.submitted.append(req.params)
        submit(req)

    server.engine.submit = recording_submit
    return server


def test_models_list_and_one_model():
    before = int(time.time())
    server = make_server()
    with TestClient(server.app) as client:
        listed = client.get("/v1/models").json()
        one = client.get("/v1/models/org/tiny")  # an id with a slash, as Hugging Face names go
        other = client.get("/v1/models/org/other")
    (card,) = listed["data"]
    assert listed["object"] == "list"
    assert card == {"id": "org/tiny", "object": "model", "created": card["created"], "owned_by": "lightllm",
                    "max_model_len": 64}  # fmt: skip
    assert before <= card["created"] <= int(time.time())
    assert one.status_code == 200 and one.json() == card
    assert other.status_code == 404
    assert other.json()["error"] == {"message": "model: 'org/other' is not served here; this server serves "
                                     "'org/tiny' (--model_name)", "type": "invalid_request_error",
                                     "code": "model_not_found"}  # fmt: skip


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
], ids=["completions", "chat"])  # fmt: skip
def test_a_request_naming_another_model_is_404_and_nothing_runs(path, body):
    server = make_server()
    with TestClient(server.app) as client:
        r = client.post(path, json={**body, "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'gpt-4o'" in r.json()["error"]["message"]
    assert server.submitted == []


def test_a_request_with_the_served_model_or_none_runs_and_answers_with_the_id():
    server = make_server()
    with TestClient(server.app) as client:
        named = client.post("/v1/completions", json={"model": "org/tiny", "prompt": [1, 2], "max_tokens": 1})
        unnamed = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert named.status_code == 200 and unnamed.status_code == 200
    assert named.json()["model"] == unnamed.json()["model"] == "org/tiny"


def sampling(p):
    return p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty


def test_openai_routes_default_to_the_generation_config_and_a_given_value_wins():
    server = make_server(sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                            "repetition_penalty": 1.05})  # fmt: skip
    with TestClient(server.app) as client:
        for body in ({}, {"temperature": 1.0, "repetition_penalty": 1.0}, {"top_k": 0, "top_p": 1.0, "min_p": 0.0}):
            assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, **body}).status_code == 200
        msgs = [{"role": "user", "content": "hi"}]
        # chat renders its messages through the prompt encoder's tokenizer: a stand-in with a chat template
        server.prompts.tokenizer = SimpleNamespace(apply_chat_template=lambda m, **kw: "hi", encode=lambda t: [1, 2])
        assert client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).status_code == 200
        assert client.post("/generate", json={"inputs": [1, 2], "parameters": {"max_new_tokens": 1}}).status_code == 200
        native = {"max_new_tokens": 1, "do_sample": True, "min_p": 0.1}
        assert client.post("/generate", json={"inputs": [1, 2], "parameters": native}).status_code == 200
    assert [sampling(p) for p in server.submitted] == [
        (0.6, 0.95, 20, 0.05, 1.05),  # nothing given: the file's values
        (1.0, 0.95, 20, 0.05, 1.0),
        (0.6, 1.0, 0, 0.0, 1.05),
        (0.6, 0.95, 20, 0.05, 1.05),  # chat too
        (0.0, 1.0, 0, 0.0, 1.0),  # the native route keeps its greedy default
        (1.0, 1.0, 0, 0.1, 1.0),
    ]


def test_extra_eos_ids_end_a_request():
    plain, with_eos = make_server(), make_server(extra_eos_ids=[NEXT])
    body = {"prompt": [1, 2], "max_tokens": 4, "temperature": 0}
    results = []
    for server in (plain, with_eos):
        with TestClient(server.app) as client:
            results.append(client.post("/v1/completions", json=body).json())
    assert results[0]["choices"][0]["finish_reason"] == "length" and results[0]["usage"]["completion_tokens"] == 4
    assert results[1]["choices"][0]["finish_reason"] == "stop" and results[1]["usage"]["completion_tokens"] == 1


# ---- generation_config.json -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_like(tmp_path_factory):
    """A tiny model whose generation_config.json holds Qwen3's published sampling values."""
    config = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
    }
    return make_tiny_qwen3(tmp_path_factory.mktemp("q"), generation_config=config)


def test_the_model_folder_sampling_values_are_read(qwen3_like):
    assert read_sampling_defaults(qwen3_like) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                  "repetition_penalty": 1.05}  # fmt: skip


def test_a_file_without_sampling_values_sets_none(tmp_path):
    """transformers' own defaults (top_k 50) are not invented for keys the file leaves out."""
    model = make_tiny_qwen3(tmp_path)  # save_pretrained's file: token ids only
    assert "top_k" not in json.loads((model / "generation_config.json").read_text())
    assert read_sampling_defaults(model) == {}
    (model / "generation_config.json").unlink()
    assert read_sampling_defaults(model) == {}


def write(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_do_sample_false_means_greedy(tmp_path):
    assert read_sampling_defaults(write(tmp_path, {"do_sample": False, "temperature": 0.7, "top_k": 5})) == {
        "temperature": 0.0
    }
    greedy_with_penalty = {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.1}
    want = {"temperature": 0.0, "repetition_penalty": 1.1}
    assert read_sampling_defaults(write(tmp_path, greedy_with_penalty)) == want


def test_top_k_minus_one_is_off_as_a_request_may_send_it(tmp_path):
    """vLLM's convention for "no top-k", which a request may send too: the folder is served, with top_k off."""
    assert read_sampling_defaults(write(tmp_path, {"top_k": -1, "temperature": 0.6})) == {
        "top_k": 0,
        "temperature": 0.6,
    }


@pytest.mark.parametrize("config, expected", [
    ({"temperature": -1}, "temperature expected a number in [0, 100], got -1"),
    ({"top_p": 0}, "top_p expected a number in (0, 1], got 0"),
    ({"top_k": 2.5}, "top_k expected an integer >= -1 (-1 and 0: off), got 2.5"),
    ({"top_k": True}, "top_k expected an integer >= -1 (-1 and 0: off), got True"),
    ({"top_k": -2}, "top_k expected an integer >= -1 (-1 and 0: off), got -2"),
    ({"min_p": 1.5}, "min_p expected a number in [0, 1], got 1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty expected a number > 0, got 0"),
], ids=["temperature", "top_p", "top_k float", "top_k bool", "top_k -2", "min_p", "repetition_penalty"])  # fmt: skip
def test_a_value_no_request_could_send_names_the_file_and_key(tmp_path, config, expected):
    path = write(tmp_path, config)
    with pytest.raises(ValueError) as e:
        read_sampling_defaults(path)
    assert str(e.value) == f"{path / 'generation_config.json'}: {expected}"


def test_a_file_that_is_not_json_is_an_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{temperature: 0.6")
    with pytest.raises(ValueError, match="generation_config.json: expected a JSON object"):
        read_sampling_defaults(tmp_path)
