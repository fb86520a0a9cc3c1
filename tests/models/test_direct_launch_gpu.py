"""Direct launches change nothing a kernel computes: the same prefill and decode steps of a Qwen3 and a Qwen3.5
model (every planned kernel of a step: norms, q/k norm + rotary, the KV write, decode attention, the output gate,
SiLU * up, the conv update, the delta rule, the gated norm) give bit-identical logits, KV cache and linear-attention
state with the direct path on and off, and with it on every launch of a later step is direct."""

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.kernels import direct_launch
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9], [11, 12, 13], [20, 21, 22, 23, 24]]


def _steps(model_dir: str, direct: bool):
    previous = direct_launch.set_enabled(direct)
    try:
        runner = ModelRunner(EngineArgs(model_dir=model_dir, data_type="bf16", device="cuda", running_max_req_size=4,
                                        max_req_total_len=256, batch_max_tokens=64, max_total_token_num=2048,
                                        disable_cudagraph=True, llm_decode_att_backend="triton"))  # fmt: skip
        slots = [runner.add_request() for _ in PROMPTS]
        outs = [runner.prefill(slots, PROMPTS)]
        slow = []
        for step in range(4):
            before = sum(d.slow_launches for d in direct_launch.LAUNCHERS)
            outs.append(runner.decode(slots, [7 + step, 8 + step, 9 + step]))
            torch.cuda.synchronize()
            slow.append(sum(d.slow_launches for d in direct_launch.LAUNCHERS) - before)
        pool = runner.attn.pool
        state = [pool.k.clone(), pool.v.clone()]
        linear = getattr(runner.model, "linear", None)
        if linear is not None:
            state += [linear.state.conv.clone(), linear.state.ssm.clone()]
        return outs, state, slow
    finally:
        direct_launch.set_enabled(previous)


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_direct_launches_are_bit_identical_to_kernel_grid(tmp_path, monkeypatch, family):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "3")  # no tuning: both runs launch the same configs
    if family == "qwen3":
        model_dir = make_tiny_qwen3(tmp_path / "tiny", head_dim=64, num_hidden_layers=3, seed=1, dtype="bfloat16")
    else:
        kinds = ("linear_attention", "full_attention", "linear_attention", "full_attention")
        model_dir = make_tiny_qwen3_5(
            tmp_path / "tiny", layer_types=kinds, head_dim=64, linear_value_head_dim=16, seed=1, dtype="bfloat16"
        )  # head dims the GPU kernels take
    plain_outs, plain_state, _ = _steps(str(model_dir), direct=False)
    direct_outs, direct_state, slow = _steps(str(model_dir), direct=True)
    assert slow[-1] == 0, slow  # a later step's launches all went direct
    for i, (a, b) in enumerate(zip(plain_outs, direct_outs)):
        assert torch.equal(a, b), f"step {i}"
    for a, b in zip(plain_state, direct_state):
        assert torch.equal(a, b)
