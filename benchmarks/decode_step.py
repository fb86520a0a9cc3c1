"""Decode step time of a Qwen3- or Qwen3.5-shaped model: CUDA graphs vs eager per batch size, against the memory
floor, and start-up time with decode-attention tuning cold, warm (configs cached) and off.

``--model qwen3`` has 8B-like widths (hidden 4096, 32/8 heads of 128, intermediate 12288, vocab 151936);
``--model qwen3.5`` Qwen3.5-27B's (hidden 5120, 24/4 gated-attention heads of 256, gated DeltaNet 16 key / 48
value heads of 128, intermediate 17408, vocab 248320) in its 3:1 linear:full layer pattern. Both with fewer
layers and random weights. Floor = (weight bytes + KV bytes read + linear-attention state bytes read and written
per step) / the faster of the measured copy and GEMV read rates.

    python benchmarks/decode_step.py --out benchmarks/results/decode_step_h200.json
    python benchmarks/decode_step.py --model qwen3.5 --layers 8 --out benchmarks/results/decode_step_qwen3_5_h200.json
    python benchmarks/decode_step.py --layers 36 --batches 1 --no-startup --out benchmarks/results/ttft_36l_h200.json

Start-up (``--startup-modes``, each a fresh process after the step table): tuning cold, warm and off by default;
``first`` and ``first_serial`` time a new machine's first start with the shipped configs and an empty Triton cache,
the tuned kernels' cached configs compiled ahead on the tuner's threads or on one:

    python benchmarks/decode_step.py --batches 1 --tune-level 0 --startup-modes first first_serial --out F

The time-to-first-token row runs one prompt (``--ttft-prompt`` tokens) with the prefill graphs and eagerly.

Decode graphs per KV length bucket (``--graph_len_buckets``, the server flag; default the engine's, one bucket): each
start records per bucket the graphs, capture seconds (warm-up tuning included) and MiB. The cost of the buckets is a
run with them against one without:

    python benchmarks/decode_step.py --batches 1 --graph_len_buckets 4096 --out /tmp/buckets.json

``--pdl`` launches the kernels that support it with programmatic dependent launch (``lightllm/kernels/pdl.py``); run it
beside a run without, with ``--profile-batch`` to see the kernels' sum against the step:

    python benchmarks/decode_step.py --layers 8 --batches 1 32 64 --no-startup --tune-level 0 --profile-batch 1 --pdl

Two processes' graph steps differ by up to 8 % on the H200 (host preparation is part of ``graph ms``), more than PDL
changes. ``--pdl-ab ROUNDS`` resolves it in one process: each batch's step is also captured with PDL, and the two
graphs' replays (``replay ms``: back-to-back replays between CUDA events, the GPU's time alone) alternate round by
round on the same buffers:

    python benchmarks/decode_step.py --layers 8 --batches 1 32 64 --no-startup --tune-level 0 --pdl-ab 8
"""

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from bandwidth import copy_gbs, gemv_gbs, matmul_tflops

from lightllm.common import proc as procs
from lightllm.kernels import direct_launch


def bandwidths_gbs() -> dict:
    """Device read rates, GB/s: a 2 GiB copy (read + write bytes) and a 1 GiB bf16 GEMV (bytes of the matrix,
    the access pattern of a decode step's weights). The floor uses the faster, so it is the stricter one."""
    return {"copy": copy_gbs(), "gemv": gemv_gbs()}


# Qwen3.5-27B's text widths (its config.json), random weights
QWEN3_5_27B_SHAPE = dict(padded_vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                         num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25, linear_num_key_heads=16,
                         linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4, max_position_embeddings=40960, dtype="bfloat16",
                         initializer_range=0.02)  # fmt: skip


def build_model(root: str, layers: int, model: str = "qwen3", mtp: bool = False) -> str:
    """A random-weight Qwen3-8B- or Qwen3.5-27B-shaped folder of ``layers`` layers (``mtp``: Qwen3.5 with its
    MTP head)."""
    from lightllm.tools.make_tiny_model import QWEN3_8B_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5

    if model == "qwen3":
        return str(make_tiny_qwen3(os.path.join(root, "qwen3-8b-shaped"), num_hidden_layers=layers, **QWEN3_8B_SHAPE))
    kinds = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))  # 3:1, as 27B
    return str(make_tiny_qwen3_5(os.path.join(root, "qwen3.5-27b-shaped"), layer_types=kinds, mtp=mtp,
                                 **QWEN3_5_27B_SHAPE))  # fmt: skip


def step_times(model_dir, batch_sizes, kv_len, graph_max_len, profile_batch=None, buckets=None, pdl_ab=0):
    """Per batch size: the eager and the graph step through ``runner.decode`` (host preparation included), and the
    graph's replay alone (``replay_ms``: back-to-back replays between CUDA events, the GPU's time per step). With
    ``pdl_ab`` rounds, also the same step captured a second time with programmatic dependent launch
    (``pdl_graphs``), its replays alternating with the plain graph's round by round (see :func:`replay_ab`)."""
    from lightllm import LLM

    llm = LLM(model_dir, data_type="bf16", running_max_req_size=max(batch_sizes), max_req_total_len=graph_max_len,
              graph_max_batch_size=max(batch_sizes), graph_max_len_in_batch=graph_max_len, batch_max_tokens=8192,
              **_bucket_option(buckets))  # fmt: skip
    runner, rows = llm.runner, []
    pdl_graphs = capture_pdl_graphs(runner, batch_sizes) if pdl_ab else None
    for bs in batch_sizes:
        slots = [runner.kv.add_request() for _ in range(bs)]
        for s in slots:  # KV of kv_len tokens per request (contents random: timing only)
            runner.kv.extend(s, kv_len - 1)
        tokens = [1] * bs
        eager_graphs, runner.graphs = runner.graphs, None
        eager = _time(lambda: runner.decode(slots, tokens), runner)
        runner.graphs = eager_graphs
        graph = _time(lambda: runner.decode(slots, tokens), runner)
        # the static buffers now hold this batch's step: replays recompute it (KV rewritten in place, linear
        # attention state advanced: timing only)
        longest = max(runner.kv.seq_lens(slots))
        plain = functools.partial(runner.graphs.replay, runner.graphs.pick(bs, longest))
        if pdl_graphs is None:
            ab = {"replay_ms": statistics.median(_replay_rounds(plain))}
        else:
            ab = replay_ab(plain, functools.partial(pdl_graphs.replay, pdl_graphs.pick(bs, longest)), pdl_ab)
        if bs == profile_batch:
            from step_profile import kernel_breakdown, print_breakdown

            profile = kernel_breakdown(lambda: runner.decode(slots, tokens))
            print_breakdown(bs, profile)
        for s in slots:
            runner.free(s)
        rows.append({"batch": bs, "eager_ms": eager, "graph_ms": graph, **ab})
        if bs == profile_batch:
            rows[-1]["graph_kernels"] = profile
        print(json.dumps(rows[-1]), flush=True)
    return llm, rows


def capture_pdl_graphs(runner, batch_sizes):
    """The runner's decode step captured again at the graph sizes serving ``batch_sizes`` and its KV length buckets,
    every kernel that supports it launched with programmatic dependent launch, in a memory pool of its own (the plain
    graphs stay)."""
    from lightllm.common.cuda_graph import DecodeGraphs

    previous = direct_launch.set_pdl(True)  # a ValueError names what is missing
    try:
        sizes = sorted({runner.graphs.pick(bs, 1)[1] for bs in batch_sizes})  # the sizes the plain graphs replay
        return DecodeGraphs(sizes, runner.graphs.graph_lens).capture_all(runner._graph_decode)
    finally:
        direct_launch.set_pdl(previous)


def _replay_rounds(replay, rounds=5, reps=20) -> list:
    """ms per step of ``reps`` back-to-back ``replay()`` calls between CUDA events, one value per round."""
    replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        out.append(_replay_once(replay, reps))
    return out


def _replay_once(replay, reps=20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def replay_ab(plain, pdl, rounds: int) -> dict:
    """The plain and the PDL graph of one step, timed in ``rounds`` rounds that each time both (which goes first
    alternates), in one process on the same buffers: a drift of clocks or of the host reaches both sides of a round
    alike. ``pdl_over_plain``: the median of the rounds' ratios."""
    plain(), pdl()
    torch.cuda.synchronize()
    times = {"plain": [], "pdl": []}
    for r in range(rounds):
        for name, replay in (("plain", plain), ("pdl", pdl))[:: 1 if r % 2 == 0 else -1]:
            times[name].append(_replay_once(replay))
    ratios = [b / a for a, b in zip(times["plain"], times["pdl"])]
    return {"replay_ms": statistics.median(times["plain"]), "replay_pdl_ms": statistics.median(times["pdl"]),
            "pdl_over_plain": statistics.median(ratios), "pdl_rounds": times}  # fmt: skip


def ttft_ms(llm, prompt_len: int, reps: int = 10) -> dict:
    """Time to the first token of one ``prompt_len``-token prompt through the offline API (prefill, sampling,
    bookkeeping), and the runner's prefill forward alone; medians of ``reps`` after one warm-up each. First with
    the runner's prefill graphs (``prefill_graph_bucket``: the bucket that served the prompt, None when none did),
    then with them set aside (``*_eager_ms``). Each call's prompt starts with another token, so the prefix cache
    never serves it: every call prefills the whole prompt."""
    from lightllm import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    runner, graphs = llm.runner, llm.runner.prefill_graphs
    key = graphs.pick(prompt_len, 0) if graphs else None
    calls, vocab = itertools.count(), runner.config.vocab_size

    def prompt():
        return [1 + next(calls) % (vocab - 1)] + list(range(2, prompt_len + 1))

    def prefill_only():
        slot = runner.kv.add_request()
        runner.prefill([slot], [prompt()])
        runner.free(slot)

    out = {"prefill_graph_bucket": key[0] if key else None}
    try:
        for suffix, use in (("", graphs), ("_eager", None)):
            runner.prefill_graphs = use
            for name, fn in (("generate", lambda: llm.generate(prompt(), params)), ("prefill", prefill_only)):
                out[f"{name}{suffix}_ms"] = _time(fn, runner, reps)
    finally:
        runner.prefill_graphs = graphs
    return out


def _time(step, runner, reps=10):
    step()  # warm (also grows each request by one token per call: lengths drift by reps, negligible)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _bucket_option(buckets) -> dict:
    return {} if buckets is None else {"graph_len_buckets": list(buckets)}


def graph_costs(runner) -> dict:
    """Per decode-graph KV length bucket: graphs, capture seconds (warm-up tuning included) and MiB."""
    return {str(n): {"graphs": g, "seconds": sec, "MiB": b / 2**20} for n, (g, sec, b) in
            sorted(runner.decode_graph_costs.items())}  # fmt: skip


STARTUP_MODES = ("cold", "warm", "off", "first", "first_serial")


def startup_env(mode, config_dir, fresh_dir):
    """The environment of a start-up of ``mode``. ``cold``: tuning from an empty config dir (level 1); ``warm``: the
    same dir again; ``off``: level 3. ``first`` is a first start on a new machine with what ships: level 0, an
    empty config dir and an empty Triton cache (``fresh_dir``), so every kernel compiles, the cached configs of each
    tuned kernel on the tuner's compile threads; ``first_serial`` the same on one compile thread."""
    if mode not in STARTUP_MODES:
        raise ValueError(f"start-up mode expected one of {STARTUP_MODES}, got {mode!r}")
    env = {**os.environ, "LIGHTLLM_AUTOTUNE_CONFIG_DIR": config_dir,
           "LIGHTLLM_TRITON_AUTOTUNE_LEVEL": {"off": "3", "cold": "1", "warm": "1"}.get(mode, "0")}  # fmt: skip
    env.pop("LIGHTLLM_AUTOTUNE_COMPILE_THREADS", None)
    if mode.startswith("first"):
        env.update(LIGHTLLM_AUTOTUNE_CONFIG_DIR=os.path.join(fresh_dir, "configs"),
                   TRITON_CACHE_DIR=os.path.join(fresh_dir, "triton"))  # fmt: skip
        if mode == "first_serial":
            env["LIGHTLLM_AUTOTUNE_COMPILE_THREADS"] = "1"
    return env


def startup_seconds(model_dir, mode, config_dir, buckets=None):
    """A fresh process started as ``startup_env`` says. Returns the whole start-up, the runner's seconds per phase
    and its decode graphs' cost per KV length bucket (``decode_graph_buckets``)."""
    with tempfile.TemporaryDirectory(prefix="first-start-") as fresh:
        return _startup_seconds(model_dir, mode, startup_env(mode, config_dir, fresh), buckets)


def _startup_seconds(model_dir, mode, env, buckets):
    code = ("import json, time; t=time.perf_counter(); from lightllm import LLM; "
            f"llm = LLM({model_dir!r}, data_type='bf16', running_max_req_size=64, graph_max_batch_size=64, "
            "max_req_total_len=32768, graph_max_len_in_batch=32768, batch_max_tokens=8192, "
            f"**{_bucket_option(buckets)!r}); "
            "print('STARTUP', json.dumps({'total': time.perf_counter()-t, **llm.runner.startup_seconds, "
            "'decode_graph_buckets': {str(n): {'graphs': g, 'seconds': s, 'MiB': b / 2**20} for n, (g, s, b) in "
            "sorted(llm.runner.decode_graph_costs.items())}}))")  # fmt: skip
    done = procs.run([sys.executable, "-c", code], env=env)
    if done.returncode != 0:
        raise RuntimeError(f"start-up ({mode}) exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.split("STARTUP")[-1])


def describe_graph_costs(costs: dict) -> str:
    return "; ".join(f"<={n}: {c['graphs']} in {c['seconds']:.1f} s, {c['MiB']:.1f} MiB" for n, c in costs.items())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("qwen3", "qwen3.5"), default="qwen3")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--kv-len", type=int, default=4096)
    p.add_argument("--out", default="benchmarks/results/decode_step.json")
    p.add_argument("--no-startup", action="store_true")
    p.add_argument("--startup-modes", nargs="+", default=["cold", "warm", "off"], choices=STARTUP_MODES,
                   help="start-ups to time, in order (startup_env); first / first_serial: a new machine's first "
                   "start with the shipped configs, on the compile threads / on one")  # fmt: skip
    p.add_argument(
        "--tune-level",
        type=int,
        default=1,
        choices=(0, 1),
        help="1: tune from an empty config dir, as a first start; 0: defaults and shipped configs (quick)",
    )
    p.add_argument("--profile-batch", type=int, help="also record GPU time per kernel of the graph step at this batch")
    p.add_argument("--ttft-prompt", type=int, default=128, help="prompt tokens of the time-to-first-token row")
    p.add_argument(
        "--graph_len_buckets",
        "--graph-len-buckets",
        type=int,
        nargs="*",
        default=None,
        help="the server flag's KV length buckets (default: the engine's); the flag alone: one bucket",
    )
    p.add_argument("--pdl", action="store_true", help="launch the kernels that support it with programmatic dependent "
                   "launch (kernels/pdl.py; not the engine's default): compare against a run without")  # fmt: skip
    p.add_argument("--pdl-ab", type=int, default=0, metavar="ROUNDS", help="also capture each batch's step with "
                   "programmatic dependent launch and time its replays against the plain graph's in ROUNDS "
                   "alternating rounds, in this process (resolves what the spread of processes hides)")  # fmt: skip
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_step.py needs a CUDA GPU")
    if args.pdl_ab < 0 or (args.pdl_ab and args.pdl):
        sys.exit("--pdl-ab: expected a round count >= 1 and no --pdl (it times both sides itself)")
    if args.pdl:
        direct_launch.set_pdl(True)  # before the engine captures its graphs; a ValueError names what is missing
    bw = bandwidths_gbs()
    floor_gbs = max(bw.values())
    with tempfile.TemporaryDirectory() as root:
        model_dir = build_model(root, args.layers, args.model)
        # graphs replay the configs tuned at their capture (level 1 from an empty dir, as a first start)
        os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = os.path.join(root, "configs")
        os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = str(args.tune_level)
        llm, rows = step_times(model_dir, args.batches, args.kv_len, 2 * args.kv_len, args.profile_batch,
                               args.graph_len_buckets, args.pdl_ab)  # fmt: skip
        c = llm.runner.config
        weight_bytes = step_weight_bytes(llm.runner.model.w)
        state_bytes = _state_bytes_per_request(llm.runner.model)
        for r in rows:
            kv = 2 * c.num_kv_layers * r["batch"] * args.kv_len * c.num_key_value_heads * c.head_dim * 2
            state = 2 * r["batch"] * state_bytes  # read and written once per step
            r["floor_ms"] = (weight_bytes + kv + state) / floor_gbs / 1e6
            r["graph_over_floor"] = r["graph_ms"] / r["floor_ms"]
            r["replay_over_floor"] = r["replay_ms"] / r["floor_ms"]
            if "replay_pdl_ms" in r:
                r["replay_pdl_over_floor"] = r["replay_pdl_ms"] / r["floor_ms"]
        result = {"device": torch.cuda.get_device_name(), "model": args.model, "pdl": args.pdl, "pdl_ab": args.pdl_ab,
                  "bandwidth_GBs": bw, "layers": args.layers, "kv_len": args.kv_len, "tune_level": args.tune_level,
                  "first_start_s": llm.runner.startup_seconds, "graph_len_buckets": llm.runner.args.graph_lens(),
                  "first_start_decode_graph_buckets": graph_costs(llm.runner), "rows": rows,
                  "startup_s": {}}  # fmt: skip
        result["ttft"] = {"prompt_tokens": args.ttft_prompt, **ttft_ms(llm, args.ttft_prompt)}
        tflops = matmul_tflops()
        # a bound, not a target: read the weights once, plus the prompt's matmul FLOPs at the measured bf16 rate
        flops_ms = ttft_floor_flops(llm.runner.model.w, args.ttft_prompt) / tflops / 1e9
        result["ttft"].update(floor_ms=weight_bytes / floor_gbs / 1e6 + flops_ms, matmul_tflops=tflops)
        save(args.out, result)  # the step times survive a start-up run cut short
        if not args.no_startup:
            del llm
            gc.collect()  # the children size their KV pools from free memory
            torch.cuda.empty_cache()
            with tempfile.TemporaryDirectory() as cfg:
                for mode in args.startup_modes:
                    result["startup_s"][mode] = startup_seconds(model_dir, mode, cfg, args.graph_len_buckets)
                    print(mode, json.dumps(result["startup_s"][mode]), flush=True)
                    save(args.out, result)
    print(f"{result['device']}: copy {bw['copy']:.0f} GB/s, GEMV {bw['gemv']:.0f} GB/s (floor at the faster), "
          f"{args.layers} layers, KV {args.kv_len} tokens/request")  # fmt: skip
    t = result["ttft"]
    graph = f"the {t['prefill_graph_bucket']}-token prefill graph" if t["prefill_graph_bucket"] else "no prefill graph"
    print(
        f"time to first token, {t['prompt_tokens']}-token prompt: {t['generate_ms']:.2f} ms with {graph} (prefill "
        f"forward {t['prefill_ms']:.2f} ms), {t['generate_eager_ms']:.2f} ms eager (prefill forward "
        f"{t['prefill_eager_ms']:.2f} ms); floor {t['floor_ms']:.2f} ms"
    )
    print("graph ms: runner.decode with a graph (host preparation included); replay ms: the graph's replays alone")
    pdl = " replay ms PDL  PDL/plain  replay PDL/floor" if args.pdl_ab else ""
    print(" batch  eager ms  graph ms  replay ms  floor ms  graph/floor  replay/floor" + pdl)
    for r in rows:
        print(f"{r['batch']:6d} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} {r['replay_ms']:10.3f} {r['floor_ms']:9.3f} "
              f"{r['graph_over_floor']:12.3f} {r['replay_over_floor']:13.3f}", end="")  # fmt: skip
        if args.pdl_ab:
            print(f" {r['replay_pdl_ms']:13.3f} {r['pdl_over_plain']:10.3f} {r['replay_pdl_over_floor']:17.3f}", end="")
        print()
    first = describe_graph_costs(result["first_start_decode_graph_buckets"])
    print(f"decode graphs per KV length bucket {result['graph_len_buckets']}, first start: {first}")
    for mode, phases in result["startup_s"].items():
        seconds = ", ".join(f"{k} {v:.1f}s" for k, v in phases.items() if k != "decode_graph_buckets")
        print(f"start-up {mode}: {seconds}; decode graphs {describe_graph_costs(phases['decode_graph_buckets'])}")


def save(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _step_weights(w):
    """Weights a decode step reads in full (the embedding is only gathered)."""
    yield w.lm_head
    yield w.final_norm
    for lw in w.layers:
        yield from (t for t in vars(lw).values() if isinstance(t, torch.Tensor))


def _step_storages(w) -> dict:
    """``{storage address: (bytes, element size)}`` of :func:`_step_weights`, each storage whole and once: the layers
    keep ``[in, out]`` views of their linears beside the weights (one ``torch.mm`` per GEMM), which counted per tensor
    doubled every linear's bytes and FLOPs."""
    return {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), t.element_size()) for t in _step_weights(w)}


def step_weight_bytes(w) -> int:
    return sum(nbytes for nbytes, _ in _step_storages(w).values())


def step_weight_params(w) -> int:
    return sum(nbytes // size for nbytes, size in _step_storages(w).values())


def ttft_floor_flops(w, prompt_tokens: int, requests: int = 1) -> int:
    """Matmul FLOPs of a prefill of ``requests`` prompts of ``prompt_tokens`` tokens in all: every step weight times
    every token, but the lm_head only for each request's last token (the prefill's logits rows)."""
    lm_head = w.lm_head.numel()
    return 2 * (step_weight_params(w) - lm_head) * prompt_tokens + 2 * lm_head * requests


def _state_bytes_per_request(model) -> int:
    """Linear-attention state (conv + recurrent) of one request over every layer; 0 for a model without it."""
    linear = getattr(model, "linear", None)
    if linear is None:
        return 0
    conv, ssm = linear.state.conv, linear.state.ssm
    return (conv[:, 0].numel() * conv.element_size()) + (ssm[:, 0].numel() * ssm.element_size())


if __name__ == "__main__":
    main()
