"""benchmarks/decode_step.py's floor counts each weight a decode step reads once: the layers keep [in, out] views of
their linears beside the weights, and summing per tensor counted every linear twice (on the H200 the 36-layer
8B-shaped step floor read 7.19 ms where its weights take 3.8 ms, and the prefill FLOPs doubled too)."""

import pytest
import torch
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5
from tests.benchmarks.helpers import load_benchmark

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


@pytest.mark.parametrize("make", [make_tiny_qwen3, make_tiny_qwen3_5], ids=["qwen3", "qwen3.5"])
@pytest.mark.parametrize("prompts", [[32], [20, 12]], ids=["one-request", "two-requests"])
def test_ttft_floor_flops_are_a_real_prefills_matmuls(tmp_path, make, prompts):
    """The time-to-first-token floor's FLOPs against a CPU prefill's weight GEMMs (``aten.mm``, counted by torch):
    the lm_head projects one row per request, not every prompt token (counting it per token put the floor above
    what the prefill computes: 1.4x here, and 0.2 ms of the 36-layer 8B floor on the H200). The floor may exceed
    the GEMMs only by the norm weights it also counts per token."""
    runner = ModelRunner(EngineArgs(model_dir=str(make(tmp_path / "m")), data_type="fp32", device="cpu",
                                    batch_max_tokens=64, max_req_total_len=64, running_max_req_size=2))  # fmt: skip
    slots = [runner.kv.add_request() for _ in prompts]
    with FlopCounterMode(display=False) as counter:
        runner.prefill(slots, [list(range(1, n + 1)) for n in prompts])
    gemm = sum(flops for op, flops in counter.get_flop_counts()["Global"].items() if str(op) == "aten.mm")
    floor = decode_step.ttft_floor_flops(runner.model.w, sum(prompts), requests=len(prompts))
    assert gemm <= floor <= 1.01 * gemm, (floor, gemm)


def test_pdl_ab_alternates_which_graph_goes_first_and_pairs_each_round(monkeypatch):
    """``replay_ab`` times both graphs in every round, the first of a round alternating, and reports the median of
    the rounds' own ratios (a drift between rounds cancels in each pair)."""
    order, clock = [], iter([1.0, 1.1, 2.0, 2.1, 3.0, 2.7, 1.0, 1.2])  # plain, pdl per round (pdl first in odd ones)

    def once(replay, reps=20):
        order.append(replay.__name__)
        return next(clock)

    def plain():
        pass

    def pdl():
        pass

    monkeypatch.setattr(decode_step, "_replay_once", once)
    monkeypatch.setattr(decode_step.torch.cuda, "synchronize", lambda: None)
    got = decode_step.replay_ab(plain, pdl, rounds=4)
    assert order == ["plain", "pdl", "pdl", "plain", "plain", "pdl", "pdl", "plain"]
    assert got["pdl_rounds"] == {"plain": [1.0, 2.1, 3.0, 1.2], "pdl": [1.1, 2.0, 2.7, 1.0]}
    ratios = sorted([1.1 / 1.0, 2.0 / 2.1, 2.7 / 3.0, 1.0 / 1.2])
    assert got["pdl_over_plain"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    assert got["replay_ms"] == pytest.approx(1.65) and got["replay_pdl_ms"] == pytest.approx(1.55)


def test_first_start_modes_begin_with_empty_caches_and_the_shipped_configs(tmp_path, monkeypatch):
    """``first`` / ``first_serial``: level 0 (the shipped configs), an empty config dir and an empty Triton cache, on
    the tuner's compile threads / on one; the tuning modes keep the shared config dir and the caller's Triton cache."""
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_COMPILE_THREADS", "5")  # the caller's choice never reaches a start-up
    monkeypatch.setenv("TRITON_CACHE_DIR", "/caller/triton")
    shared, fresh = str(tmp_path / "shared"), str(tmp_path / "fresh")
    env = {mode: decode_step.startup_env(mode, shared, fresh) for mode in decode_step.STARTUP_MODES}
    assert [env[m]["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] for m in decode_step.STARTUP_MODES] == ["1", "1", "3", "0", "0"]
    for mode in ("cold", "warm", "off"):
        assert env[mode]["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] == shared and env[mode]["TRITON_CACHE_DIR"] == "/caller/triton"
    for mode in ("first", "first_serial"):
        assert env[mode]["LIGHTLLM_AUTOTUNE_CONFIG_DIR"].startswith(fresh)
        assert env[mode]["TRITON_CACHE_DIR"].startswith(fresh)
    assert (
        "LIGHTLLM_AUTOTUNE_COMPILE_THREADS" not in env["first"]
        and "LIGHTLLM_AUTOTUNE_COMPILE_THREADS" not in env["cold"]
    )
    assert env["first_serial"]["LIGHTLLM_AUTOTUNE_COMPILE_THREADS"] == "1"
    with pytest.raises(ValueError, match="start-up mode expected one of"):
        decode_step.startup_env("lukewarm", shared, fresh)
