"""A forward on the kernel path allocates its layer ops' outputs once, not once per layer: the Python-side tensor
allocations of a forward are the same at 1 layer and at 3. Kernel launches are no-ops here (the CPU has no GPU;
what is counted is the host code around them), the plans and checks run as on a GPU."""

import dataclasses

import pytest
import torch

from lightllm import LLM
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.layers.infer_state import InferState
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5

_ALLOCATORS = ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like", "ones", "tensor")


def _count_allocations(monkeypatch, run) -> int:
    calls = []
    for name in _ALLOCATORS:
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    try:
        run()
    finally:
        for name in _ALLOCATORS:
            monkeypatch.undo()
    return len(calls)


def _kernel_path(model, monkeypatch):
    monkeypatch.setattr(DirectLaunch, "launch", lambda self, grid, *args, **kwargs: None)
    model.use_kernels = True
    model.attn.on_gpu = True
    if getattr(model, "linear", None) is not None:
        model.linear.on_gpu = True


def _decode_state(runner, slot, batch_len=4):
    i32 = torch.int32
    return InferState(is_prefill=False, b_req_idx=torch.tensor([slot], dtype=i32), req_to_token=runner.kv.table,
                      b_seq_len=torch.tensor([batch_len], dtype=i32), out_token_idx=torch.tensor([9]),
                      positions=torch.tensor([batch_len - 1]), max_len_in_batch=batch_len)  # fmt: skip


def _prefill_state(runner, slot, n=8):
    i32 = torch.int32
    return InferState(is_prefill=True, b_req_idx=torch.tensor([slot], dtype=i32), req_to_token=runner.kv.table,
                      b_seq_len=torch.tensor([n], dtype=i32), out_token_idx=torch.arange(n), positions=torch.arange(n),
                      max_len_in_batch=n, b_q_start=torch.tensor([0], dtype=i32), b_q_len=torch.tensor([n], dtype=i32),
                      max_q_len=n)  # fmt: skip


def _allocations_by_depth(monkeypatch, llm, phase: str, depths=(1, 3)) -> dict:
    runner = llm.runner
    model = runner.model
    slot = runner.add_request()
    state = _decode_state(runner, slot) if phase == "decode" else _prefill_state(runner, slot)
    ids = torch.tensor([5]) if phase == "decode" else torch.arange(8)
    weights = model.w
    _kernel_path(model, monkeypatch)
    counts = {}
    for depth in depths:
        model.w = dataclasses.replace(weights, layers=weights.layers[:depth])
        with monkeypatch.context() as m:
            counts[depth] = _count_allocations(m, lambda: model.forward(ids, state))
    return counts


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_qwen3_layers_allocate_no_outputs_of_their_own(tmp_path, monkeypatch, phase):
    model_dir = make_tiny_qwen3(tmp_path / "tiny", num_hidden_layers=3, head_dim=64, seed=1)  # a GPU head_dim
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64,
              running_max_req_size=2)  # fmt: skip
    counts = _allocations_by_depth(monkeypatch, llm, phase)
    assert counts[3] == counts[1], counts


def test_qwen3_5_decode_layers_allocate_no_outputs_of_their_own(tmp_path, monkeypatch):
    kinds = ("linear_attention", "full_attention", "linear_attention", "full_attention")
    model_dir = make_tiny_qwen3_5(tmp_path / "tiny", layer_types=kinds, head_dim=64, linear_value_head_dim=16, seed=1)
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64,
              running_max_req_size=2)  # fmt: skip
    counts = _allocations_by_depth(monkeypatch, llm, "decode", depths=(2, 4))  # one layer of each kind, then two
    assert counts[4] == counts[2], counts
