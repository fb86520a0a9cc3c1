"""Tune this GPU's configs for common model shapes and write them in the shipped layout.

Each shape is a one-layer random model with the widths of a real one (the tuned kernels are keyed by widths,
heads and dtypes, never by depth), started once per KV type, decode backend and graph length at
``LIGHTLLM_TRITON_AUTOTUNE_LEVEL=1`` in a fresh process: its start-up tunes exactly what a server of that shape
tunes (GENERAL prefill kernels, then every decode graph size in the DECODE_ATTENTION warm-up). The configs land in
a scratch config folder and are exported into ``--out`` (merged with what is there):

    python -m lightllm.tools.tune_shipped --out lightllm/common/autotuner/configs --shapes qwen3-8b
"""

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from lightllm.common import proc as procs
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE

QWEN3_D128 = dict(head_dim=128, num_key_value_heads=8)
SHAPES = {
    "builtin": dict(BUILTIN_SHAPE),
    "qwen3-0.6b": dict(hidden_size=1024, num_attention_heads=16, **QWEN3_D128),
    "qwen3-1.7b": dict(hidden_size=2048, num_attention_heads=16, **QWEN3_D128),
    "qwen3-4b": dict(hidden_size=2560, num_attention_heads=32, **QWEN3_D128),
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, **QWEN3_D128),
    "qwen3-14b": dict(hidden_size=5120, num_attention_heads=40, **QWEN3_D128),
    "qwen3-32b": dict(hidden_size=5120, num_attention_heads=64, **QWEN3_D128),
}
VARIANTS = ("triton", "fa3", "int8kv", "int4kv")  # decode backend or quantized KV type (Triton decode)

# One start in a child process: the GPU memory of each start is returned before the next.
_START = """
import json, sys
from lightllm import LLM
kw = json.loads(sys.argv[1])
llm = LLM(kw.pop("model_dir"), **kw)
print("STARTUP " + json.dumps(llm.runner.startup_seconds))
"""


def _start_kwargs(model_dir: str, variant: str, graph_len: int) -> dict:
    kv_type = variant if variant.endswith("kv") else "None"
    backend = variant if not variant.endswith("kv") else "triton"
    return dict(model_dir=model_dir, data_type="bf16", llm_kv_type=kv_type, llm_decode_att_backend=backend,
                max_req_total_len=graph_len, graph_max_len_in_batch=graph_len, batch_max_tokens=8192)  # fmt: skip


def _run_start(kwargs: dict, config_dir: Path) -> float:
    env = {**os.environ, "LIGHTLLM_TRITON_AUTOTUNE_LEVEL": "1", "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(config_dir)}
    t = time.perf_counter()
    done = procs.run([sys.executable, "-c", _START, json.dumps(kwargs)], env=env)  # its tree stopped however we end
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"start {kwargs} failed (exit {done.returncode}):\n{tail}")
    return time.perf_counter() - t


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightllm.tools.tune_shipped", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True, help="folder to export into (the shipped one to ship them)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="decode backends / quantized KV types to tune (fa3 needs a Hopper GPU and an FA3 build)",
    )
    p.add_argument("--graph-lens", nargs="+", type=int, default=[4096, 32768],
                   help="graph_max_len_in_batch values (each a run key of decode attention)")  # fmt: skip
    args = p.parse_args(argv)
    bad = [n for n in args.graph_lens if n < 1]
    if bad:
        p.error(f"--graph-lens expected positive lengths, got {bad}")
    import torch

    if not torch.cuda.is_available():
        print("error: tuning needs a CUDA GPU (the CPU device runs the torch references)", file=sys.stderr)
        return 2
    from lightllm.common.autotuner.__main__ import main as autotuner_cli
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    with tempfile.TemporaryDirectory(prefix="lightllm-tune-") as tmp:
        config_dir = Path(tmp) / "configs"
        for shape in args.shapes:
            widths = SHAPES[shape]
            widths = {"intermediate_size": 2 * widths["hidden_size"], **widths}  # GEMMs are not tuned: any size
            model_dir = make_tiny_qwen3(Path(tmp) / shape, num_hidden_layers=1, vocab_size=512, dtype="bfloat16",
                                        max_position_embeddings=max(args.graph_lens), **widths)  # fmt: skip
            for variant, graph_len in itertools.product(args.variants, args.graph_lens):
                seconds = _run_start(_start_kwargs(str(model_dir), variant, graph_len), config_dir)
                print(f"{shape:12} {variant:8} graph len {graph_len:6d}: {seconds:6.1f} s", flush=True)
        os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = str(config_dir)
        return autotuner_cli(["export", args.out])


if __name__ == "__main__":
    sys.exit(main())
