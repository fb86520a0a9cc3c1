"""What one Qwen3 layer runs: the fused kernels' plans made once per forward from its shapes, the kernel path
equal to the torch-reference path over whole forwards, and the launches per layer counted."""

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

from lightllm import LLM, SamplingParams
from lightllm.kernels.kv_cache_write import KVLayers
from lightllm.layers.attention import AttentionBackend
from lightllm.models.qwen3 import model as qwen3_model
from lightllm.kernels.linear.reference import mm_on_view
from lightllm.kernels.linear.small_m_linear import SmallMLinearPlan
from lightllm.models.qwen3.model import Qwen3Model
from lightllm.tools.make_tiny_model import make_tiny_qwen3

PLANS = ("RMSNormPlan", "AddRMSNormPlan", "QKNormRopePlan", "SiluMulPlan")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3-ops") / "tiny", num_hidden_layers=2, seed=5)


def tiny_llm(model_dir, dtype="fp32"):
    return LLM(str(model_dir), data_type=dtype, device="cpu", batch_max_tokens=64, max_req_total_len=128,
               running_max_req_size=4)  # fmt: skip


def test_layer_ops_are_planned_from_the_step_shapes(monkeypatch):
    """With kernels, one plan per op and forward: hidden-state norms over the step's tokens (the final one over a
    prefill's output rows), q/k norm + rotary over the fused qkv output (writing a float cache's K/V at the step's
    slots), SiLU * up over this rank's columns."""
    made, qk_kwargs = [], []

    def counting(name):
        real = getattr(qwen3_model, name)

        class Counting(real):
            def __init__(self, *args, **kwargs):
                made.append((name, args[:4] if name == "QKNormRopePlan" else args[:2]))
                if name == "QKNormRopePlan":
                    qk_kwargs.append(kwargs)
                super().__init__(*args, **kwargs)

        return Counting

    for name in PLANS:
        monkeypatch.setattr(qwen3_model, name, counting(name))
    d, f32 = 16, torch.float32
    config = SimpleNamespace(rms_norm_eps=1e-6, hidden_size=64, head_dim=d)
    kv_layers = KVLayers(torch.zeros(2, 16, 2, d), torch.zeros(2, 16, 2, d))
    layer = SimpleNamespace(
        qkv_proj=torch.empty(128, 64),
        o_proj=torch.empty(64, 64),
        gate_up_proj=torch.empty(96, 64),
        down_proj=torch.empty(64, 48),
    )
    model = SimpleNamespace(use_kernels=True, config=config, dtype=f32, heads=4, kv_heads=2, intermediate=48,
                            _cos=torch.ones(32, d), _sin=torch.zeros(32, d),
                            attn=SimpleNamespace(kv_layers=kv_layers),
                            w=SimpleNamespace(layers=[layer], lm_head=torch.empty(100, 64)))  # fmt: skip
    state = SimpleNamespace(positions=torch.arange(3), out_token_idx=torch.arange(3) + 5)
    ops = Qwen3Model._plan_ops(model, 3, 3, state)
    assert sorted(made) == [("AddRMSNormPlan", ((3, 64), f32)), ("QKNormRopePlan", (3, 4, 2, d)),
                            ("RMSNormPlan", ((3, 64), f32)), ("SiluMulPlan", (3, 48))]  # fmt: skip
    assert qk_kwargs[0]["kv_layers"] is kv_layers and qk_kwargs[0]["token_idx"] is state.out_token_idx
    assert ops.final_add_norm == ops.add_norm  # decode: one output row per token
    # the four projections and the logits: small-M plans of the step's tokens and each weight's shape (at most 16)
    for op, n, k in ((ops.qkv, 128, 64), (ops.o, 64, 64), (ops.gate_up, 96, 64), (ops.down, 64, 48)):
        assert isinstance(op.__self__, SmallMLinearPlan)
        assert op.__self__.inputs.planned == ((torch.Size((3, k)), f32), (torch.Size((n, k)), f32))
    with pytest.raises(ValueError, match=r"x expected the planned \(3, 64\) torch.float32, got \(3, 100\)"):
        ops.logits(torch.zeros(3, 100))
    assert ops.logits(torch.ones(3, 64)).shape == (3, 100)
    long = SimpleNamespace(positions=torch.arange(17), out_token_idx=torch.arange(17))
    assert Qwen3Model._plan_ops(model, 17, 17, long).qkv is mm_on_view  # above 16 tokens: torch.mm, no plan
    made.clear()
    model.attn.kv_layers = None  # a quantized cache: the backend's write_kv after the q/k kernel
    state = SimpleNamespace(positions=torch.arange(7), out_token_idx=torch.arange(7))
    ops = Qwen3Model._plan_ops(model, 7, 2, state)  # a prefill of two requests: the final norm, two rows
    assert [args for name, args in made if name == "AddRMSNormPlan"] == [((7, 64), f32), ((2, 64), f32)]
    with pytest.raises(ValueError, match=r"qk_norm_rope plan: qkv expected the planned \(7, 128\)"):
        ops.qk_norm_rope_kv(torch.zeros(7, 96), torch.ones(d), torch.ones(d), 0)
    assert "kv_layers" not in qk_kwargs[-1]


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("fp16", 2e-2)])
def test_kernel_path_matches_the_reference_path(tiny_dir, dtype, tol):
    check_kernel_path_matches_reference(tiny_llm(tiny_dir, dtype), max_new_tokens=5, tol=tol)


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("fp16", 2e-2)])
def test_kernel_path_with_the_triton_gemv_matches_the_reference_path(tiny_dir, monkeypatch, dtype, tol):
    """As above with every small-M linear on a Triton config (split K: partials summed by the second kernel): the
    decode steps' four projections per layer and the logits (float32 from the accumulators) run the kernel."""
    check_with_triton_gemv(monkeypatch, tiny_llm(tiny_dir, dtype), tol)


def check_with_triton_gemv(monkeypatch, llm, tol, max_new_tokens=3):
    from lightllm.common.autotuner import FixedPlan
    from lightllm.kernels.linear import small_m_linear

    config = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 4}
    tuner, launch, launched = small_m_linear._launch_small_m_linear, small_m_linear.launch_small_m_linear, Counter()

    def counting(x, w, out, cfg, scratch=None):
        launched.update([out.dtype])
        return launch(x, w, out, cfg, scratch)

    monkeypatch.setattr(tuner, "plan", lambda run_config=None: FixedPlan(tuner, run_config or config))
    monkeypatch.setattr(small_m_linear, "launch_small_m_linear", counting)
    check_kernel_path_matches_reference(llm, max_new_tokens=max_new_tokens, tol=tol)
    assert launched[torch.float32] > 0 and launched[llm.runner.model.dtype] > 0


def check_kernel_path_matches_reference(llm, max_new_tokens, tol):
    """The Triton kernels (interpreted here; the GPU path's code) against the torch references over whole forwards:
    a prefill of three prompts, then decode steps teacher-forced on the reference path's greedy tokens."""
    prompts = [[5, 17, 42, 7, 99, 3], [11, 12, 13], list(range(20, 45))]
    params = SamplingParams(max_new_tokens=max_new_tokens, logprobs=True, ignore_eos=True)
    ref = llm.generate(prompts, params)
    llm.runner.model.use_kernels = True
    fused = llm.generate(prompts, params)
    for a, b in zip(ref, fused):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= tol


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that do work, and apart the views, while ``active``."""

    def __init__(self):
        super().__init__()
        self.ops, self.views, self.active = Counter(), Counter(), True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            (self.views if func.is_view else self.ops)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def mock_triton_launches(monkeypatch, launches: Counter) -> None:
    """Every Triton launch counted by kernel name in ``launches``, not run."""

    def mocked_launch(kernel, grid):
        return lambda *args, **kwargs: launches.update([kernel.fn.__name__])

    monkeypatch.setattr(KernelInterface, "__getitem__", mocked_launch)


def counts_per_depth(llm, monkeypatch, counter: OpCounter, launches: Counter, depths, views=None) -> dict:
    """``(depth, phase) -> (aten ops, launches)`` of a prefill and a decode of one request through the model's
    first ``depth`` layers (the model's ``forward`` counted by ``counter``); the view ops in ``views`` when given."""
    model = llm.runner.model
    real_forward, weights, per_depth = model.forward, model.w, {}

    def counted_forward(input_ids, state):
        with counter:
            return real_forward(input_ids, state)

    monkeypatch.setattr(model, "forward", counted_forward)
    for depth in depths:
        model.w = dataclasses.replace(weights, layers=weights.layers[:depth])
        for phase in ("prefill", "decode"):
            counter.ops.clear(), counter.views.clear(), launches.clear()
            slot = llm.runner.add_request()
            llm.runner.prefill([slot], [[5, 17, 42]]) if phase == "prefill" else llm.runner.decode([slot], [7])
            llm.runner.free(slot)
            per_depth[depth, phase] = (Counter(counter.ops), Counter(launches))
            if views is not None:
                views[depth, phase] = Counter(counter.views)
    return per_depth


def test_launches_per_layer(tiny_dir, monkeypatch):
    """The kernel path of one layer, with every Triton kernel and the attention backend mocked (counted, not run):
    4 GEMMs, 4 Triton launches (q/k norm + rotary writing the float KV cache too, two add + norm, SiLU * up) and
    attention, and no allocation (the kernels' outputs are allocated once per forward, by its first layer). The
    views are the GEMMs' inputs: attention's output flattened, and in prefill v's columns of qkv (the weights'
    transposes are made once, at load). Counted as the difference between a 2-layer and a 1-layer forward, in
    prefill and in decode; a change that adds a launch, a torch op, a view or an allocation per layer fails here."""
    llm = tiny_llm(tiny_dir)
    llm.runner.model.use_kernels = True
    counter = OpCounter()
    launches = Counter()

    def mocked_attention(name):
        def run(self, layer, *args):
            launches.update([name])
            counter.active = False  # the mock's own output is not the model's work
            out = torch.empty_like(args[0]) if name != "write_kv" else None
            counter.active = True
            return out

        return run

    mock_triton_launches(monkeypatch, launches)
    for name in ("write_kv", "prefill", "decode"):
        monkeypatch.setattr(AttentionBackend, name, mocked_attention(name))
    views = {}
    per_depth = counts_per_depth(llm, monkeypatch, counter, launches, (1, 2), views)
    for phase in ("prefill", "decode"):
        (ops1, launches1), (ops2, launches2) = per_depth[1, phase], per_depth[2, phase]
        assert ops2 - ops1 == Counter(mm=4) and not ops1 - ops2, phase
        layer_views = Counter(view=2, slice=1) if phase == "prefill" else Counter(view=1)
        assert views[2, phase] - views[1, phase] == layer_views and not views[1, phase] - views[2, phase], phase
        kernels = {"_qk_norm_rope_kernel": 1, "_add_rmsnorm_kernel": 2, "_silu_mul_kernel": 1, phase: 1}
        assert launches2 - launches1 == Counter(kernels) and not launches1 - launches2, phase
