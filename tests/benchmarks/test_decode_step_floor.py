"""benchmarks/decode_step.py's floor counts each weight a decode step reads once: the layers keep [in, out] views of
their linears beside the weights, and summing per tensor counted every linear twice (on the H200 the 36-layer
8B-shaped step floor read 7.19 ms where its weights take 3.8 ms, and the prefill FLOPs doubled too)."""

import pytest
import torch
from safetensors import safe_open

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5
from tests.benchmarks.test_linear_attention_bench import load_benchmark

decode_step = load_benchmark("decode_step")


def _checkpoint_sizes(model_dir):
    """Bytes and elements of every tensor of the checkpoint but the embedding (a step gathers rows of it)."""
    tensors = []
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            tensors += [st.get_tensor(n) for n in st.keys() if "embed_tokens" not in n]
    return sum(t.nbytes for t in tensors), sum(t.numel() for t in tensors)


@pytest.mark.parametrize("make", [make_tiny_qwen3, make_tiny_qwen3_5], ids=["qwen3", "qwen3.5"])
def test_floor_counts_each_weight_once(tmp_path, make):
    model_dir = make(tmp_path / "m")
    runner = ModelRunner(EngineArgs(model_dir=str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64,
                                    max_req_total_len=64, running_max_req_size=2))  # fmt: skip
    w = runner.model.w
    assert w.layers[0].gate_up_t.untyped_storage().data_ptr() == w.layers[0].gate_up_proj.untyped_storage().data_ptr()
    want_bytes, want_params = _checkpoint_sizes(model_dir)
    assert decode_step.step_weight_bytes(w) == want_bytes and decode_step.step_weight_params(w) == want_params > 0
    assert torch.is_tensor(w.lm_head)
