"""What one Qwen3.5 layer runs: the fused kernels' plans made once per forward from its shapes, the kernel path
equal to the torch-reference path over whole forwards, and the launches per layer of each kind counted."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from lightllm import LLM
from lightllm.kernels.kv_cache_write import KVLayers
from lightllm.kernels.linear.reference import mm_on_view
from lightllm.layers.attention import AttentionBackend
from lightllm.layers.linear_attention import LinearAttentionBackend
from lightllm.models.qwen3_5 import model as qwen3_5_model
from lightllm.models.qwen3_5.model import Qwen3_5Model
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5
from tests.models.test_qwen3_layer_ops import (
    OpCounter,
    check_kernel_path_matches_reference,
    check_with_triton_gemv,
    counts_per_depth,
    mock_triton_launches,
    tiny_llm,
)

PLANS = ("RMSNormPlan", "AddRMSNormPlan", "QKNormRopePlan", "SigmoidGatePlan", "GatedRMSNormPlan", "SiluMulPlan")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-ops") / "tiny", seed=5)  # layers: L F L F


def test_layer_ops_are_planned_from_the_step_shapes(monkeypatch):
    """With kernels, one plan per op and forward: the zero-centred norms (float32 ``1 + w``) over the step's tokens
    (the final one over a prefill's output rows), the gated q/k norm + partial rotary over the qkv output (writing a
    float cache's K/V at the step's slots), the output gate over the attention heads, the gated norm over the value
    heads, SiLU * up over this rank's columns."""
    made, qk_kwargs = [], []

    def counting(name):
        real = getattr(qwen3_5_model, name)

        class Counting(real):
            def __init__(self, *args, **kwargs):
                made.append((name, args[:4], kwargs.get("gated"), kwargs.get("weight_dtype")))
                if name == "QKNormRopePlan":
                    qk_kwargs.append(kwargs)
                super().__init__(*args, **kwargs)

        return Counting

    for name in PLANS:
        monkeypatch.setattr(qwen3_5_model, name, counting(name))
    d, f16, f32 = 16, torch.float16, torch.float32
    config = SimpleNamespace(rms_norm_eps=1e-6, hidden_size=64, head_dim=d)
    kv_layers = KVLayers(torch.zeros(2, 16, 2, d, dtype=f16), torch.zeros(2, 16, 2, d, dtype=f16))
    model = SimpleNamespace(use_kernels=True, config=config, dtype=f16, heads=4, kv_heads=2, intermediate=48,
                            linear_shape=SimpleNamespace(value_heads=6, value_dim=8), _cos=torch.ones(32, 4, dtype=f16),
                            _sin=torch.zeros(32, 4, dtype=f16), attn=SimpleNamespace(kv_layers=kv_layers),
                            _projection_weights=dict(qkv=torch.empty(192, 64, dtype=f16), in_proj=None,
                                                     o=torch.empty(64, 64, dtype=f16),
                                                     out_proj=torch.empty(64, 48, dtype=f16),
                                                     gate_up=torch.empty(96, 64, dtype=f16),
                                                     down=torch.empty(64, 48, dtype=f16)),
                            w=SimpleNamespace(lm_head=torch.zeros(100, 64, dtype=f16)))  # fmt: skip
    state = SimpleNamespace(positions=torch.arange(3), out_token_idx=torch.arange(3) + 5)
    ops = Qwen3_5Model._plan_ops(model, 3, 3, state)
    assert sorted(made, key=lambda m: m[0]) == [
        ("AddRMSNormPlan", ((3, 64), f16, 1e-6), None, f32),
        ("GatedRMSNormPlan", (3, 6, 8, f16), None, None),
        ("QKNormRopePlan", (3, 4, 2, d), True, f32),
        ("RMSNormPlan", ((3, 64), f16, 1e-6), None, f32),
        ("SigmoidGatePlan", (3, 4, d, f16), None, None),
        ("SiluMulPlan", (3, 48, f16), None, None),
    ]
    assert qk_kwargs[0]["kv_layers"] is kv_layers and qk_kwargs[0]["token_idx"] is state.out_token_idx
    assert ops.final_add_norm == ops.add_norm  # decode: one output row per token
    # each projection a small-M plan of its weight's shape; one no layer holds (None here) runs torch.mm on the view
    assert ops.qkv.__self__.inputs.planned == ((torch.Size((3, 64)), f16), (torch.Size((192, 64)), f16))
    assert ops.out_proj.__self__.inputs.planned == ((torch.Size((3, 48)), f16), (torch.Size((64, 48)), f16))
    assert ops.in_proj is mm_on_view
    logits = ops.logits(torch.ones(3, 64, dtype=f16))  # float32 logits of the 3 output rows
    assert logits.shape == (3, 100) and logits.dtype == f32
    made.clear()
    model.attn.kv_layers = None  # a quantized cache: the backend's write_kv after the q/k kernel
    state = SimpleNamespace(positions=torch.arange(7), out_token_idx=torch.arange(7))
    ops = Qwen3_5Model._plan_ops(model, 7, 2, state)  # a prefill of two requests: the final norm, two rows
    assert [args[0] for name, args, _, _ in made if name == "AddRMSNormPlan"] == [(7, 64), (2, 64)]
    assert "kv_layers" not in qk_kwargs[-1]
    with pytest.raises(ValueError, match=r"qk_norm_rope plan: qkv expected the planned \(7, 192\)"):
        ops.qk_norm_rope_kv(torch.zeros(7, 128, dtype=f16), torch.ones(d), torch.ones(d), 0)  # an ungated width


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("fp16", 2e-2)])
def test_kernel_path_matches_the_reference_path(tiny_dir, dtype, tol):
    check_kernel_path_matches_reference(tiny_llm(tiny_dir, dtype), max_new_tokens=4, tol=tol)


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("fp16", 2e-2)])
def test_kernel_path_with_the_triton_gemv_matches_the_reference_path(tiny_dir, monkeypatch, dtype, tol):
    """Every small-M linear on a Triton config: decode's six projections (both layer kinds) and the logits."""
    check_with_triton_gemv(monkeypatch, tiny_llm(tiny_dir, dtype), tol)


@pytest.mark.parametrize("kv_type", ["None", "int8kv"], ids=["float-kv", "int8-kv"])
def test_launches_per_layer(tiny_dir, monkeypatch, kv_type):
    """The kernel path of one layer of each kind, with every Triton kernel, the attention backend and the
    linear-attention backend mocked (counted, not run). Gated attention: 4 GEMMs, 5 Triton launches (q/k norm +
    partial rotary, which also writes a float cache's K/V; the output gate; two add + norm; SiLU * up) and attention;
    a quantized cache adds its KV write. Gated DeltaNet: 4 GEMMs, 4 Triton launches (the gated norm, two add + norm,
    SiLU * up), the conv and the delta rule. Nothing else: no copy, no elementwise torch op, no transposed weight
    (each linear's ``[in, out]`` view is made at load), and no allocation but the first gated-attention layer's 3
    (q, k and the gate's output: each op's output is allocated once per forward, by the first layer that runs it).
    Counted as differences between forwards of 1, 2 and 3 layers (L, L F, L F L), in prefill and in decode; a change
    that adds a launch, a torch op, a view or an allocation per layer fails here."""
    llm = LLM(str(tiny_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128,
              running_max_req_size=4, llm_kv_type=kv_type)  # fmt: skip
    llm.runner.model.use_kernels = True
    counter = OpCounter()
    launches = Counter()

    def mocked(name, like):
        def run(self, layer, *args):
            launches.update([name])
            counter.active = False  # the mock's own output is not the model's work
            out = None if like is None else torch.empty(args[like].shape, dtype=args[like].dtype)
            counter.active = True
            return out

        return run

    mock_triton_launches(monkeypatch, launches)
    for name, like in (("write_kv", None), ("prefill", 0), ("decode", 0)):
        monkeypatch.setattr(AttentionBackend, name, mocked(name, like))
    for name, like in (("conv_prefill", 0), ("conv_decode", 0), ("delta_prefill", 2), ("delta_decode", 2)):
        monkeypatch.setattr(LinearAttentionBackend, name, mocked(name, like))
    kinds = [lw.kind for lw in llm.runner.model.w.layers[:3]]
    assert kinds == ["linear_attention", "full_attention", "linear_attention"]
    views = {}
    per_depth = counts_per_depth(llm, monkeypatch, counter, launches, (1, 2, 3), views)
    full = {"_qk_norm_rope_kernel": 1, "_sigmoid_gate_mul_kernel": 1, **({"write_kv": 1} if kv_type != "None" else {})}
    # the GEMMs' inputs and the mixers' views of their fused projections (gate; prefill's v; a quantized cache's v)
    separate_write = Counter(slice=1, view=1) if kv_type != "None" else Counter()
    full_views = {
        "prefill": Counter(slice=3, view=4) + separate_write,
        "decode": Counter(slice=2, view=3) + separate_write,
    }
    linear_views = Counter(slice=7, view=5)
    for phase in ("prefill", "decode"):
        mixers = {"full": {**full, phase: 1}, "linear": {"_gated_rmsnorm_kernel": 1, f"conv_{phase}": 1,
                                                         f"delta_{phase}": 1}}  # fmt: skip
        layer_views = {"full": full_views[phase], "linear": linear_views}
        for kind, (fewer, more), empties in (("full", (1, 2), 3), ("linear", (2, 3), 0)):
            (ops1, launches1), (ops2, launches2) = per_depth[fewer, phase], per_depth[more, phase]
            assert ops2 - ops1 == Counter(mm=4, empty=empties) and not ops1 - ops2, (kind, phase)
            kernels = {"_add_rmsnorm_kernel": 2, "_silu_mul_kernel": 1, **mixers[kind]}
            assert launches2 - launches1 == Counter(kernels) and not launches1 - launches2, (kind, phase)
            views1, views2 = views[fewer, phase], views[more, phase]
            assert views2 - views1 == layer_views[kind] and not views1 - views2, (kind, phase, views2 - views1)
