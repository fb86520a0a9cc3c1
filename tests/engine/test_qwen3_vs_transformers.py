"""The engine against transformers' Qwen3ForCausalLM on tiny random models: greedy tokens and logprobs."""

import json

import pytest
import torch

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, make_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), num_hidden_layers=2, seed=3))


@pytest.fixture(scope="module")
def tiny_gpu_dir(tmp_path_factory):
    # the built-in model's shape: head_dim 64, the smallest the GPU kernels take
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-d64"), seed=3, **BUILTIN_SHAPE))


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
        forced, best = forced_scores(llm.runner, prompt, out.token_ids)  # the GPU test's reference path
        assert max(abs(a - b) for a, b in zip(out.logprobs, forced)) <= 1e-5 and forced == best
    assert llm.runner.kv.num_free_slots == llm.runner.args.running_max_req_size  # all freed but the pad slot


def test_tied_config_with_a_different_stored_lm_head_gives_transformers_tokens(tmp_path):
    """tie_word_embeddings: true, but the files hold an lm_head.weight unlike the embedding: transformers projects
    with the stored head ("we will NOT tie them"), and so must the engine."""
    model_dir = make_tiny_qwen3(tmp_path / "model", num_hidden_layers=1, seed=3)  # untied: its own lm_head
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128)
    prompt = [5, 17, 42, 7, 99, 3]
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out.token_ids == hf_greedy(model_dir, prompt, 6, torch.float32, "cpu")[0]


def test_text_prompts_and_unknown_option(tiny_dir):
    llm = LLM(tiny_dir, data_type="fp32", device="cpu", batch_max_tokens=32, max_req_total_len=64)
    (out,) = llm.generate("hello world", SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and isinstance(out.text, str)
    with pytest.raises(ValueError, match="exceed max_req_total_len 64"):
        llm.generate([list(range(70))], SamplingParams(max_new_tokens=4))
    vocab = llm.runner.config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 1: token ids expected in \[0, {vocab}\), got \[{vocab}, -1\]"):
        llm.generate([[5], [3, vocab, -1]], SamplingParams(max_new_tokens=4))
    assert llm.generate([5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].finish_reason == "length"
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(tiny_dir, graph_size=3)


def forced_scores(runner, prompt, tokens):
    """The runner's logprob of each given token after prompt + the tokens before it (teacher-forced), and its
    best logprob there: prefill, then one decode per token, as serving runs them."""
    slot = runner.add_request()
    try:
        logits = [runner.prefill([slot], [prompt])[0].float().cpu()]
        for t in tokens[:-1]:
            logits.append(runner.decode([slot], [t])[0].float().cpu())  # copied out before the next replay
    finally:
        runner.free(slot)
    logprobs = torch.log_softmax(torch.stack(logits), -1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(), logprobs.max(-1).values.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("backend, kv_type", [("triton", "None"), ("triton", "int8kv"), ("triton", "int4kv"),
                                              ("fa3", "None")])  # fmt: skip
def test_gpu_bf16_greedy_close_to_fp32_reference(tiny_gpu_dir, backend, kv_type):
    """GPU bf16 (graphs, Triton or FA3 kernels) against the CPU fp32 engine with the same KV type, which runs the
    torch references (and matches transformers' fp32 to 4e-6 above). Both are teacher-forced on the GPU's
    greedy tokens, so every decode step is compared even where bf16 rounding flips a near-tie.

    The bound is bf16's own error: the CPU engine in bf16 (torch references, no GPU kernels) against the same
    fp32 reference, on the same tokens. On the H200 the two agree closely (None 0.105 vs 0.105, int8kv 0.108 vs
    0.109, int4kv 0.55 vs 0.59): INT4's group scales turn bf16 rounding of K/V into whole quantization steps."""
    check_gpu_bf16_against_cpu_fp32(tiny_gpu_dir, backend, kv_type, "GPU-vs-fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("decode_backend", ["triton", "fa3"])
def test_gpu_fa3_prefill_close_to_fp32_reference(tiny_gpu_dir, decode_backend):
    """--llm_prefill_att_backend fa3 with the prompt in 128-token chunks: the first chunk plain, the later ones over
    their cached prefix (from prefill graphs), then decode; the same bound as the Triton prefill's test above."""
    check_gpu_fa3_prefill(tiny_gpu_dir, decode_backend, "GPU-vs-fp32 FA3 prefill")


def check_gpu_fa3_prefill(model_dir, decode_backend, label):
    from lightllm.kernels.attention.decode.fa3 import find_fa3_provider

    if find_fa3_provider() is None:
        pytest.skip("no FlashAttention-3 provider installed")
    check_gpu_bf16_against_cpu_fp32(model_dir, decode_backend, "None", label, llm_prefill_att_backend="fa3",
                                    chunked_prefill_size=128)  # fmt: skip


def check_gpu_bf16_against_cpu_fp32(model_dir, backend, kv_type, label, **gpu_args):
    """The GPU bf16 engine's logprobs of a 300-token prompt's 9 greedy tokens against the CPU fp32 engine's,
    teacher-forced on them; bound: 1.5 x the CPU bf16 engine's error against the same reference, plus 0.02."""
    if backend == "fa3":
        from lightllm.kernels.attention.decode.fa3 import find_fa3_provider

        if find_fa3_provider() is None:
            pytest.skip("no FlashAttention-3 provider installed")
    opts = dict(llm_kv_type=kv_type, batch_max_tokens=512, max_req_total_len=512, running_max_req_size=8)
    llm = LLM(model_dir, data_type="bf16", llm_decode_att_backend=backend, graph_max_batch_size=8,
              graph_max_len_in_batch=512, max_total_token_num=8192, **gpu_args, **opts)  # fmt: skip
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(0)).tolist()  # several KV blocks
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=9, logprobs=True, ignore_eos=True))
    ref, ref_best = forced_scores(LLM(model_dir, data_type="fp32", device="cpu", **opts).runner, prompt,
                                  out.token_ids)  # fmt: skip
    bf16, _ = forced_scores(LLM(model_dir, data_type="bf16", device="cpu", **opts).runner, prompt, out.token_ids)
    err = max(abs(a - b) for a, b in zip(out.logprobs, ref))
    bf16_err = max(abs(a - b) for a, b in zip(bf16, ref))
    bound = 1.5 * bf16_err + 0.02
    print(f"\n{label} {backend} {kv_type}: max logprob error {err:.4f} (CPU bf16 references {bf16_err:.4f})")
    assert err <= bound, f"max logprob error {err:.4f} > {bound:.4f} (CPU bf16 references: {bf16_err:.4f})"
    assert max(b - a for a, b in zip(ref, ref_best)) <= bound  # each token is the argmax or a near-tie
