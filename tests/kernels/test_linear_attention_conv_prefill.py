"""The packed prefill conv (``conv1d_prefill``): output and windows against the torch reference, every output
element written, only the requests' slots touched; its argument checks."""

import pytest
import torch

from lightllm.kernels.linear_attention.conv1d_prefill import causal_conv1d_prefill
from lightllm.kernels.linear_attention.reference import causal_conv1d_prefill_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(lens, channels=40, taps=4, dtype=torch.float32, slots=None, continues=None, seed=0, device=DEVICE):
    """x as a view of a wider projection (rows not packed), a random weight and pool, the requests' slots out of
    order, and each token's request and index in it."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    proj = torch.randn(tokens, channels + 9, generator=g).to(dtype)
    x = proj[:, 3 : 3 + channels]
    weight = torch.randn(channels, taps, generator=g).to(dtype)
    pool = torch.randn(len(lens) + 3, taps - 1, channels, generator=g).to(dtype)
    slots = list(range(len(lens)))[::-1] if slots is None else slots
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    offsets = torch.arange(tokens) - cu[seq_ids]
    args = dict(x=x, weight=weight, conv_state=pool, state_idx=torch.tensor(slots, dtype=torch.int32), cu_seqlens=cu,
                seq_ids=seq_ids, offsets=offsets,
                continues=None if continues is None else torch.tensor(continues))  # fmt: skip
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def reference(a):
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    slots = cpu["state_idx"].long()
    init = None
    if cpu["continues"] is not None:
        keep = cpu["continues"][:, None, None]
        init = torch.where(keep, cpu["conv_state"][slots], torch.zeros((), dtype=cpu["conv_state"].dtype))
    out, states = causal_conv1d_prefill_ref(cpu["x"], cpu["weight"], cpu["cu_seqlens"], init)
    pool = cpu["conv_state"].clone()
    pool[slots] = states.to(pool.dtype)
    return out, pool


CASES = {
    "fresh": dict(lens=[1, 2, 9, 37], continues=None),
    "continued-and-fresh": dict(lens=[2, 1, 20, 5], continues=[True, False, True, True]),
    "empty-padding-sequence": dict(lens=[16, 0], continues=[True, False]),
    "one-request-continued": dict(lens=[3], continues=[True]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_output_and_windows_match_the_reference(case, dtype):
    a = make(**CASES[case], dtype=dtype, seed=len(case))
    want_out, want_pool = reference(a)
    out = torch.full_like(a["x"], float("nan"))  # every element must be written
    got = causal_conv1d_prefill(**a, out=out)
    assert got is out and out.isfinite().all()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), **tol)
    # the windows are copies of inputs: exact, and the slots of no request (the pool's last 3) are untouched
    assert torch.equal(a["conv_state"].cpu(), want_pool)


def test_other_configs_and_kernel_widths_give_the_same_result():
    configs = ((2, {"BLOCK_T": 32, "BLOCK_C": 16, "num_warps": 2}), (4, {"BLOCK_T": 16, "BLOCK_C": 64, "num_warps": 4}))
    for taps, cfg in configs:
        a = make([5, 1, 19], channels=40, taps=taps, continues=[True, True, False], seed=taps)
        want_out, want_pool = reference(a)
        out = causal_conv1d_prefill(**a, run_config=cfg)
        torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-5)
        assert torch.equal(a["conv_state"].cpu(), want_pool)


def test_a_window_longer_than_the_request_keeps_the_old_inputs_it_still_holds():
    """A one-token continuation: the new window is the old one shifted by one with the token at its end."""
    a = make([1], channels=24, continues=[True])
    slot = int(a["state_idx"][0])
    old = a["conv_state"][slot].clone()
    causal_conv1d_prefill(**a)
    assert torch.equal(a["conv_state"][slot], torch.cat([old[1:], a["x"][:1]]))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(x=torch.zeros(4, 40, dtype=torch.int32)), r"x expected a \[T, channels\] tensor of"),
        (dict(weight=torch.zeros(40, 3)), r"weight expected the planned \(40, 4\) torch.float32, got \(40, 3\)"),
        (dict(conv_state=torch.zeros(5, 3, 41)), r"conv_state expected a \[slots, K - 1 >= 1, 40\] tensor"),
        (dict(seq_ids=torch.zeros(5, dtype=torch.int32)), r"seq_ids expected a contiguous int64 \[7\] tensor"),
        (dict(cu_seqlens=torch.zeros(2, dtype=torch.int64)), r"cu_seqlens expected a contiguous int32 or int64 \[3\]"),
        (dict(continues=torch.ones(2)), r"continues expected a contiguous bool \[2\] tensor, got \(2,\) torch.float32"),
        (dict(run_config={"BLOCK_T": 12, "BLOCK_C": 16, "num_warps": 4}), r"run_config expected a dict with BLOCK_T"),
        (dict(out=torch.zeros(7, 40, dtype=torch.float16)), r"out expected a \(7, 40\) torch.float32 tensor"),
    ],
    ids=["x-dtype", "weight-taps", "state-channels", "seq-ids", "cu-seqlens", "continues", "block-t", "out"],
)
def test_bad_arguments_name_the_argument_and_what_is_allowed(change, message):
    a = make([4, 3], continues=[True, False], device="cpu")
    a.update(change)
    with pytest.raises(ValueError, match=rf"^causal conv1d prefill( plan)?: {message}"):
        causal_conv1d_prefill(**{k: v for k, v in a.items() if k != "run_config" and k != "out"},
                              run_config=a.get("run_config"), out=a.get("out"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_qwen3_5_widths(dtype):
    """Qwen3.5-27B's conv (10240 channels, K = 4), a prefill chunk of 2000 tokens continuing one request beside two
    fresh ones, on the GPU against the CPU reference."""
    a = make([2000, 70, 3], channels=10240, dtype=dtype, continues=[True, False, False], device="cuda")
    want_out, want_pool = reference(a)
    out = torch.full_like(a["x"], float("nan"))
    causal_conv1d_prefill(**a, out=out)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), **tol)
    assert torch.equal(a["conv_state"].cpu(), want_pool)


def test_a_plan_checks_once_and_each_layer_reuses_its_output():
    """Two layers (two pools, two weights) through one plan: each layer's result is the reference's; with
    ``reuse_outputs`` both write one tensor; a layer of another width is refused naming the planned shape."""
    from lightllm.kernels.linear_attention.conv1d_prefill import CausalConv1dPrefillPlan

    a, b = make([6, 3], continues=[True, False], seed=1), make([6, 3], continues=[True, False], seed=2)
    plan = CausalConv1dPrefillPlan(a["x"].shape, a["x"].dtype, a["conv_state"].shape, a["conv_state"].dtype,
                                   a["weight"].dtype, a["state_idx"], a["cu_seqlens"], a["seq_ids"], a["offsets"],
                                   a["continues"], reuse_outputs=True)  # fmt: skip
    outs = []
    for layer in (a, b):
        want_out, want_pool = reference(layer)
        got = plan.run(layer["x"], layer["conv_state"], layer["weight"])
        torch.testing.assert_close(got.cpu(), want_out, rtol=1e-5, atol=1e-5)
        assert torch.equal(layer["conv_state"].cpu(), want_pool)
        outs.append(got)
    assert outs[0] is outs[1]
    with pytest.raises(ValueError, match=r"^causal conv1d prefill plan: x expected the planned \(9, 40\)"):
        plan.run(a["x"][:, :32], a["conv_state"][..., :32], a["weight"][:32])
