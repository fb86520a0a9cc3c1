"""How the MTP verify kernel of the gated delta rule is tuned: in the DECODE_ATTENTION phase, keyed by query tokens
rounded up to a multiple of 4 * (N + 1), timed on a dummy state pool; the caller's pool is never launched on by a
search, never cloned, and only the call itself writes it."""

import json

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, store
from lightllm.common.autotuner.keys import freeze
from lightllm.common.autotuner.tuner import kernel_names
from lightllm.kernels.linear_attention import gated_delta_verify as gdv
from lightllm.kernels.linear_attention.gated_delta_verify import gated_delta_verify

from tests.kernels.test_linear_attention_kernels import Recorder
from tests.kernels.test_linear_attention_verify import DEVICE, DK, DV, check_verify, make_verify
from tests.kernels.test_linear_attention_verify import verify_reference as reference

TUNED = gdv._launch_gated_delta_verify


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    TUNED.clear_cache()
    yield
    TUNED.clear_cache()


def bits(t):
    """The tensor's bytes: equal even where it holds NaN (untouched destination slots do)."""
    return t.contiguous().view(torch.uint8)


def test_declared_as_decode_attention_keyed_by_rounded_query_tokens():
    assert "gated_delta_verify" in kernel_names(AutotuneKernelType.DECODE_ATTENTION)
    assert TUNED.warmup_all_exist_config is False
    assert TUNED.rebuild_input_func is gdv._dummy_verify_batch
    # (batch, N + 1) -> query tokens rounded up to a multiple of 4 * (N + 1)
    cases = {(1, 2): 8, (4, 2): 8, (5, 2): 16, (3, 4): 16, (16, 4): 64, (17, 4): 80, (0, 3): 0}
    assert {shape: gdv.verify_run_key(*shape) for shape in cases} == cases
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(3, 6)
    assert gdv._run_key(q) == 12
    assert gdv._static_key(q, v, pool.bfloat16()) == {
        "v_heads": 6, "group": 3, "head_k_dim": 16, "head_v_dim": 32, "tokens_per_request": 3,
        "dtype": "torch.float32", "state_dtype": "torch.bfloat16",
    }  # fmt: skip
    big = torch.empty(1, 4, 16, 128, device="meta"), torch.empty(1, 4, 48, 128, device="meta")
    assert {"BV": 128, "num_warps": 4} in gdv._configs(*big) and {"BV": 128, "num_warps": 2} not in gdv._configs(*big)


def test_dummy_batch_is_the_run_keys_batch_on_a_fresh_pool_apart_from_its_sources():
    """Rebuilt at the run key's batch (5 requests -> 8), the caller's rows repeated; a new pool, one source slot
    per request apart from the destinations; launching it twice computes the same (nothing to restore)."""
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(3, 4, batch=5, seed=2)
    out = torch.empty(v.shape)
    named = TUNED.named_arguments((q, k, v, a, b, A_log, dt_bias, pool, src, dst, out), {})
    rng = torch.random.get_rng_state()
    dummy = gdv._dummy_verify_batch(named)
    assert torch.equal(torch.random.get_rng_state(), rng)  # its own generator
    assert dummy["q"].shape == (8, 3, 2, DK) and dummy["out"].shape == (8, 3, 4, DV)
    assert torch.equal(dummy["v"][5:], v[:3]) and torch.equal(dummy["a"][:5], a)
    d_pool, d_src, d_dst = dummy["ssm_state"], dummy["src_idx"], dummy["dst_idx"]
    assert d_pool.shape == (8 * 4, 4, DK, DV) and d_pool.data_ptr() != pool.data_ptr()
    assert sorted(d_dst.flatten().tolist() + d_src.tolist()) == list(range(32))
    assert d_dst.dtype == d_src.dtype == torch.int32 and d_dst.shape == (8, 3)
    first = TUNED.fn(**dummy).clone()
    assert not first.isnan().any()
    assert torch.equal(TUNED.fn(**dummy), first)


def recorder(monkeypatch, fastest):
    """Every launch as (pool, config)."""
    return Recorder(monkeypatch, fastest, tuned=TUNED, slots=())


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state-fp32", "state-bf16"])
def test_forced_search_leaves_the_real_pool_bit_identical(monkeypatch, isolated_autotune, state_dtype):
    """Level 2 (force) in the DECODE_ATTENTION scope: planning with the real arguments searches every candidate on
    the dummy pool; the real pool is bit-identical afterwards, never launched on nor cloned. The plan's run then
    launches once on it with the winner, which is stored under the rounded run key and reused at level 0."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "2")
    fastest = {"BV": 16, "num_warps": 2}
    monkeypatch.setattr(TUNED, "configs_gen_func", lambda q, v: [{"BV": 32, "num_warps": 1}, fastest])
    rec = recorder(monkeypatch, fastest)
    inputs = make_verify(4, 4, state_dtype, src_in_dst=True, seed=7)
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = inputs
    before = pool.clone()
    ref_out, ref_pool = reference(*inputs)
    out = torch.full(v.shape, float("nan"), device=DEVICE)
    args = (q, k, v, a, b, A_log, dt_bias, pool, src, dst, out)
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        plan = TUNED.plan(*args)
        assert torch.equal(bits(pool), bits(before)), "the search changed the real state pool"
        assert rec.on(pool) == [] and rec.cloned == []
        assert len(rec.launches) == 3 * 2 * 2  # default + 2 candidates, each an eager run and a timed run, all re-timed
        assert all(launched.shape[0] == 4 * 5 for launched, _ in rec.launches)  # 4 requests (3 rounded up), 5 slots
        plan.run(*args)
    assert rec.on(pool) == [(pool, fastest)]
    check_verify(out, pool, before, ref_out, ref_pool, dst)
    (path,) = store.iter_config_files(isolated_autotune, "gated_delta_verify")
    assert json.loads(path.read_text())["configs"] == {"16": fastest}

    TUNED.clear_cache()
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    rec.launches.clear()
    gated_delta_verify(q[:2], k[:2], v[:2], a[:2], b[:2], A_log, dt_bias, pool, src[:2], dst[:2])  # key 16 too
    assert [config for _, config in rec.launches] == [fastest]


def test_a_call_in_the_scope_writes_the_real_pool_once(monkeypatch, isolated_autotune):
    """The public function at level 1 inside the scope: search on the dummy, then the one launch of the call."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    fastest = {"BV": 8, "num_warps": 1}
    monkeypatch.setattr(TUNED, "configs_gen_func", lambda q, v: [fastest])
    rec = recorder(monkeypatch, fastest)
    inputs = make_verify(2, 2, seed=9)
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = inputs
    before = pool.clone()
    ref_out, ref_pool = reference(*inputs)
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        out = gated_delta_verify(*inputs)
    assert rec.on(pool) == [(pool, fastest)] and rec.cloned == []
    check_verify(out, pool, before, ref_out, ref_pool, dst)


@pytest.mark.parametrize("phase", [AutotuneKernelType.DECODE_ATTENTION, AutotuneKernelType.GENERAL])
def test_cached_configs_are_not_warmed_on_the_real_pool(monkeypatch, isolated_autotune, phase):
    """In any warm-up scope a kernel with cached configs normally runs each once on the caller's inputs; here that
    would write the real slots again (or clone them), so the call launches once, nothing else."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    inputs = make_verify(3, 2, seed=8)
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = inputs
    cached = {"BV": 16, "num_warps": 1}
    static_key = gdv._static_key(q, v, pool)
    TUNED.store.save(static_key, freeze(static_key), {12: (cached, {}), 24: ({"BV": 32, "num_warps": 2}, {})})
    rec = recorder(monkeypatch, cached)
    before = pool.clone()
    ref_out, ref_pool = reference(*inputs)
    with autotune_warmup(phase):
        out = gated_delta_verify(*inputs)
    check_verify(out, pool, before, ref_out, ref_pool, dst)
    assert rec.launches == [(pool, cached)] and not rec.cloned
