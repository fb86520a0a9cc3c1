"""MTP verify of the linear-attention layers on the GPU: the fused recurrent kernel (``gated_delta_verify``, N + 1
tokens per request in one launch, the state after every token written to its own slot) against N + 1 sequential
calls of the single-token ``gated_delta_decode``, at Qwen3.5-27B's linear-attention shape (16 key heads, 48 value
heads, 128/128), float32 state, bf16 activations.

Every time is a CUDA-graph replay median (the tuner's timer). Each captured launch reads and writes another state
pool, cycling through pools of at least 1 GiB together, so the state comes from HBM as in a real step. Per batch B:

- ``default``: the launcher default; ``tuner``: the config the autotuner picks (level 1, DECODE_ATTENTION scope, a
  fresh config folder; it times on its own dummy pool); ``best``: the fastest candidate timed here;
- ``sequential``: N + 1 ``gated_delta_decode`` calls in place on one slot per request, at that kernel's fastest
  candidate (the unfused lower bound: it keeps no per-step states, so it could not roll back a rejected draft);
- state rate: ``B * Hv * Dk * Dv * 4 * (1 + T)`` bytes (one state read, ``T = N + 1`` written per request) over the
  tuner's time, and as % of a device copy (read + write) measured in the same run.

    python benchmarks/mtp_recurrent.py --out benchmarks/results/mtp_recurrent_h200.json
    python benchmarks/mtp_recurrent.py --analyze benchmarks/results/mtp_recurrent_h200.json
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # also when loaded from its path (the tests, benchmarks/mtp.py)
    sys.path.insert(0, HERE)
from recurrent_bench import Cycle, check_batches, pools_needed, run_or_analyze, save, tuner_pick  # noqa: E402

SHAPE = (16, 48, 128, 128)  # (key heads, value heads, head_k_dim, head_v_dim): Qwen3.5-27B at tp 1
BATCHES = (16, 64, 128)
STEPS = 3


def verify_state_bytes(batch: int, tokens: int, v_heads: int, head_k_dim: int, head_v_dim: int, elem: int = 4) -> int:
    """Bytes one verify moves for the recurrent state: one slot read and ``tokens`` slots written per request."""
    return (1 + tokens) * batch * v_heads * head_k_dim * head_v_dim * elem


def make_verify(batch, tokens, shape=SHAPE):
    hk, hv, dk, dv = shape
    rows = batch * tokens
    conv_out = torch.randn(rows, 2 * hk * dk + hv * dv, device="cuda", dtype=torch.bfloat16)
    q = conv_out[:, : hk * dk].view(batch, tokens, hk, dk)
    k = conv_out[:, hk * dk : 2 * hk * dk].view(batch, tokens, hk, dk)
    v = conv_out[:, 2 * hk * dk :].view(batch, tokens, hv, dv)
    a, b = (torch.randn(rows, hv, device="cuda", dtype=torch.bfloat16).view(batch, tokens, hv) for _ in range(2))
    A_log, dt_bias = torch.randn(hv, device="cuda"), torch.randn(hv, device="cuda")
    slots = batch * (tokens + 1)
    per_pool = slots * hv * dk * dv * 4
    pools = [torch.randn(slots, hv, dk, dv, device="cuda").mul_(0.1) for _ in range(pools_needed(per_pool))]
    perm = torch.randperm(slots, device="cuda").int()
    dst, src = perm[:rows].view(batch, tokens).contiguous(), perm[rows:].contiguous()
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pools=pools, src=src, dst=dst)


def time_verify(t, cfg):
    from lightllm.common.autotuner import cuda_graph_bench
    from lightllm.kernels.linear_attention.gated_delta_verify import gated_delta_verify

    out = torch.empty(t["v"].shape, dtype=t["q"].dtype, device="cuda")
    args = t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"]
    return cuda_graph_bench(
        Cycle(lambda pool: gated_delta_verify(*args, pool, t["src"], t["dst"], out=out, run_config=cfg), t["pools"])
    )


def time_sequential(t, cfg):
    """N + 1 single-token decodes in place on each request's source slot."""
    from lightllm.common.autotuner import cuda_graph_bench
    from lightllm.kernels.linear_attention.gated_delta_decode import gated_delta_decode

    tokens = t["q"].shape[1]
    out = torch.empty(t["v"][:, 0].shape, dtype=t["q"].dtype, device="cuda")
    per_token = [tuple(t[n][:, i] for n in ("q", "k", "v", "a", "b")) for i in range(tokens)]

    def launch(pool):
        for q, k, v, a, b in per_token:
            gated_delta_decode(q, k, v, a, b, t["A_log"], t["dt_bias"], pool, t["src"], out=out, run_config=cfg)

    return cuda_graph_bench(Cycle(launch, t["pools"]))


def verify_tuner_pick(t):
    """The config the autotuner stores for this batch (its own search, in a fresh config folder)."""
    from lightllm.kernels.linear_attention import gated_delta_verify as gdv

    args = t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], t["pools"][0], t["src"], t["dst"]
    return tuner_pick(gdv._launch_gated_delta_verify, lambda: gdv.gated_delta_verify(*args))


def run(args):
    from bandwidth import copy_gbs
    from lightllm.kernels.linear_attention import gated_delta_decode as gdd
    from lightllm.kernels.linear_attention import gated_delta_verify as gdv

    tokens = args.steps + 1
    copy, copy_ways = copy_gbs(detail=True)
    results = {
        "device": torch.cuda.get_device_name(),
        "copy_GBs": copy,
        "copy_ways_GBs": copy_ways,  # memcpy and kernel copy: which one sets the reference
        "shape": list(SHAPE),
        "steps": args.steps,
        "state_dtype": "torch.float32",
        "dtype": "torch.bfloat16",
        "rows": [],
    }
    print(f"copy bandwidth {results['copy_GBs']:.0f} GB/s", flush=True)
    for batch in args.batches:
        t = make_verify(batch, tokens)
        default = gdv.default_config(SHAPE[3])
        candidates = {json.dumps(c, sort_keys=True): time_verify(t, c) for c in gdv._configs(t["q"], t["v"])}
        picked = verify_tuner_pick(t)
        q0, v0 = t["q"][:, 0], t["v"][:, 0]
        sequential = {json.dumps(c, sort_keys=True): time_sequential(t, c) for c in gdd._configs(q0, v0)}
        best_seq = min(sequential, key=sequential.get)
        row = {
            "B": batch,
            "state_bytes": verify_state_bytes(batch, tokens, *SHAPE[1:]),
            "default": default,
            "default_ms": time_verify(t, default),
            "tuner": picked,
            "tuner_ms": time_verify(t, picked or default),  # None: the default won
            "candidates_ms": candidates,
            "sequential": json.loads(best_seq),
            "sequential_ms": sequential[best_seq],
        }
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "candidates_ms"}), flush=True)
        del t
        torch.cuda.empty_cache()
        save(results, args.out)
    return results


def print_tables(results):
    copy = results["copy_GBs"]
    hk, hv, dk, dv = results["shape"]
    print(
        f"\n{results['device']}: copy {copy:.0f} GB/s; Hk {hk}, Hv {hv}, {dk}/{dv}; N = {results['steps']}; "
        f"state {results['state_dtype']}, activations {results['dtype']}"
    )
    print("\n  B  default us  tuner us  best us  seq us  seq/tuner  tuner TB/s  best TB/s  %copy  tuner")
    for r in results["rows"]:
        best = min(r["candidates_ms"].values())
        rate, best_rate = (r["state_bytes"] / ms / 1e9 for ms in (r["tuner_ms"], best))  # bytes per ms -> TB/s
        print(
            f"{r['B']:3d} {r['default_ms'] * 1e3:11.1f} {r['tuner_ms'] * 1e3:9.1f} {best * 1e3:8.1f} "
            f"{r['sequential_ms'] * 1e3:7.1f} {r['sequential_ms'] / r['tuner_ms']:10.2f} {rate:11.2f} "
            f"{best_rate:10.2f} {rate * 1e3 / copy * 100:6.1f}  {r['tuner'] or 'default'}"
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--steps", type=int, default=STEPS, help="draft tokens N (the verify runs N + 1), 1-4")
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/mtp_recurrent.json")
    args = p.parse_args(argv)
    check_batches(p, args)
    if not 1 <= args.steps <= 4:
        p.error(f"--steps expected 1-4 (--mtp_step), got {args.steps}")
    return args


def main(argv=None):
    run_or_analyze(parse_args(argv), run, print_tables)


if __name__ == "__main__":
    main()
