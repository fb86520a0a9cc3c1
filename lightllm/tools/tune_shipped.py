"""Tune this GPU's configs for common model shapes and write them in the shipped layout.

Each shape is a random model with the widths and vocabulary of a real one and the fewest layers that hold every
layer kind (the tuned kernels are keyed by widths, heads and dtypes, never by depth): one layer for Qwen3, one
linear-attention and one full-attention layer for Qwen3.5, plus its MTP head when MTP starts are planned. Each
start (shape, decode variant, graph length, MTP step) runs at ``LIGHTLLM_TRITON_AUTOTUNE_LEVEL=1`` in a fresh
process: its start-up tunes exactly what a server of that shape tunes (GENERAL prefill kernels, then every decode
graph size in the DECODE_ATTENTION warm-up). The configs land in a scratch config folder and are exported into
``--out`` (merged with what is there) after every start, also one that failed, ran out of ``--per-start-timeout`` or
was stopped by SIGTERM (each search is written as it ends, so a stopped start keeps what it finished):

    python -m lightllm.tools.tune_shipped --out lightllm/common/autotuner/configs --shapes qwen3-8b
    python -m lightllm.tools.tune_shipped --out DIR --shapes qwen3.5-27b --dry-run   # list the starts only
    python -m lightllm.tools.tune_shipped --out DIR --shapes qwen3.5-27b --variants triton --mtp-only
    python -m lightllm.tools.tune_shipped --out lightllm/common/autotuner/configs --variants int8kv int4kv \
        --retune gqa_flash_decode_int8kv gqa_flash_decode_int4kv     # after a kernel change: search shipped keys again

Each start's line names the searches its log reports per kernel, their seconds and the kernels they compiled ahead
(where a first start's time goes); ``--log-dir`` keeps the logs themselves.
"""

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from lightllm.common import proc as procs
from lightllm.common.cli import OneLineParser
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, QWEN3_8B_SHAPE

QWEN3_D128 = dict(head_dim=128, num_key_value_heads=8)
# intermediate_size is the checkpoint's: the fused SiLU-and-mul kernel is keyed by it
QWEN3_SHAPES = {
    "builtin": dict(BUILTIN_SHAPE),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, **QWEN3_D128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, **QWEN3_D128),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, **QWEN3_D128),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, **QWEN3_D128),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=40, **QWEN3_D128),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, **QWEN3_D128),
}
# Hybrid Qwen3.5 (gated DeltaNet + gated attention, 3:1 in the checkpoint), widths of its text config
QWEN3_5_SHAPES = {
    "qwen3.5-27b": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=48,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),  # fmt: skip
}
SHAPES = {**QWEN3_SHAPES, **QWEN3_5_SHAPES}
# The checkpoints' vocabularies: the lm_head GEMM is a tuned kernel keyed by it (N = vocabulary rows)
VOCABS = {**{name: QWEN3_8B_SHAPE["padded_vocab_size"] for name in QWEN3_SHAPES if name != "builtin"},
          "qwen3.5-27b": 248320}  # fmt: skip
VARIANTS = ("triton", "fa3", "int8kv", "int4kv")  # decode backend or quantized KV type (Triton decode)
MTP_VARIANTS = ("triton", "fa3")  # MTP verify reads unquantized KV
HYBRID_LAYERS = ("linear_attention", "full_attention")  # one of each kind

# One start in a child process: the GPU memory of each start is returned before the next.
_START = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from lightllm import LLM
kw = json.loads(sys.argv[1])
llm = LLM(kw.pop("model_dir"), **kw)
print("STARTUP " + json.dumps(llm.runner.startup_seconds), flush=True)
os._exit(0)  # every search is on disk; two H200 MTP starts had not exited 34 and 45 s after this line (unprofiled)
"""


@dataclass(frozen=True)
class Start:
    """One start-up to tune: a shape's model, a decode variant, a graph length and an MTP step (0: no MTP)."""

    shape: str
    variant: str
    graph_len: int
    mtp_step: int = 0

    def describe(self) -> str:
        mtp = f"  mtp_step {self.mtp_step}" if self.mtp_step else ""
        return f"{self.shape:12} {self.variant:7} graph len {self.graph_len:6d}{mtp}"


def plan_starts(
    shapes: List[str], variants: List[str], graph_lens: List[int], mtp_step: int, mtp_only: bool = False
) -> List[Start]:
    """Every start, in order: per shape, variant and graph length a plain start, then (Qwen3.5 shapes, Triton and
    FA3 decode, ``mtp_step`` > 0) the same with MTP, whose verify and draft graphs tune their own kernels.
    ``mtp_only``: the MTP starts alone (their plain starts' kernels already tuned)."""
    starts = []
    for shape, variant, graph_len in itertools.product(shapes, variants, graph_lens):
        if not mtp_only:
            starts.append(Start(shape, variant, graph_len))
        if mtp_step and shape in QWEN3_5_SHAPES and variant in MTP_VARIANTS:
            starts.append(Start(shape, variant, graph_len, mtp_step))
    return starts


def build_model(out_dir: Path, widths: dict, max_len: int, mtp: bool = False, vocab: int = 0) -> Path:
    """A bf16 random model folder with ``widths`` and one layer of each kind: Qwen3.5 (one linear-attention and
    one full-attention layer, with its MTP head when ``mtp``) when ``widths`` name linear-attention heads, else
    Qwen3 (one layer; ``mtp`` must be False). ``vocab``: embedding and lm_head rows (0: the small tokenizer's own),
    so the lm_head GEMM is tuned at the checkpoint's width."""
    from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5

    common = dict(vocab_size=512, padded_vocab_size=vocab, dtype="bfloat16", max_position_embeddings=max_len)
    if "linear_num_key_heads" in widths:
        return make_tiny_qwen3_5(out_dir, layer_types=HYBRID_LAYERS, mtp=mtp, **common, **widths)
    if mtp:
        raise ValueError(f"mtp=True expected a Qwen3.5 shape (with linear-attention heads), got widths {widths}")
    return make_tiny_qwen3(out_dir, num_hidden_layers=1, **common, **widths)


def _start_kwargs(model_dir: str, variant: str, graph_len: int, mtp_step: int = 0, buckets=()) -> dict:
    """The ``LLM`` arguments of one start. ``buckets``: decode graphs per KV length bucket below ``graph_len`` (the
    engine's ``graph_len_buckets``), each tuned on the lengths it serves and stored under its served range."""
    kv_type = variant if variant.endswith("kv") else "None"
    backend = variant if not variant.endswith("kv") else "triton"
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=mtp_step) if mtp_step else {}
    below = [b for b in buckets if b < graph_len]
    return dict(model_dir=model_dir, data_type="bf16", llm_kv_type=kv_type, llm_decode_att_backend=backend,
                max_req_total_len=graph_len, graph_max_len_in_batch=graph_len, batch_max_tokens=8192,
                **({"graph_len_buckets": below} if below else {}), **mtp)  # fmt: skip


_SEARCH = re.compile(r"autotune (\S+) .* (\d+) candidates in ([0-9.]+)s")
_AHEAD = re.compile(r"; (\d+) kernels compiled ahead in ([0-9.]+)s")


def search_summary(log_text: str) -> str:
    """Per tuned kernel, the searches a start's log reports and their seconds (the tuner logs one line per search),
    with the kernels those searches compiled ahead and that part of the seconds: where a start's time went, e.g.
    ``gqa_flash_decode 19 searches 143.2 s (34 kernels compiled ahead in 8.7 s); rmsnorm 2 searches 0.4 s``."""
    per: dict = {}  # kernel -> [searches, seconds, kernels compiled ahead, their seconds]
    for line in log_text.splitlines():
        found = _SEARCH.search(line)
        if found is None:
            continue
        row = per.setdefault(found.group(1), [0, 0.0, 0, 0.0])
        row[0], row[1] = row[0] + 1, row[1] + float(found.group(3))
        ahead = _AHEAD.search(line, found.end())
        if ahead:
            row[2], row[3] = row[2] + int(ahead.group(1)), row[3] + float(ahead.group(2))
    ranked = sorted(per.items(), key=lambda item: -item[1][1])
    parts = [f"{k} {n} searches {t:.1f} s" + (f" ({a} kernels compiled ahead in {c:.1f} s)" if a else "")
             for k, (n, t, a, c) in ranked]  # fmt: skip
    return "; ".join(parts) or "no searches"


def _run_start(kwargs: dict, config_dir: Path, timeout: Optional[float], log_path: Path,
               ignore_shipped: Sequence[str] = ()) -> float:  # fmt: skip
    """Seconds the start took; RuntimeError naming the start when it fails or runs out of ``timeout``. Its output
    goes to ``log_path`` (kept for a stopped start too). ``ignore_shipped``: kernels whose shipped configs the start
    does not read (``LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED``), so it searches their keys."""
    env = {**os.environ, "LIGHTLLM_TRITON_AUTOTUNE_LEVEL": "1", "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(config_dir)}
    if ignore_shipped:
        env["LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED"] = ",".join(ignore_shipped)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        try:  # its tree is stopped however we end, a timeout included
            cmd = [sys.executable, "-c", _START, json.dumps(kwargs)]
            with procs.running(cmd, stdout=log, stderr=subprocess.STDOUT, env=env) as proc:
                code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"start {kwargs} ran out of --per-start-timeout {timeout:g} s and was stopped "
                               f"({search_summary(log_path.read_text())})") from None  # fmt: skip
    if code != 0:
        tail = "\n".join(log_path.read_text().strip().splitlines()[-5:])
        raise RuntimeError(f"start {kwargs} failed (exit {code}):\n{tail}")
    return time.perf_counter() - t


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    from lightllm.common.autotuner.__main__ import _export_dir_problem  # the export's own check of --out

    p = OneLineParser(prog="python -m lightllm.tools.tune_shipped", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True, help="folder to create or export into (the shipped one to ship them)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="repeats are dropped")
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="decode backends / quantized KV types to tune (fa3 needs a Hopper GPU and an FA3 build); repeats are "
        "dropped",
    )
    p.add_argument("--graph-lens", nargs="+", type=int, default=[4096, 32768],
                   help="graph_max_len_in_batch values (each a run key of decode attention); repeats are "
                   "dropped")  # fmt: skip
    p.add_argument("--graph-len-buckets", nargs="+", type=int, default=[], metavar="LEN",
                   help="also capture decode graphs per KV length bucket in each start (the server's "
                   "--graph_len_buckets; those below the start's graph length), so each bucket's configs are "
                   "tuned for the lengths it serves; default none")  # fmt: skip
    p.add_argument("--mtp-step", type=int, default=3,
                   help="Qwen3.5 shapes: also start with --mtp_mode eagle_with_att --mtp_step N (triton and fa3 "
                   "variants; 1-4), 0 for no MTP starts")  # fmt: skip
    p.add_argument(
        "--mtp-only",
        action="store_true",
        help="run the MTP starts alone (Qwen3.5 shapes, triton and fa3 variants), not the plain ones",
    )
    p.add_argument("--per-start-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop a start that runs longer (its finished searches are kept); default none")  # fmt: skip
    p.add_argument("--log-dir", default=None,
                   help="keep each start's output there, a folder to create or write into (default: a temporary "
                   "folder, removed at the end)")  # fmt: skip
    p.add_argument("--retune", nargs="+", default=[], metavar="KERNEL",
                   help="search these tuned kernels' keys again although configs ship for them (all: every kernel), "
                   "e.g. after a kernel change; their shipped configs are not read during the starts "
                   "(LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED), and the export replaces the keys it tuned")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the starts it would run, and run nothing")
    args = p.parse_args(argv)
    known = shipped_kernels()
    unknown = sorted(set(args.retune) - known - {"all"})
    if unknown or ("all" in args.retune and len(set(args.retune)) > 1):
        p.error(f"--retune expected 'all' or kernels with shipped configs ({', '.join(sorted(known))}), got "
                f"{args.retune}")  # fmt: skip
    # a graph length is the model's context too (build_model): the engine serves none under 2 tokens
    short = [n for n in args.graph_lens if n < 2]
    if short:
        p.error(f"--graph-lens expected lengths of at least 2 (one prompt token and one generated), got {short}")
    bad = [n for n in args.graph_len_buckets if n < 1]
    if bad:
        p.error(f"--graph-len-buckets expected positive lengths, got {bad}")
    args.graph_len_buckets = sorted(set(args.graph_len_buckets))
    # a repeat would plan every start it names again (hours of GPU time for nothing): dropped, in the given order
    args.shapes = list(dict.fromkeys(args.shapes))
    args.variants = list(dict.fromkeys(args.variants))
    args.graph_lens = list(dict.fromkeys(args.graph_lens))
    # before any start: a path that cannot be a folder would fail each export after its hour of tuning
    for flag, path in (("--out", args.out), ("--log-dir", args.log_dir)):
        problem = None if path is None else _export_dir_problem(path)
        if problem is not None:
            p.error(f"{flag} {path!r} {problem}; expected a folder to create or write into")
    args.log_dir = None if args.log_dir is None else Path(args.log_dir)
    if not 0 <= args.mtp_step <= 4:
        p.error(f"--mtp-step expected 0 (no MTP starts) or a draft count in [1, 4], got {args.mtp_step}")
    if args.mtp_only and not args.mtp_step:
        p.error("--mtp-only expected --mtp-step in [1, 4], got 0 (no MTP starts: nothing would run)")
    if args.per_start_timeout is not None and not 0 < args.per_start_timeout < float("inf"):
        p.error(f"--per-start-timeout expected a positive number of seconds, got {args.per_start_timeout:g}")
    return args


def shipped_kernels() -> set:
    """Names of the tuned kernels with configs in the package, for any Triton version and GPU."""
    from lightllm.common.autotuner import store

    return {p.name for p in store.iter_kernel_dirs(store.SHIPPED_ROOT)}


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the running start is stopped, what was tuned exported


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(argv)
    starts = plan_starts(args.shapes, args.variants, args.graph_lens, args.mtp_step, args.mtp_only)
    if args.dry_run:
        for start in starts:
            print(start.describe())
        print(f"{len(starts)} starts")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: tuning needs a CUDA GPU (the CPU device runs the torch references)", file=sys.stderr)
        return 2
    if not starts:
        print("error: no start to run (--mtp-only with no Qwen3.5 shape or no triton/fa3 variant)", file=sys.stderr)
        return 2
    from lightllm.common.autotuner import store
    from lightllm.common.autotuner.__main__ import main as autotuner_cli

    if args.log_dir is not None:
        try:  # before any start: an unwritable place is one line, not a traceback
            args.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(
                f"error: --log-dir {str(args.log_dir)!r} cannot be created ({type(e).__name__}: {e})", file=sys.stderr
            )
            return 2
    failed, status, exported = [], 0, False
    sigterm = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="lightllm-tune-") as tmp:
        config_dir = Path(tmp) / "configs"
        log_dir = args.log_dir or Path(tmp) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        # what the in-process export reads from; put back at the end
        previous = os.environ.get("LIGHTLLM_AUTOTUNE_CONFIG_DIR")
        os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = str(config_dir)

        def export() -> None:
            # after every start, also one stopped by SIGTERM (a job's time limit): a run cut short keeps its tuning
            nonlocal status, exported
            if any(store.iter_config_files(config_dir)):
                status = autotuner_cli(["export", args.out]) or status
                exported = True

        try:
            for shape in args.shapes:
                mine = [s for s in starts if s.shape == shape]
                if not mine:
                    continue
                mtp = any(s.mtp_step for s in mine)
                model_dir = build_model(
                    Path(tmp) / shape, SHAPES[shape], max(args.graph_lens), mtp=mtp, vocab=VOCABS.get(shape, 0)
                )
                for start in mine:
                    kwargs = _start_kwargs(str(model_dir), start.variant, start.graph_len, start.mtp_step,
                                           args.graph_len_buckets)  # fmt: skip
                    log_path = log_dir / f"{shape}-{start.variant}-{start.graph_len}-mtp{start.mtp_step}.log"
                    try:
                        seconds = _run_start(kwargs, config_dir, args.per_start_timeout, log_path, args.retune)
                    except RuntimeError as e:
                        failed.append(start)
                        print(f"{start.describe()}: FAILED, {e}", file=sys.stderr, flush=True)
                        continue
                    except SystemExit:
                        summary = search_summary(log_path.read_text()) if log_path.exists() else "no searches"
                        print(f"{start.describe()}: stopped by SIGTERM ({summary}); later starts not run",
                              file=sys.stderr, flush=True)  # fmt: skip
                        raise
                    finally:
                        export()
                    print(f"{start.describe()}: {seconds:6.1f} s ({search_summary(log_path.read_text())})",
                          flush=True)  # fmt: skip
        finally:
            signal.signal(signal.SIGTERM, sigterm)
            if previous is None:
                os.environ.pop("LIGHTLLM_AUTOTUNE_CONFIG_DIR", None)
            else:
                os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = previous
    if failed:
        print(f"{len(failed)} of {len(starts)} starts failed (what they tuned before failing was exported):",
              file=sys.stderr)  # fmt: skip
        for start in failed:
            print(f"  {start.describe()}", file=sys.stderr)
        return 1
    if not exported:
        # every key was already shipped (the scratch cache starts empty): done, not an export failure
        why = (
            f"no start searched {', '.join(args.retune)}"
            if args.retune
            else "every start found its configs already shipped"
        )
        print(f"nothing new to export: {why}, {args.out} is unchanged")
    return status


if __name__ == "__main__":
    sys.exit(main())
