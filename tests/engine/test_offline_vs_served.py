"""``LLM`` and the HTTP server run the same engine: the same prompts and parameters give the same tokens, text and
finish reasons offline and served, for a request ended by the tokenizer's EOS, one ended by a stop string, and
seeded sampling (prompt ``i`` of an offline list with seed ``s`` is the served request with seed ``s + i``)."""

import json
import shutil

import httpx
import pytest

from lightllm.common import proc as procs
from lightllm.engine.sampler import SamplingParams
from lightllm.llm import LLM
from lightllm.tools.make_tiny_model import make_tiny_qwen3
from tests.server.server_helpers import running_server

OPTIONS = dict(data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64, running_max_req_size=4)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with its tokenizer's EOS (not the config's) set to a token greedy decoding of PROMPTS[0]
    produces at its fourth step or later: a request can end on the tokenizer's EOS alone."""
    home = tmp_path_factory.mktemp("model")
    model = make_tiny_qwen3(home / "base", seed=5)
    greedy = LLM(str(model), **OPTIONS).generate(PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True))
    ids = greedy[0].token_ids
    eos = next(t for k, t in enumerate(ids) if k >= 3 and t not in ids[:k])
    out = home / "eos"
    shutil.copytree(model, out)
    from transformers import AutoTokenizer

    name = AutoTokenizer.from_pretrained(model).convert_ids_to_tokens(eos)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["eos_token"] = name
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert json.loads((out / "config.json").read_text())["eos_token_id"] != eos
    assert AutoTokenizer.from_pretrained(out).eos_token_id == eos
    return str(out), eos


@pytest.fixture(scope="module")
def both(model_dir, tmp_path_factory):
    """(LLM, the served base URL) on the same model and engine options."""
    path, _ = model_dir
    flags = [f"--{k}={v}" for k, v in OPTIONS.items()]
    with running_server(tmp_path_factory.mktemp("server"), ["--model_dir", path, *flags]) as base:
        yield LLM(path, **OPTIONS), base


def served(base, prompt, **parameters):
    r = httpx.post(base + "/generate", json={"inputs": prompt, "parameters": parameters}, timeout=procs.HANG_TIMEOUT_S)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["token_ids"], body["generated_text"][0], body["finish_reason"]


def offline(llm, prompts, **params):
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, SamplingParams(**params))]


def test_the_tokenizers_eos_ends_a_request_offline_and_served(both, model_dir):
    llm, base = both
    _, eos = model_dir
    got = offline(llm, [PROMPTS[0]], max_new_tokens=16)[0]
    assert got[0][-1] == eos and len(got[0]) < 16 and got[2] == "stop"
    assert served(base, PROMPTS[0], max_new_tokens=16) == got


def test_a_stop_string_ends_a_request_offline_and_served(both):
    llm, base = both
    whole = offline(llm, [PROMPTS[1]], max_new_tokens=24, ignore_eos=True)[0]
    stop = whole[1][len(whole[1]) // 2 :][:2]  # two characters from the middle of the greedy text
    assert stop.strip(), whole[1]
    got = offline(llm, [PROMPTS[1]], max_new_tokens=24, ignore_eos=True, stop=[stop])[0]
    assert got[2] == "stop" and stop not in got[1] and whole[1].startswith(got[1]) and len(got[0]) < 24
    assert served(base, PROMPTS[1], max_new_tokens=24, ignore_eos=True, stop=[stop]) == got


def test_seeded_sampling_is_the_same_offline_and_served(both):
    llm, base = both
    params = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0)
    got = offline(llm, PROMPTS, seed=1234, **params)
    want = [served(base, p, seed=1234 + i, **params) for i, p in enumerate(PROMPTS)]
    assert got == want
    assert got[0][0] != offline(llm, [PROMPTS[0]], seed=99, **params)[0][0]  # the seed is what decides


def test_a_stop_string_on_the_last_token_leaves_the_next_generate_alone(both):
    """The stop string's abort of a request that also ended by length was left queued; the next call's request
    of the same index took it and ended at once with "stop", no tokens generated."""
    llm, _ = both
    whole = offline(llm, [PROMPTS[1]], max_new_tokens=24, ignore_eos=True)[0]
    stop = whole[1][len(whole[1]) // 2 :][:2]
    cut = offline(llm, [PROMPTS[1]], max_new_tokens=24, ignore_eos=True, stop=[stop])[0]
    last = offline(llm, [PROMPTS[1]], max_new_tokens=len(cut[0]), ignore_eos=True, stop=[stop])[0]
    assert last == cut  # its stop string and its length end on the same token
    assert offline(llm, [PROMPTS[1]], max_new_tokens=24, ignore_eos=True)[0] == whole
