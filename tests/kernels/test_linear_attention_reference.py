"""The gated DeltaNet references against transformers' Qwen3.5 torch functions (the model's own semantics)."""

import pytest
import torch

from lightllm.kernels.linear_attention.reference import (
    causal_conv1d_prefill_ref,
    causal_conv1d_update_ref,
    gated_delta_decode_ref,
    gated_delta_rule_varlen_ref,
    gdn_gates_ref,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
# transformers' own torch code, also when fla-core (or causal-conv1d) is installed: its decorators then route these
# names to those packages, whose signatures differ (fla's fifth positional parameter is gk, not beta).
hf_recurrent_rule = getattr(hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule)
hf_causal_conv1d = getattr(hf.causal_conv1d_fn, "__wrapped__", hf.causal_conv1d_fn)

HK, HV, DK, DV, C, K = 2, 4, 16, 8, 12, 4


def _qkvgb(gen, T):
    q, k = (torch.randn(T, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(T, HV, DV, generator=gen)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    return q, k, v, a, b, A_log, dt_bias


def test_varlen_rule_matches_transformers_recurrent_per_sequence():
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    q, k, v, a, b, A_log, dt_bias = _qkvgb(gen, sum(lens))
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    init = torch.randn(len(lens), HV, DK, DV, generator=gen)
    cu = torch.tensor([0, 5, 6, 15])
    out, finals = gated_delta_rule_varlen_ref(q, k, v, g, beta, cu, init)
    for i in range(len(lens)):
        s, e = int(cu[i]), int(cu[i + 1])
        want, want_state = hf_recurrent_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], initial_state=init[i : i + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[s:e], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(finals[i], want_state[0], rtol=1e-5, atol=1e-5)


def test_decode_updates_only_its_slots_in_place():
    gen = torch.Generator().manual_seed(1)
    q, k, v, a, b, A_log, dt_bias = _qkvgb(gen, 3)
    pool = torch.randn(6, HV, DK, DV, generator=gen)
    before = pool.clone()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    out = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, pool, idx)
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    for i, slot in enumerate(idx.tolist()):
        want, want_state = hf_recurrent_rule(
            q[None, i : i + 1], k[None, i : i + 1], v[None, i : i + 1], g[None, i : i + 1], beta[None, i : i + 1],
            initial_state=before[slot : slot + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[i], want[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], want_state[0], rtol=1e-5, atol=1e-5)
    for untouched in (1, 3, 5):
        assert torch.equal(pool[untouched], before[untouched])


def test_conv_prefill_then_update_match_transformers():
    gen = torch.Generator().manual_seed(2)
    lens = [2, 7]  # one shorter than the kernel: its state is left-padded with zeros
    x = torch.randn(sum(lens), C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    out, states = causal_conv1d_prefill_ref(x, weight, torch.tensor([0, 2, 9]))
    nxt = torch.randn(2, C, generator=gen)
    pool = torch.randn(3, K - 1, C, generator=gen)
    pool[[2, 0]] = states
    y = causal_conv1d_update_ref(nxt, pool, weight, torch.tensor([2, 0], dtype=torch.int32))
    for i, (s, e) in enumerate([(0, 2), (2, 9)]):
        full = torch.cat([x[s:e], nxt[i : i + 1]]).t().unsqueeze(0)  # [1, C, n + 1]
        want = hf_causal_conv1d(full, weight, None, activation="silu")[0].t()
        torch.testing.assert_close(out[s:e], want[:-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y[i], want[-1], rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[2], torch.cat([states[0], nxt[:1]])[1:])
