"""The engine against transformers' Qwen3ForCausalLM on tiny random models: greedy tokens and logprobs."""

import pytest
import torch

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), num_hidden_layers=2, seed=3))


def hf_greedy(model_dir, prompt, steps, dtype, device):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids).logits[0, -1].float()
            tok = int(logits.argmax())
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            ids = torch.cat([ids, torch.tensor([[tok]], device=device)], dim=1)
    return tokens, logprobs


def test_cpu_fp32_greedy_matches_transformers(tiny_dir):
    llm = LLM(tiny_dir, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128,
              running_max_req_size=4)  # fmt: skip
    prompts = [[5, 17, 42, 7, 99, 3], [11, 12, 13], list(range(20, 45))]
    params = SamplingParams(max_new_tokens=10, logprobs=True, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(tiny_dir, prompt, 10, torch.float32, "cpu")
        assert out.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) <= 1e-4
        assert out.finish_reason == "length"
    assert llm.runner.kv.num_free_slots == llm.runner.args.running_max_req_size  # all freed but the pad slot


def test_text_prompts_and_unknown_option(tiny_dir):
    llm = LLM(tiny_dir, data_type="fp32", device="cpu", batch_max_tokens=32, max_req_total_len=64)
    (out,) = llm.generate("hello world", SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
    with pytest.raises(ValueError, match="exceed max_req_total_len 64"):
        llm.generate([list(range(70))], SamplingParams(max_new_tokens=4))
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(tiny_dir, graph_size=3)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, kv_type", [("triton", "None"), ("triton", "int8kv"), ("triton", "int4kv"),
                                              ("fa3", "None")])  # fmt: skip
def test_gpu_bf16_greedy_close_to_transformers(tiny_dir, backend, kv_type):
    if backend == "fa3":
        from lightllm.kernels.attention.decode.fa3 import find_fa3_provider

        if find_fa3_provider() is None:
            pytest.skip("no FlashAttention-3 provider installed")
    llm = LLM(tiny_dir, data_type="bf16", llm_decode_att_backend=backend, llm_kv_type=kv_type, batch_max_tokens=256,
              max_req_total_len=512, running_max_req_size=8, graph_max_batch_size=8, graph_max_len_in_batch=512,
              max_total_token_num=8192)  # fmt: skip
    prompt = [5, 17, 42, 7, 99, 3, 11, 12]
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True))
    tokens, logprobs = hf_greedy(tiny_dir, prompt, 8, torch.bfloat16, "cuda")
    bound = {"None": 0.05, "int8kv": 0.1, "int4kv": 0.5}[kv_type]  # logprob units; bf16 vs bf16 eager HF
    # Greedy paths may split once bf16 rounding flips a near-tie: compare up to the first divergence.
    same = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), len(tokens))
    assert same >= 1
    assert max(abs(a - b) for a, b in zip(out.logprobs[:same], logprobs[:same])) <= bound
