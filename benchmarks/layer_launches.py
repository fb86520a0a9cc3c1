"""What one eager Qwen3 or Qwen3.5 layer launches on a GPU, counted on the CPU: every Triton launch (by kernel) and
every torch op that would run device work (GEMMs, copies, fills, elementwise ops; ``torch.empty`` is free). Views
launch nothing but cost host time: listed apart (``view ...``), not in the total.

The model runs its GPU code path with Triton's launcher stubbed out as in ``layer_host_cost.py`` (``--launches
driver``), the attention backend's GPU path included (``triton`` decode; FA3 needs a GPU: it replaces the Triton
decode attention's launches with one FA3 call). A layer's launches = those of a 2-layer forward minus a 1-layer
forward, so the forward's own work (embedding, first norm, lm_head, plans) cancels out. Decode at batch 1 and a
``--prompt-len`` prefill. Runs on older checkouts too (to count before and after a change).

``--model qwen3.5``: a tiny Qwen3.5 (the GPU kernels' head sizes) whose layers are gated DeltaNet, gated DeltaNet,
gated attention, so a linear-attention layer is the 2-layer forward minus the 1-layer one and a full-attention layer
the 3-layer forward minus the 2-layer one. The linear-attention backend runs its GPU path too, but for prefill's
chunked delta rule: fla-core's own launches (several, autotuned by Triton's benchmarker) are one stand-in call,
counted as ``fla chunk_gated_delta_rule``.

    python benchmarks/layer_launches.py --label after --out benchmarks/results/layer_launches_cpu.json
    python benchmarks/layer_launches.py --model qwen3.5 --label after \\
        --out benchmarks/results/layer_launches_qwen3_5_cpu.json
"""

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import tempfile

from torch.utils._python_dispatch import TorchDispatchMode

from layer_host_cost import _no_device_work, _states, stub_fla_chunk

from lightllm import LLM
from lightllm.kernels import direct_launch
from lightllm.tools.make_tiny_model import QWEN3_5_GPU_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5
from triton.runtime.jit import JITFunction

_FREE_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}  # allocations launch nothing


def _launches_device_work(func) -> bool:
    """A view (an aliasing result that is not written) or an allocation runs nothing on the device."""
    if func.__name__.split(".")[0] in _FREE_OPS:
        return False
    returns = func._schema.returns
    alias = returns[0].alias_info if returns else None
    return alias is None or alias.is_write


class _CountOps(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"torch {func.__name__}" if _launches_device_work(func) else f"view {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _count_triton(counts):
    """Count every Triton launch once: through a DirectLaunch, or ``kernel[grid]`` outside one."""
    inside = [0]
    launch, run = direct_launch.DirectLaunch.launch, JITFunction.run

    def counted_launch(self, grid, *args, **kwargs):
        counts[f"triton {self.kernel.__name__}"] += 1
        inside[0] += 1
        try:
            return launch(self, grid, *args, **kwargs)
        finally:
            inside[0] -= 1

    def counted_run(self, *args, **kwargs):
        if not inside[0]:
            counts[f"triton {self.__name__}"] += 1
        return run(self, *args, **kwargs)

    direct_launch.DirectLaunch.launch, JITFunction.run = counted_launch, counted_run


def count(model, ids, state, counts) -> collections.Counter:
    counts.clear()
    with _CountOps(counts):
        model.forward(ids, state)
    return collections.Counter(counts)


# Per model: the tiny model's maker and arguments, and each layer kind's (fewer, more) forward depths.
_QWEN3_5_LAYERS = ("linear_attention", "linear_attention", "full_attention")
_MODELS = {
    "qwen3": (make_tiny_qwen3, dict(num_hidden_layers=2, head_dim=64), {"layer": (1, 2)}),
    "qwen3.5": (make_tiny_qwen3_5, dict(QWEN3_5_GPU_SHAPE, layer_types=_QWEN3_5_LAYERS),
                {"linear_attention": (1, 2), "full_attention": (2, 3)}),
}  # fmt: skip


def _layer_row(layer: collections.Counter) -> dict:
    launches = sum(n for name, n in layer.items() if not name.startswith("view "))
    return {"total": launches, **dict(sorted(layer.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(_MODELS), default="qwen3")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", default=None, help="append the counts, with the label and commit, to this JSON list")
    args = ap.parse_args()
    make, shape, kinds = _MODELS[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make(os.path.join(tmp, "tiny"), seed=1, **shape)
        llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64,
                  running_max_req_size=2)  # fmt: skip
    model, runner = llm.runner.model, llm.runner
    model.use_kernels = True
    _no_device_work("driver", "kernels")
    runner.attn.on_gpu = True
    counts = collections.Counter()
    _count_triton(counts)
    if getattr(model, "linear", None) is not None:
        model.linear.on_gpu = True
        stub_fla_chunk(counts)
    slot = runner.add_request()
    weights, per_layer = model.w, {}
    depths = sorted({depth for pair in kinds.values() for depth in pair})
    for phase, (ids, state) in _states(runner, slot, args.prompt_len).items():
        model.forward(ids, state)  # first launches bind; not counted apart, but keep both counts alike
        by_depth = {}
        for depth in depths:
            model.w = dataclasses.replace(weights, layers=weights.layers[:depth])
            by_depth[depth] = count(model, ids, state, counts)
        rows = {kind: _layer_row(by_depth[more] - by_depth[fewer]) for kind, (fewer, more) in kinds.items()}
        per_layer[phase] = rows["layer"] if list(rows) == ["layer"] else rows
    for phase, by_kind in per_layer.items():
        for kind, row in (by_kind.items() if "total" not in by_kind else [("layer", by_kind)]):
            print(f"{phase}, {kind}: {row['total']} launches per layer (and the views: no launch, some host time)")
            for name, n in row.items():
                if name != "total":
                    print(f"  {n:3d}  {name}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        runs = json.load(open(args.out)) if os.path.exists(args.out) else []
        run = {"label": args.label, "commit": commit, "model": args.model, "attention": "triton",
               "per_layer": per_layer}  # fmt: skip
        json.dump(runs + [run], open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
