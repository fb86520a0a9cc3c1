"""Every Triton kernel the CPU tests launch must also compile (AST -> TTIR for sm90, and one launch per kernel,
constexprs and options to an sm_90 cubin that fits in an H200 block's shared memory), not only run in the
interpreter: see tests/ttir_lowering.py for how launches are recorded and lowered, docs/testing.md for what the
check catches and what it does not."""

import dataclasses
import time
from typing import Dict, Tuple

import pytest
import torch

from lightllm.kernels.launch_math import SM90_MAX_SHARED_BYTES
from tests import ttir_lowering, ttir_lowering_samples as samples

pytestmark = pytest.mark.skipif(
    not ttir_lowering.interpreting(), reason="without the interpreter every launch compiles for the GPU anyway"
)

# Entry kernels no CPU test launches, (module, kernel) -> why. Empty today: every one is launched. The check fails
# when a kernel listed here starts being launched or disappears, so the list cannot go stale.
NOT_LAUNCHED_ON_CPU: Dict[Tuple[str, str], str] = {}


def _launch_sample(kernel, quant, group):
    x, s = torch.arange(16, dtype=torch.float32), torch.full((8,), 2.0)
    out = torch.full_like(x, float("nan"))
    kernel[(1,)](x, s, out, BLOCK=16, GROUP=group, QUANT=quant)
    return x, out


def test_lowering_catches_an_error_the_interpreter_hides():
    with ttir_lowering.recording() as recorder:
        x, out = _launch_sample(samples.early_return_kernel, quant=0, group=0)
        _launch_sample(samples.early_return_kernel, quant=8, group=4)
    assert torch.equal(out, x)  # the interpreter ran QUANT=0 fine

    results = {r.launch.constexprs: r for r in ttir_lowering.lower(list(recorder.launches))}
    bad = results[(("BLOCK", 16), ("GROUP", 0), ("QUANT", 0))]
    assert bad.error is not None and bad.error.startswith("ZeroDivisionError")
    assert "early_return_kernel(BLOCK=16, GROUP=0, QUANT=0)" in bad.launch.describe()
    assert results[(("BLOCK", 16), ("GROUP", 4), ("QUANT", 8))].error is None


def test_one_return_after_the_constexpr_branch_lowers():
    with ttir_lowering.recording() as recorder:
        x, out = _launch_sample(samples.one_return_kernel, quant=0, group=0)
    assert torch.equal(out, x)
    [result] = ttir_lowering.lower(list(recorder.launches))
    assert result.error is None


def test_arguments_are_typed_as_triton_specializes_them():
    x = torch.zeros(32, dtype=torch.float16)
    with ttir_lowering.recording() as recorder:
        for _ in range(2):  # the same specialization twice: one launch, counted twice
            samples.typed_args_kernel[(1,)](x, x, 32, 2**40 + 3, 1, 0.5, None, BLOCK=32, num_warps=2)
        samples.typed_args_kernel[(1,)](x[1:], x, 5, 7, 1, 0.5, None, BLOCK=32)
    (first, count), (second, _) = recorder.launches.items()
    assert count == 2 and not recorder.failures
    assert dict(first.signature) == {"X": "*fp16", "Out": "*fp16", "n": "i32", "big": "i64", "one": "constexpr",
                                     "scale": "fp32", "Absent": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
    assert first.constexprs == (("one", 1), ("Absent", None), ("BLOCK", 32))
    assert first.specialized == ("one", "Absent")  # Triton's constants, not the kernel's declared constexprs
    aligned = (("tt.divisibility", 16),)
    assert dict(first.attrs) == {"X": aligned, "Out": aligned, "n": aligned, "big": ()}  # 2**40 + 3 is odd
    assert first.options == (("num_warps", 2),)
    assert dict(second.attrs) == {"X": (), "Out": aligned, "n": (), "big": ()}  # x[1:] is 2-byte aligned
    assert [r.error for r in ttir_lowering.lower([first, second])] == [None, None]


def _tiled_dot(block_k, num_stages):
    a, b = torch.randn(64, 256, dtype=torch.float16), torch.randn(256, 64, dtype=torch.float16)
    c = torch.full((64, 64), float("nan"))
    samples.tiled_dot_kernel[(1,)](a, b, c, 256, BLOCK=64, BLOCK_K=block_k, num_stages=num_stages)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-3, atol=1e-3)


def test_cubin_stage_reports_a_kernel_that_needs_more_shared_memory_than_an_sm90_block():
    with ttir_lowering.recording() as recorder:
        _tiled_dot(block_k=32, num_stages=2)
        _tiled_dot(block_k=256, num_stages=4)  # 4 stages x (64x256 + 256x64) fp16 tiles = 256 KiB
    small, big = recorder.launches
    assert [r.error for r in ttir_lowering.lower([small, big])] == [None, None]  # the frontend sees no problem

    fits, too_big = ttir_lowering.build_cubins([small, big])
    assert fits.error is None and 0 < fits.shared_bytes <= SM90_MAX_SHARED_BYTES
    assert too_big.shared_bytes > SM90_MAX_SHARED_BYTES
    assert too_big.error.startswith(f"needs {too_big.shared_bytes} bytes of shared memory per block, more than the "
                                    f"{SM90_MAX_SHARED_BYTES} (227 KiB)")  # fmt: skip
    assert "tiled_dot_kernel(BLOCK=64, BLOCK_K=256) [num_stages=4]" in too_big.launch.describe()


def test_cubin_stage_reports_what_ptxas_rejects():
    recorder = ttir_lowering.LaunchRecorder()  # recorded, not run: the interpreter has no PTX to execute
    recorder.record(samples.bad_ptx_kernel, (torch.zeros(128, dtype=torch.int32),), {"BLOCK": 128})
    [launch] = recorder.launches
    assert ttir_lowering.lower([launch])[0].error is None
    [built] = ttir_lowering.build_cubins([launch])
    assert built.error.startswith("PTXASError") and "Unknown modifier '.such'" in built.error, built.error
    assert built.shared_bytes is None


def test_one_cubin_per_kernel_options_and_code_path_at_its_biggest_tiles():
    x, s = torch.zeros(32), torch.ones(8)
    recorder = ttir_lowering.LaunchRecorder()

    def record(block, group, quant, x=x, **options):
        recorder.record(samples.early_return_kernel, (x, s, x), dict(BLOCK=block, GROUP=group, QUANT=quant, **options))
        return list(recorder.launches)[-1]

    off = record(16, 0, 0)  # integers equal to zero switch a path off
    record(16, 4, 8)
    biggest = record(32, 4, 8)
    record(32, 4, 8, x=x.half())  # another dtype at the same tiles: the first of equals is built
    record(16, 2, 4)
    warps = record(16, 4, 8, num_warps=2)
    assert len(recorder.launches) == 6
    assert ttir_lowering.representatives(list(recorder.launches)) == [off, biggest, warps]

    strides = ttir_lowering.LaunchRecorder()
    y = torch.zeros(32, dtype=torch.float16)
    for one, absent in ((1, None), (3, None), (1, y)):
        strides.record(samples.typed_args_kernel, (y, y, 32, 7, one, 0.5, absent), {"BLOCK": 32})
    unit, other, present = strides.launches
    assert unit.specialized == ("one", "Absent") and other.specialized == ("Absent",)
    # an int Triton specialized to 1 (a stride of 1) is the data's, built with its other values; None picks a path
    assert ttir_lowering.representatives([unit, other, present]) == [unit, present]


def test_the_short_prefill_fla_kernel_builds_for_sm90_at_qwen3_5_widths():
    """fla-core's fused recurrent gated delta rule as the linear-attention backend's short prefill launches it
    (``layers/linear_attention.py``, ``_fla_recurrent``), from zero and from initial states: recorded from a small
    interpreted run, then built for sm_90 with bf16 inputs at Qwen3.5-27B's widths (16 key heads, 48 value heads,
    head dims 128). The whole-suite checks build lightllm's own kernels only."""
    from lightllm.layers import linear_attention as la

    tokens, g = 3, torch.Generator().manual_seed(0)
    q, k = (torch.randn(tokens, 1, 16, generator=g).half() for _ in range(2))
    v = torch.randn(tokens, 2, 16, generator=g).half()
    decay, beta = -torch.rand(tokens, 2, generator=g), torch.rand(tokens, 2, generator=g).half()
    cu = torch.tensor([0, 1, tokens])
    plan = la.LinearAttentionPlan(torch.arange(2, dtype=torch.int32), cu, cu, max_q_len=2)
    with ttir_lowering.recording() as recorder:
        for init in (None, torch.zeros(2, 2, 16, 16)):
            la._fla_recurrent(q, k, v, decay, beta, plan, init)
    widths = {"H": 16, "HV": 48, "K": 128, "V": 128, "BK": 128}

    def at_widths(launch):
        return dataclasses.replace(
            launch,
            signature=tuple((n, t.replace("fp16", "bf16")) for n, t in launch.signature),
            constexprs=tuple((n, widths.get(n, c)) for n, c in launch.constexprs),
        )

    launches = [at_widths(launch) for launch in recorder.launches]
    assert [launch.name for launch in launches] == ["fused_recurrent_gated_delta_rule_fwd_kernel"] * 2
    built = ttir_lowering.build_cubins(launches)
    assert [b.error for b in built] == [None, None]


def test_kernel_enumeration_tells_entry_kernels_from_helpers():
    functions = ttir_lowering.jit_functions()
    entries = ttir_lowering.entry_kernels(functions)
    stage1 = ("lightllm.kernels.attention.decode.stage1", "decode_stage1_kernel")
    block = ("lightllm.kernels.attention.decode.stage1", "_attend_block")
    assert stage1 in entries
    assert block in functions[stage1]  # direct callees: the block's helpers are the block's own
    assert ("lightllm.kernels.attention.decode.stage1", "_load_kv_halves") in functions[block]
    assert ("lightllm.kernels.attention.decode.splits", "split_tokens") in functions[stage1]
    assert block not in entries and ("lightllm.kernels.attention.decode.stage1", "_load_kv_halves") not in entries


@pytest.mark.last
def test_every_kernel_launch_of_the_session_lowers_for_sm90(session_launches):
    launches = [launch for launch in session_launches.launches if launch.module.startswith("lightllm.")]
    start = time.perf_counter()
    results = ttir_lowering.lower(launches)
    print(f"lowered {len(results)} distinct launches to TTIR (sm90) in {time.perf_counter() - start:.1f} s")
    failed = [f"{r.launch.describe()}:\n{r.error}" for r in results if r.error is not None]
    failed += [f"Triton's binder rejected {message}" for message in session_launches.failures]
    assert not failed, f"{len(failed)} kernel launch(es) run in the interpreter but do not compile:\n\n" + (
        "\n\n".join(failed)
    )


@pytest.mark.last
def test_every_kernel_of_the_session_builds_an_sm90_cubin_that_fits_in_shared_memory(session_launches):
    launches = [launch for launch in session_launches.launches if launch.module.startswith("lightllm.")]
    lowered = [r.launch for r in ttir_lowering.lower(launches) if r.error is None]  # cached; failures reported above
    start = time.perf_counter()
    results = ttir_lowering.build_cubins(ttir_lowering.representatives(lowered))
    print(f"built {len(results)} sm_90 cubins (one per kernel, options and code path) in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    failed = [f"{r.launch.describe()}:\n{r.error}" for r in results if r.error is not None]
    assert not failed, f"{len(failed)} kernel launch(es) lower to TTIR but do not build for sm_90:\n\n" + (
        "\n\n".join(failed)
    )


@pytest.mark.last
def test_every_entry_kernel_is_launched_by_some_test(session_launches, whole_suite):
    if not whole_suite:
        pytest.skip("only a run of the whole suite launches every kernel")
    entries = ttir_lowering.entry_kernels(ttir_lowering.jit_functions())
    launched = {(launch.module, launch.name) for launch in session_launches.launches}
    missing = sorted(entries - launched - set(NOT_LAUNCHED_ON_CPU))
    assert not missing, f"no test launched these kernels, so nothing checks that they compile: {missing}"
    stale = sorted(set(NOT_LAUNCHED_ON_CPU) & launched)
    assert not stale, f"launched now, take them off NOT_LAUNCHED_ON_CPU: {stale}"
    unknown = sorted(set(NOT_LAUNCHED_ON_CPU) - entries)
    assert not unknown, f"not entry kernels in lightllm, take them off NOT_LAUNCHED_ON_CPU: {unknown}"


# The kernels that take programmatic dependent launch (kernels/pdl.py): the short kernels of a Qwen3 or Qwen3.5
# decode layer
PDL_KERNELS = {
    ("lightllm.kernels.linear.small_m_kernel", "_small_m_linear_kernel"),
    ("lightllm.kernels.linear.small_m_kernel", "_sum_splits_kernel"),
    ("lightllm.kernels.norm.add_rmsnorm", "_add_rmsnorm_kernel"),
    ("lightllm.kernels.norm.rmsnorm", "_rmsnorm_kernel"),
    ("lightllm.kernels.norm.qk_norm_rope", "_qk_norm_rope_kernel"),
    ("lightllm.kernels.activation", "_silu_mul_kernel"),
    ("lightllm.kernels.attention.decode.stage1", "decode_stage1_kernel"),
    ("lightllm.kernels.attention.decode.stage2", "decode_stage2_kernel"),
    ("lightllm.kernels.gates", "_sigmoid_gate_mul_kernel"),
    ("lightllm.kernels.norm.gated_rmsnorm", "_gated_rmsnorm_kernel"),
    ("lightllm.kernels.linear_attention.conv1d_update", "_conv1d_update_kernel"),
    ("lightllm.kernels.linear_attention.gated_delta_decode", "_gated_delta_decode_kernel"),
}


def _with_pdl(launch):
    """``launch`` as ``DirectLaunch`` makes it with PDL on: ``USE_PDL=True`` and Triton's ``launch_pdl`` option."""
    constexprs = tuple((name, True if name == "USE_PDL" else value) for name, value in launch.constexprs)
    return dataclasses.replace(launch, constexprs=constexprs, options=launch.options + (("launch_pdl", True),))


@pytest.mark.last
def test_every_pdl_kernel_builds_for_sm90_with_pdl_waits_and_then_releases_the_next_grid(session_launches, whole_suite):
    """One launch per PDL kernel the session made, at its biggest tiles, built with PDL on: it compiles, and its PTX
    has the wait and, after it, the release of the next grid (without PDL,
    ``test_every_kernel_of_the_session_builds...`` builds it; both are compiled out)."""
    picks = {}
    for launch in ttir_lowering.representatives(list(session_launches.launches)):
        if ("USE_PDL", False) in launch.constexprs:
            picks.setdefault((launch.module, launch.name), launch)
    if whole_suite:
        assert set(picks) == PDL_KERNELS, f"PDL kernels launched by the suite: {sorted(picks)}"
    results = ttir_lowering.build_cubins([_with_pdl(launch) for launch in picks.values()])
    failed = [f"{r.launch.describe()}:\n{r.error}" for r in results if r.error is not None]
    assert not failed, "PDL builds failed:\n\n" + "\n\n".join(failed)
    assert all(r.pdl_wait for r in results), [r.launch.describe() for r in results if not r.pdl_wait]
    assert all(r.pdl_release for r in results), [r.launch.describe() for r in results if not r.pdl_release]
    off = ttir_lowering.build_cubins(list(picks.values())[:1])  # the same launch without PDL: neither
    assert [(r.pdl_wait, r.pdl_release) for r in off] == [(False, False)] * len(off)
