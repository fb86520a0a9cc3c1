"""Host time one Qwen3 (or Qwen3.5) layer adds to an eager forward, with the device work taken out, so what is
timed is the Python and torch dispatch of a layer (plans, checks, allocations, views, Triton's launch path) plus its
small CPU GEMMs (tiny widths; at batch 1 a few µs each, about a cuBLAS launch's host cost; a 128-token prefill also
computes its torch elementwise ops on the CPU). Per layer = (time of an 8-layer forward - time of a 1-layer
forward) / 7; decode at batch 1 and a prefill of 128 tokens; median of ``--repeats`` timings of ``--number`` forwards.

``--model qwen3.5``: a tiny Qwen3.5 of 8 gated DeltaNet layers then 8 gated attention layers (the GPU kernels' head
sizes, Qwen3's hidden width), each kind timed over its 7 layers after its first (depths 1 -> 8 and 9 -> 16);
fla-core's chunked prefill delta rule is one stand-in call (its Triton autotuner needs a GPU).

``--launches``: ``driver`` (default) runs Triton's own launch path (``JITFunction.run``: binder, cache key, look-up)
down to the compiled kernel's launcher, which is a stand-in that does nothing (a stub driver answers for the GPU;
the first launch of each specialization "compiles" to the stand-in); ``noop`` makes ``kernel[grid]`` itself a
no-op (the method of the older runs in ``layer_host_cost_cpu.json``). ``--attention kernels`` also runs the
attention backend's GPU path (plans, checks, the KV write and attention launchers; head_dim 64), ``noop`` (the
older runs) replaces its calls with no-ops.

    python benchmarks/layer_host_cost.py --label after --out benchmarks/results/layer_host_cost_launch_cpu.json

Runs on older checkouts too (they pick the kernel path by device), to compare before and after; each run is
appended to ``--out`` with its label, commit and machine.
"""

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction, KernelInterface

from lightllm import LLM
from lightllm.layers.attention import AttentionBackend
from lightllm.layers.infer_state import InferState
from lightllm.layers import linear_attention
from lightllm.tools.make_tiny_model import QWEN3_5_GPU_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5


class _StubDriver:
    """Answers Triton's launch path for a GPU that is not there (device 0, stream 0, an H100/H200 target)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _StubCompiled:
    """What a compiled kernel offers a launch; its launcher does nothing."""

    function = packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        return None


def _stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = self.device_caches[device][0][key] = _StubCompiled()
    return kernel


def _no_device_work(launches: str, attention: str) -> None:
    if launches == "noop":
        KernelInterface.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    else:
        driver.set_active(_StubDriver())
        JITFunction._pack_args = lambda self, backend, kwargs, bound_args, specialization, options: (None,) * 4
        JITFunction._do_compile = _stub_compile
    if attention == "kernels":
        return

    def noop(name):
        return lambda self, layer, *args: None if name == "write_kv" else torch.empty_like(args[0])

    for name in ("write_kv", "prefill", "decode"):
        setattr(AttentionBackend, name, noop(name))


# Qwen3.5: 8 gated DeltaNet layers, then 8 gated attention layers; a kind's layers after its first (whose run also
# makes the forward's plans and output buffers of that kind): (fewer, more) forward depths.
QWEN3_5_LAYERS = ("linear_attention",) * 8 + ("full_attention",) * 8
# the GPU kernels' head sizes; Qwen3's narrow hidden state, so the CPU GEMMs stay as small as Qwen3's
QWEN3_5_SHAPE = dict(QWEN3_5_GPU_SHAPE, hidden_size=64, intermediate_size=128, layer_types=QWEN3_5_LAYERS)
QWEN3_5_DEPTHS = {"linear_attention": (1, 8), "full_attention": (9, 16)}


def stub_fla_chunk(counts=None):
    """fla-core's chunked gated delta rule (Qwen3.5 prefill) as one stand-in call that returns outputs of its shapes:
    its own launches are autotuned by Triton's benchmarker, which needs a GPU. Counted in ``counts`` when given."""

    def chunk(q, k, v, g, beta, plan, initial_state=None):
        if counts is not None:
            counts["fla chunk_gated_delta_rule"] += 1
        finals = v.new_empty(plan.cu_seqlens.shape[0] - 1, v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32)
        return torch.empty_like(v), finals

    linear_attention._fla_chunk = chunk


def _states(runner, slot, prompt_len: int):
    i32 = torch.int32
    decode = InferState(is_prefill=False, b_req_idx=torch.tensor([slot], dtype=i32), req_to_token=runner.kv.table,
                        b_seq_len=torch.tensor([4], dtype=i32), out_token_idx=torch.tensor([9]),
                        positions=torch.tensor([3]), max_len_in_batch=4)  # fmt: skip
    prefill = InferState(is_prefill=True, b_req_idx=torch.tensor([slot], dtype=i32), req_to_token=runner.kv.table,
                         b_seq_len=torch.tensor([prompt_len], dtype=i32), out_token_idx=torch.arange(prompt_len),
                         positions=torch.arange(prompt_len), max_len_in_batch=prompt_len,
                         b_q_start=torch.tensor([0], dtype=i32), b_q_len=torch.tensor([prompt_len], dtype=i32),
                         max_q_len=prompt_len)  # fmt: skip
    return {"decode": (torch.tensor([5]), decode), "prefill": (torch.randint(0, 500, (prompt_len,)), prefill)}


def forward_us(model, ids, state, number: int, repeats: int) -> float:
    model.forward(ids, state)
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(number):
                model.forward(ids, state)
            samples.append((time.perf_counter_ns() - start) / number / 1000.0)
    finally:
        gc.enable()
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("qwen3", "qwen3.5"), default="qwen3")
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--label", default="current")
    ap.add_argument("--launches", choices=("driver", "noop"), default="driver")
    ap.add_argument("--attention", choices=("kernels", "noop"), default="kernels")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="", help="recorded with the run, e.g. how busy the machine was")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.model == "qwen3.5" and args.attention != "kernels":
        ap.error("--model qwen3.5 runs the attention backends' GPU paths: --attention kernels only")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "qwen3.5":
            model_dir = make_tiny_qwen3_5(os.path.join(tmp, "tiny"), seed=1, **QWEN3_5_SHAPE)
        else:
            head_dim = 64 if args.attention == "kernels" else 16  # the GPU attention kernels' smallest head_dim
            model_dir = make_tiny_qwen3(os.path.join(tmp, "tiny"), num_hidden_layers=8, head_dim=head_dim, seed=1)
        llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=256, max_req_total_len=256,
                  running_max_req_size=2)  # fmt: skip
    model, runner = llm.runner.model, llm.runner
    if hasattr(model, "use_kernels"):
        model.use_kernels = True
    else:
        model.device = torch.device("cuda")  # older checkouts pick the kernel path by device
    _no_device_work(args.launches, args.attention)
    if args.attention == "kernels":
        runner.attn.on_gpu = True
    if args.model == "qwen3.5":
        model.linear.on_gpu = True
        stub_fla_chunk()
    slot = runner.add_request()
    weights, rows = model.w, {}
    kinds = QWEN3_5_DEPTHS if args.model == "qwen3.5" else {"layer": (1, 8)}
    for phase, (ids, state) in _states(runner, slot, args.prompt_len).items():
        times = {}
        for depth in sorted({d for pair in kinds.values() for d in pair}):
            model.w = dataclasses.replace(weights, layers=weights.layers[:depth])
            times[depth] = forward_us(model, ids, state, args.number, args.repeats)
        by_kind = {}
        for kind, (fewer, more) in kinds.items():
            per_layer = (times[more] - times[fewer]) / (more - fewer)
            few = f"{fewer} layer{'s' * (fewer > 1)}"
            by_kind[kind] = {f"forward_{few.replace(' ', '_')}_us": times[fewer],
                             f"forward_{more}_layers_us": times[more], "per_layer_us": per_layer}  # fmt: skip
            print(f"{args.label:>10} {phase:>8} {kind}: {few} {times[fewer]:7.1f} us, {more} layers "
                  f"{times[more]:7.1f} us, per layer {per_layer:6.1f} us")  # fmt: skip
        rows[phase] = by_kind["layer"] if list(by_kind) == ["layer"] else by_kind
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        run = {"label": args.label, "commit": commit, "model": args.model,
               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "note": args.note,
               "launches": args.launches, "attention": args.attention, "prompt_len": args.prompt_len,
               "number": args.number, "repeats": args.repeats, "results": rows}  # fmt: skip
        runs = json.load(open(args.out)) if os.path.exists(args.out) else []
        json.dump(runs + [run], open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
