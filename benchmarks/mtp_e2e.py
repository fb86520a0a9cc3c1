"""End-to-end decode tokens/s with MTP speculative decoding (``benchmarks/mtp.py --parts e2e``), GPU.

A Qwen3.5-27B-shaped random-weight model with a few layers (``decode_step.QWEN3_5_27B_SHAPE``, 3:1 linear to full
attention) is built three times with an MTP head whose acceptance the construction sets
(``make_tiny_qwen3_5(mtp=...)``): ``agree`` (~100 %), ``agree`` with ``mtp_noise`` picked by
:func:`noise_for_acceptance` (~50 %) and ``random`` (~0 %). For each, ``LLM.generate`` runs batches of prompts
with ``--mtp_step`` 1/2/3, and once (head "any") with MTP off (decode graphs, and eager): 11 engine starts
(2 + 3 per step value), each serving every batch size; decode tokens/s = tokens after the first / (generate time -
the same batch's prefill-only time). The measured acceptance (accepted drafts / drafts, the server's two counters)
is reported beside each row. MTP rows run with MTP's decode graphs (``off eager`` is the plain engine without graphs,
for reference).

    python benchmarks/mtp.py --parts e2e --out benchmarks/results/mtp_e2e_h200.json
"""

import gc
import math
import os
import statistics
import tempfile
import time
from typing import Optional

import torch

# name: (label, make_tiny_qwen3_5's head, its noise; None: noise_for_acceptance)
HEADS = {"agree": ("~100%", "agree", 0.0), "half": ("~50%", "agree", None), "random": ("~0%", "random", 0.0)}


def noise_for_acceptance(target: float, hidden: int, vocab: int, samples: int = 20000, seed: int = 0) -> float:
    """``mtp_noise`` at which the agreeing head's draft is the main model's choice with probability ``target``.

    The head's output is ``e + noise * z`` (``e``: the fed token's normed embedding, ``z``: unit-variance noise);
    its score for the right token is ``hidden + noise * sqrt(hidden) * g``, every other token's is normal with
    variance ``hidden * (1 + noise^2)`` (random embeddings), so the right token wins when its score beats the
    largest of ``vocab - 1`` such normals; bisection on a fixed Monte-Carlo sample."""
    g = torch.Generator().manual_seed(seed)
    right = torch.randn(samples, generator=g, dtype=torch.float64)
    u = torch.rand(samples, generator=g, dtype=torch.float64).clamp_(min=1e-300)
    # the largest of vocab - 1 standard normals, by the inverse CDF of its distribution
    largest = math.sqrt(2) * torch.erfinv(2 * u.pow(1.0 / (vocab - 1)) - 1)

    def acceptance(noise: float) -> float:
        score = (hidden + noise * math.sqrt(hidden) * right) / math.sqrt(hidden * (1 + noise**2))
        return float((score > largest).double().mean())

    lo, hi = 0.0, 1.0
    while acceptance(hi) > target:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance(mid) > target else (lo, mid)
    return (lo + hi) / 2


class _SpecCounts:
    """The engine observer's MTP counts (what the server's two metrics count), and its decode steps' wall seconds and
    GPU seconds (the engine's step GPU timer, every ``GPU_TIME_EVERY``-th step)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.drafts = self.accepted = 0
        self.step_s, self.gpu_s = [], []

    def on_queues(self, *_): ...

    def on_token(self, *_): ...

    def on_step(self, kind, batch_size, seconds):
        if kind == "decode":
            self.step_s.append(seconds)

    def on_step_gpu(self, kind, seconds):
        if kind == "decode":
            self.gpu_s.append(seconds)

    def on_spec(self, drafts, accepted):
        self.drafts += drafts
        self.accepted += accepted


def build(root: str, layers: int, head: str, noise: float, shape: dict) -> str:
    from lightllm.tools.make_tiny_model import make_tiny_qwen3_5

    kinds = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))
    out = os.path.join(root, f"qwen3.5-shaped-{head}-{noise:g}")
    return str(make_tiny_qwen3_5(out, layer_types=kinds, mtp=head, mtp_noise=noise, **shape))


def decode_rows(model_dir: str, batches, prompt_len: int, new_tokens: int, mtp_step: int, graphs: bool,
                **engine) -> list:  # fmt: skip
    """One engine (MTP step ``mtp_step``, 0: off; decode graphs or eager) serving each batch size in turn: its
    graphs are captured up to the largest, so one start measures them all. Per batch: a warm-up generate (every
    kernel shape compiled and cached), then the timed generate and the same batch's prefill-only generate."""
    from lightllm import LLM, SamplingParams

    opts = dict(running_max_req_size=max(batches), max_req_total_len=prompt_len + new_tokens + 8,
                graph_max_batch_size=max(batches), disable_cudagraph=not graphs, **engine)  # fmt: skip
    if mtp_step:
        opts.update(mtp_mode="eagle_with_att", mtp_step=mtp_step)
    llm = LLM(model_dir, **opts)
    counts = _SpecCounts()
    llm.engine.set_observer(counts)
    sync = torch.cuda.synchronize if llm.runner.device.type == "cuda" else (lambda: None)
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, 400, (prompt_len,), generator=gen).tolist() for _ in range(batch)]

        def timed(n):
            sync()
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
            sync()
            return time.perf_counter() - t

        timed(new_tokens)  # warm-up
        counts.reset()
        total = timed(new_tokens)
        drafts, accepted = counts.drafts, counts.accepted
        step_ms, gpu_ms = (statistics.median(x) * 1e3 if x else None for x in (counts.step_s, counts.gpu_s))
        prefill = timed(1)
        rows.append({"mtp_step": mtp_step, "graphs": graphs, "batch": batch,
                     "decode_tok_s": batch * (new_tokens - 1) / max(total - prefill, 1e-9),
                     "acceptance": accepted / drafts if drafts else None,
                     "decode_step_ms": step_ms, "decode_gpu_ms": gpu_ms})  # fmt: skip
    return rows


def run(args, shape: Optional[dict] = None, **engine) -> dict:
    """Every row: MTP off (graphs, then eager) once, on the first head's folder (MTP off never reads the head, and
    the folders' main models differ only in weight values), then per head each ``--e2e-steps`` value with MTP's
    graphs: 2 + 3 x len(steps) engine starts, each serving every batch. ``shape``: the model's widths (default
    Qwen3.5-27B's, bf16); ``engine``: more ``LLM`` options (the CPU test's device and dtype)."""
    model = "Qwen3.5-27B-shaped, bf16"
    if shape is None:
        from decode_step import QWEN3_5_27B_SHAPE

        shape, engine = QWEN3_5_27B_SHAPE, {"data_type": "bf16", **engine}
    else:
        model = f"widths {shape}, {engine.get('data_type', 'default dtype')}"
    hidden = shape["hidden_size"]
    vocab = shape.get("padded_vocab_size") or shape.get("vocab_size", 512)
    results = {"model": model, "layers": args.e2e_layers, "prompt_len": args.e2e_prompt_len,
               "new_tokens": args.e2e_new_tokens, "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        for i, name in enumerate(args.e2e_heads):
            label, head, noise = HEADS[name]
            noise = noise_for_acceptance(0.5, hidden, vocab) if noise is None else noise
            model_dir = build(root, args.e2e_layers, head, noise, shape)
            off = [(0, True), (0, False)] if i == 0 and not args.e2e_no_off else []
            settings = off + [(n, True) for n in args.e2e_steps]
            for step, graphs in settings:
                rows = decode_rows(model_dir, args.e2e_batches, args.e2e_prompt_len, args.e2e_new_tokens, step,
                                   graphs, **engine)  # fmt: skip
                gc.collect()  # what a cycle still holds of the engine goes now: the next sizes its KV from free memory
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the engine is gone: its KV cache goes back before the next
                for row in rows:
                    row.update(head=label if step else "any", mtp_noise=noise if step else None)
                    results["rows"].append(row)
                    print(e2e_row(row), flush=True)
    return results


def e2e_row(row: dict) -> str:
    mode = f"mtp {row['mtp_step']}" if row["mtp_step"] else ("off graphs" if row["graphs"] else "off eager")
    mode += "" if row["graphs"] or not row["mtp_step"] else " eager"
    acc = f"{row['acceptance'] * 100:6.1f}%" if row["acceptance"] is not None else f"{'-':>7s}"
    ms = [f"{row[k]:8.3f}" if row.get(k) is not None else f"{'-':>8s}" for k in ("decode_step_ms", "decode_gpu_ms")]
    return f"{row['head']:>6s} {row['batch']:5d} {mode:>10s} {row['decode_tok_s']:12.1f} {acc} {ms[0]} {ms[1]}"


def print_e2e(results: dict) -> None:
    model = results.get("model", "Qwen3.5-27B-shaped, bf16")
    print(f"\nMTP end to end, {model}, {results['layers']} layers, prompts of "
          f"{results['prompt_len']} tokens, {results['new_tokens']} new; decode tokens/s")  # fmt: skip
    print("  head batch       mode   decode tok/s  accept  step ms   gpu ms")
    for row in results["rows"]:
        print(e2e_row(row))
