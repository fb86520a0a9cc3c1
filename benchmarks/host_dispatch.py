"""Host cost of dispatching tuned kernels, with the kernels taken out: every launcher here is a no-op, so what is
timed is the Python between the caller and the launch (keys, config look-up, argument checks, page tables).

Rows: a plain call of the no-op launcher; the same launcher tuned, called at a cached key (level 0, and level 1
outside its phase); a planned call (``Autotuner.plan`` once, ``Plan.run`` per call); then the decode-attention
paths as the attention backend takes them per layer, before (the public function: checks, keys, dispatch every
layer) and after (a per-step plan made once, ``run`` per layer). Median of ``--repeats`` timings of ``--number``
calls each; CPU tensors, nothing reaches a GPU.

    python benchmarks/host_dispatch.py --out benchmarks/results/host_dispatch_cpu.json
"""

import argparse
import functools
import gc
import importlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def per_call_us(fn, number: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``number`` back-to-back calls, in microseconds."""
    fn()
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter_ns() - start) / number / 1000.0)
    finally:
        gc.enable()
    return statistics.median(samples)


def _fake_bench(run) -> float:
    run()
    return 1.0 if _last_config[0] is None else 0.5  # any config beats the default: a cached entry is written


_last_config = [None]


def _noop(x, out, alpha=2.0, run_config=None):
    _last_config[0] = run_config
    return out


def _noop_norm(x, weight, eps, out, run_config=None):
    _last_config[0] = run_config
    return out


def _check_only(check, x, weight, eps=1e-6, out=None, run_config=None):
    check(x, weight, out)
    return out


def _noop_decode(
    q, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, out, sm_scale,
    quant, quant_group, scratch=None, run_config=None,
):  # fmt: skip
    _last_config[0] = run_config
    return out


def _plans_from_shapes(plan_class) -> bool:
    """Kernel plans are made from shapes since the explicit per-step planning (before: from the first layer's q)."""
    return any(name in inspect.signature(plan_class).parameters for name in ("shape", "q_shape"))


def measure(number: int, repeats: int) -> list:
    from lightllm.common.autotuner import AutotuneKernelType, autotune, autotune_warmup, set_bench_func
    from lightllm.kernels.attention.decode import fa3, flash_decode

    set_bench_func(_fake_bench)
    general, decode = AutotuneKernelType.GENERAL, AutotuneKernelType.DECODE_ATTENTION
    toy = autotune(
        "host_dispatch_toy",
        configs_gen_func=lambda: [{"BLOCK": 64}],
        static_key_func=lambda x, alpha: {"dtype": str(x.dtype), "alpha": alpha},
        run_key_func=lambda x: x.shape[0],
    )(_noop)
    x, out = torch.zeros(16, 8), torch.zeros(16, 8)
    rows = []

    def row(name, fn, level=0):
        os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = str(level)
        rows.append({"path": name, "level": level, "us_per_call": round(per_call_us(fn, number, repeats), 3)})
        print(f"{rows[-1]['us_per_call']:10.3f}  {name} (level {level})", flush=True)

    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    with autotune_warmup(general):
        toy(x, out)  # searched and stored: every timed call below is at a cached key
    row("plain call of the no-op launcher", lambda: _noop(x, out))
    row("tuned call, cached key, outside any scope", lambda: toy(x, out), level=0)
    row("tuned call, cached key, outside its phase", lambda: toy(x, out), level=1)
    if hasattr(toy, "plan"):
        plan = toy.plan(x, out)
        row("planned call: Plan.run", lambda: plan.run(x, out), level=0)

    # RMSNorm as the Qwen3 forward calls it (four times per layer), the kernel replaced by a no-op.
    norm_module = importlib.import_module("lightllm.kernels.norm.rmsnorm")
    h, w, h_out = torch.zeros(8, 4096), torch.ones(4096), torch.zeros(8, 4096)
    if hasattr(norm_module, "_launch_rmsnorm"):
        norm_module._launch_rmsnorm.fn = _noop_norm
    else:  # before the one wiring pattern the tuned function checked its own arguments: keep them, drop the kernel
        norm_module.rmsnorm.fn = functools.partial(_check_only, norm_module._check)
    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    with autotune_warmup(general):
        norm_module.rmsnorm(h, w, out=h_out)
    row("rmsnorm, per call (checks, keys, dispatch)", lambda: norm_module.rmsnorm(h, w, out=h_out))
    if hasattr(norm_module, "RMSNormPlan"):
        shaped = _plans_from_shapes(norm_module.RMSNormPlan)
        norm_plan = norm_module.RMSNormPlan(h.shape, h.dtype) if shaped else norm_module.RMSNormPlan(h, w)
        row("RMSNormPlan.run, per call (plan once per step and shape)", lambda: norm_plan.run(h, w, out=h_out))

    # Decode attention as the backend calls it per layer, the kernels replaced by no-ops.
    # short rows: the page-table gather, device work on a GPU, costs next to nothing here too
    batch, q_heads, kv_heads, head_dim, pool, max_len = 8, 32, 8, 128, 1024, 64
    q = torch.zeros(batch, q_heads, head_dim)
    k, v = torch.zeros(pool, kv_heads, head_dim), torch.zeros(pool, kv_heads, head_dim)
    r2t = torch.arange(batch * max_len, dtype=torch.int32).view(batch, max_len) % pool
    idx = torch.arange(batch, dtype=torch.int32)
    seq = torch.full((batch,), 100, dtype=torch.int32)
    out = torch.zeros_like(q)
    # (the old name too, to time a checkout from before the plan/run split)
    gqa = getattr(flash_decode, "_launch_gqa_flash_decode", None) or flash_decode._tuned["none"]
    gqa.fn = _noop_decode
    os.environ["LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN"] = "1024"
    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    with autotune_warmup(decode):
        flash_decode.gqa_decode_attention(q, k, v, r2t, idx, seq, max_len, out=out)
    row("gqa_decode_attention, per layer (checks, keys, dispatch)",
        lambda: flash_decode.gqa_decode_attention(q, k, v, r2t, idx, seq, max_len, out=out))  # fmt: skip
    if hasattr(flash_decode, "GQADecodePlan"):
        make = flash_decode.GQADecodePlan
        q_spec = (q.shape, q.dtype) if _plans_from_shapes(make) else (q,)
        step = make("none", *q_spec, k, v, r2t, idx, seq, max_len)
        row("GQADecodePlan.run, per layer (plan once per step)", lambda: step.run(q, k, v, out=out))
        row("GQADecodePlan, made once per step (checks)", lambda: make("none", *q_spec, k, v, r2t, idx, seq, max_len))

    provider = fa3.FA3Provider("noop", "0", True, True, lambda q, *a, **kw: q)
    q16, k16, v16 = q.half(), k.half(), v.half()
    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    with autotune_warmup(decode):
        fa3.fa3_decode_attention(q16, k16, v16, r2t, idx, seq, max_len, provider=provider)
    row("fa3_decode_attention, per layer (checks, page table, keys, dispatch)",
        lambda: fa3.fa3_decode_attention(q16, k16, v16, r2t, idx, seq, max_len, provider=provider))  # fmt: skip
    if hasattr(fa3, "FA3DecodePlan"):
        q16_spec = (q16.shape, q16.dtype) if _plans_from_shapes(fa3.FA3DecodePlan) else (q16,)
        step = fa3.FA3DecodePlan(*q16_spec, k16, v16, r2t, idx, seq, max_len, provider=provider)
        row("FA3DecodePlan.run, per layer (plan once per step)", lambda: step.run(q16, k16, v16))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--number", type=int, default=20000, help="calls per timing")
    p.add_argument("--repeats", type=int, default=7, help="timings per row (the median is reported)")
    p.add_argument("--out", default="host_dispatch_cpu.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = root  # the configs this run tunes stay out of the user's cache
        rows = measure(args.number, args.repeats)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # fmt: skip
    except OSError:
        commit = "unknown"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                   "torch": torch.__version__, "commit": commit, "number": args.number, "repeats": args.repeats,
                   "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
