"""--tp 2 and 4 on the CPU (gloo): the sharded server generates what one process does, and shuts down cleanly."""

import httpx
import pytest
from server_helpers import running_server

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_one_process(tmp_path, tp):
    heads = 2 * tp  # every rank gets 1 KV head and 2 query heads
    model = str(make_tiny_qwen3(tmp_path / "model", num_attention_heads=heads, num_key_value_heads=tp, seed=4))
    args = ["--model_dir", model, "--tp", str(tp), "--data_type", "fp32", "--device", "cpu", "--batch_max_tokens", "64",
            "--max_req_total_len", "128", "--running_max_req_size", "4"]  # fmt: skip
    prompts = [[5, 6, 7, 8, 9], [11, 3], list(range(30, 50))]
    ref = LLM(model, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128).generate(
        prompts, SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
    )
    with running_server(tmp_path, args) as base:
        for prompt, want in zip(prompts, ref):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "logprobs": True, "ignore_eos": True}}
            got = httpx.post(base + "/generate", json=body, timeout=60).json()
            assert got["token_ids"] == want.token_ids
            assert max(abs(a - b) for a, b in zip(got["logprobs"], want.logprobs)) <= 1e-4
        assert httpx.get(base + "/health").status_code == 200
    # SIGTERM: rank 0 stops the workers and waits for them, so no rank dies on a closed connection
    (log,) = tmp_path.glob("server-*.log")
    text = log.read_text()
    assert f"tensor-parallel workers stopped ({tp} ranks)" in text
    assert "Traceback" not in text


def test_tp_must_divide_heads(tmp_path):
    from lightllm.engine.parallel import check_divisible
    from lightllm.models.qwen3.config import Qwen3ModelConfig

    model = make_tiny_qwen3(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    cfg = Qwen3ModelConfig.from_model_dir(model)
    check_divisible(cfg, 2)
    with pytest.raises(ValueError, match="--tp 4: the model's num_key_value_heads \\(2\\) is not divisible"):
        check_divisible(cfg, 4)
