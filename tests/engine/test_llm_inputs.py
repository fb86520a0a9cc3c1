"""``LLM.generate``'s arguments: a text, token ids (numpy's integers too) or a list of those, and a SamplingParams;
anything else is a ValueError naming what it got, never a traceback from deep inside or a silent misreading (bytes as
ids, floats truncated, bools as 0 and 1)."""

import numpy as np
import pytest
import torch

from lightllm.engine.sampler import SamplingParams
from lightllm.llm import LLM
from lightllm.tools.make_tiny_model import make_tiny_qwen3

ONE = SamplingParams(max_new_tokens=1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=3)
    return LLM(str(model), data_type="fp32", device="cpu", max_req_total_len=64, running_max_req_size=4)


@pytest.mark.parametrize(
    "prompts, ids",
    [
        ([5, 6], [[5, 6]]),
        ((5, 6), [[5, 6]]),
        ([np.int64(5), np.int32(6)], [[5, 6]]),
        ([[5, 6], (7,)], [[5, 6], [7]]),
        ([], []),
    ],
)
def test_token_id_prompts_in_every_accepted_form(llm, prompts, ids):
    assert [out.prompt_token_ids for out in llm.generate(prompts, ONE)] == ids


def test_text_prompts_one_or_many(llm):
    outs = llm.generate(["hello", "the fox"], ONE)
    assert [out.prompt_token_ids for out in outs] == [llm.tokenizer.encode("hello"), llm.tokenizer.encode("the fox")]


@pytest.mark.parametrize(
    "prompts, message",
    [
        (None, "prompts expected a string, a list of token ids or a list of those, got NoneType"),
        (5, "got int"),
        (b"hi", "got bytes"),
        ({"a": 1}, "got dict"),
        (torch.tensor([1, 2]), "got Tensor (a tensor or array: .tolist())"),
        (np.array([1, 2]), "got ndarray"),
        ([1.5, 2.5], "prompt 0 expected a string or a non-empty list of int token ids, got float 1.5"),
        ([[1.9, 2.7]], "prompt 0 expected a string or a non-empty list of int token ids, got list [1.9, 2.7]"),
        ([[True, 7]], "got list [True, 7]"),
        ([[5], ["7"]], "prompt 1 expected a string or a non-empty list of int token ids, got list ['7']"),
        ([[5], []], "prompt 1 expected a string or a non-empty list of int token ids, got list []"),
    ],
)
def test_other_prompts_are_a_value_error_naming_what_they_got(llm, prompts, message):
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, ONE)
    assert message in str(e.value)


def test_sampling_params_must_be_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params expected a SamplingParams or None, got dict"):
        llm.generate("hi", {"max_new_tokens": 2})


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_new_tokens", 0, "max_new_tokens expected a positive integer, got 0"),
        ("top_logprobs", 50, "top_logprobs expected an integer in [0, 20], got 50"),
        ("temperature", -1, "temperature expected a number in [0, 100], got -1"),
    ],
)
def test_sampling_params_changed_after_construction_are_checked_again(llm, field, value, message):
    params = SamplingParams(max_new_tokens=2)
    setattr(params, field, value)
    with pytest.raises(ValueError) as e:
        llm.generate("hi", params)
    assert str(e.value) == message


def test_a_stop_string_set_after_construction_is_one_string_not_its_characters(llm):
    ids = llm.generate([5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    text = llm.tokenizer.decode(ids)
    stop = text[2:4]  # two characters: as a string it stops at both, as its characters at the first of either
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    params.stop = stop
    out = llm.generate([5, 6], params)[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop"


def test_a_stop_token_ends_the_text_before_its_own_unless_asked(llm):
    """vLLM's rule, offline as served: the stop token's text is left out, ``include_stop_str_in_output`` keeps it."""
    ids = llm.generate([5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    at = next(i for i in range(2, 8) if ids[i] not in ids[:i] and llm.tokenizer.decode(ids[i : i + 1]).strip())
    for stop, include in ((), False), (("zz",), False), ((), True), (("zz",), True):
        params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=[ids[at]], stop=stop,
                                include_stop_str_in_output=include)  # fmt: skip
        out = llm.generate([5, 6], params)[0]
        assert out.token_ids == ids[: at + 1] and out.finish_reason == "stop"
        assert out.text == llm.tokenizer.decode(ids[: at + 1 if include else at]), (stop, include)


def test_kv_type_none_is_the_flags_none():
    """The docs list None among llm_kv_type's values (the flag's "None"): Python's None is taken as it."""
    from lightllm.engine.args import EngineArgs

    assert EngineArgs(llm_kv_type=None).normalize().llm_kv_type == "None"


def test_a_folder_without_a_tokenizer_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """As the server checks it: a real model's load, warm-up and graph capture take minutes before such an error."""
    model = make_tiny_qwen3(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    built = []
    monkeypatch.setattr("lightllm.llm.ModelRunner", lambda args: built.append(args))
    with pytest.raises(ValueError, match="no usable tokenizer"):
        LLM(str(model), data_type="fp32", device="cpu")
    assert built == []


def test_a_folder_that_is_no_model_is_named_before_the_tokenizer_is_tried(tmp_path):
    """A missing folder or a hub id is the folder's error at once, not a tokenizer's after network retries."""
    model = make_tiny_qwen3(tmp_path / "m")
    for folder, why in [(tmp_path / "none", "model folder not found"), ("Qwen/Qwen3-0.6B", "model folder not found"),
                        (model / "config.json", "is a file, not a model folder")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{folder}: {why}$"):
            LLM(str(folder), data_type="fp32", device="cpu")
    with pytest.raises(ValueError, match="--data_type expected one of"):  # the options before anything is read
        LLM(str(tmp_path / "none"), data_type="fp33", device="cpu")
