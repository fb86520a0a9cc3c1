"""Qwen3.5 served from its folder with --tp 2 on the CPU (gloo): linear-attention heads and state split by heads,
the same greedy tokens and logprobs as one process (prefix-cache checkpoints after prompts, at request ends and at a
shared prompt's branch kept alike on every rank); chat through the folder's template."""

import re

import httpx
from server_helpers import assert_generates_like, running_server

from lightllm import LLM, SamplingParams
from lightllm.common import proc as procs
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5


def test_tp2_matches_one_process(tmp_path):
    model = str(make_tiny_qwen3_5(tmp_path / "model", seed=4))  # 2 key / 4 value heads, 4 / 2 attention heads
    args = ["--model_dir", model, "--tp", "2", "--data_type", "fp32", "--device", "cpu", "--batch_max_tokens", "64",
            "--max_req_total_len", "128", "--running_max_req_size", "4"]  # fmt: skip
    shared = list(range(100, 166))  # a 66-token system prompt: over the scheduler's minimum branch (64)
    prompts = [[5, 6, 7, 8, 9], [11], list(range(30, 70)), shared + [1, 2], shared + [3], shared + [4, 5]]
    ref = LLM(model, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128,
              running_max_req_size=4).generate(prompts, SamplingParams(max_new_tokens=8, logprobs=True,
                                                                       ignore_eos=True))  # fmt: skip
    with running_server(tmp_path, args) as base:
        # one at a time: the second shared prompt stops a chunk at the branch (66) and every rank checkpoints its
        # state share there; the third starts from it on every rank
        assert_generates_like(base, prompts, ref)
        body = {"prompt": prompts[-1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        again = httpx.post(base + "/v1/completions", json=body, timeout=procs.HANG_TIMEOUT_S).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared)
        # the chat template comes from the folder's tokenizer
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
        chat = httpx.post(base + "/v1/chat/completions", json=body, timeout=procs.HANG_TIMEOUT_S)
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
    (log,) = tmp_path.glob("server-*.log")
    assert "Traceback" not in log.read_text()


def test_tp2_serves_mtp(tmp_path, monkeypatch):
    """--tp 2 with MTP (the head sharded like the main model, rank 0's drafts and acceptance broadcast): /generate
    gives one process's tokens and logprobs without MTP, and the drafts are accepted (the agreeing head). A
    follow-up that repeats the second prompt and its answer starts from that request's end on both ranks (the
    prefix cache's checkpoint there, the head's KV completed at its end)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores: spinning OpenMP threads starve gloo
    model = str(make_tiny_qwen3_5(tmp_path / "model", mtp="agree", seed=4))
    opts = dict(data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128, running_max_req_size=4)
    args = ["--model_dir", model, "--tp", "2", "--data_type", "fp32", "--device", "cpu", "--batch_max_tokens", "64",
            "--max_req_total_len", "128", "--running_max_req_size", "4", "--mtp_mode", "eagle_with_att",
            "--mtp_step", "2"]  # fmt: skip
    prompts = [[5, 6, 7, 8, 9], list(range(30, 50))]
    ref = LLM(model, **opts).generate(prompts, SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True))
    with running_server(tmp_path, args) as base:
        assert_generates_like(base, prompts, ref)
        follow_up = [prompts[1] + ref[1].token_ids + [60, 61]]
        params = SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
        assert_generates_like(base, follow_up, LLM(model, **opts).generate(follow_up, params))
        metrics = httpx.get(base + "/metrics", timeout=procs.HANG_TIMEOUT_S).text
    cached = re.search(r"^lightllm_prompt_cached_tokens_total (\S+)", metrics, re.M)
    # the second request's KV: its prompt and its tokens but the last (never fed back before it ended)
    assert cached and float(cached.group(1)) == len(prompts[1]) + 8 - 1, metrics[-2000:]
    accepted = re.search(r"^lightllm_spec_decode_num_accepted_tokens_total (\S+)", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0, metrics[-2000:]
    (log,) = tmp_path.glob("server-*.log")
    text = log.read_text()
    assert "tensor-parallel workers stopped (2 ranks)" in text and "Traceback" not in text
