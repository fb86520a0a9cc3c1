"""Registers, spilled bytes and shared memory of decode attention's stage-1 kernel for each tuned candidate, compiled
for a GPU architecture on any machine: Triton compiles to a cubin without a GPU, and its bundled ``cuobjdump`` reads the
cubin's resources. Nothing is timed; it shows what a GPU table cannot: a candidate that spills, one whose registers or
shared memory leave few warps resident per SM (fewer loads in flight for a memory-bound kernel), and how many
dequantized K/V tiles the compiler stages through shared memory (from its TTGIR: a 16-bit ``[BLOCK_N, D/2]`` register
tensor written to shared memory, then read back in the dot's operand layout, behind a barrier; summed over the kernel's
copies of the block body). From the SASS of the main loop (the longest backward branch): its instructions per tile,
barriers, synchronous global loads (``LDG``: latency a tile waits on, where the pipeline's async copies, ``LDGSTS``,
hide it), register moves (``MOV``, ``IMAD.MOV``) and the layout conversions in its TTGIR. Each candidate compiles as the
launcher runs it, register cap included (``flash_decode.register_cap``; ``--maxnreg`` sets others). Rows marked ``qk``
in a saved run were compiled with ``benchmarks/patches/stage1_qk_int8.patch`` applied (its ``--qk-int8``: the integer QK
dot).

    python benchmarks/decode_stage1_resources.py --out benchmarks/results/decode_stage1_resources_sm90.json
    python benchmarks/decode_stage1_resources.py --analyze benchmarks/results/decode_stage1_resources_sm90.json

One row per (shape, KV type, quant group, BLOCK_N, num_warps, num_stages, MIN_BLOCKS): WAVES only sizes the grid,
so candidates that differ in it share a compile.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

from bench_io import save_json

# the models' decode shapes: q heads, kv heads, head_dim (benchmarks/decode_attention.py's names)
SHAPES = {"hq32-hk8-d128": (32, 8, 128), "hq24-hk4-d256": (24, 4, 256)}
KINDS = ("none", "int8", "int4")
REGS_PER_SM = 65536  # sm_80 / sm_90 register file (32-bit registers)
SCHEDULERS_PER_SM = 4  # each warp takes its registers from its scheduler's quarter of the file
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SHARED_KIB_PER_SM = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228}  # the CUDA guide's shared memory per SM
RESERVED_SHARED_PER_BLOCK = 1024  # the driver's per-block reservation (sm_80 and later)
WAVES = (1, 2, 4, 8, 16, 32)  # the tuned candidates' WAVES values (flash_decode.*_configs; a test checks)
_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.A-Z0-9_]*)\s*([^;]*);")


def _kernels():
    """Imported late so ``--analyze`` needs no Triton."""
    from lightllm.common.kv_cache.quant import INT4_OFFSET
    from lightllm.kernels.attention.decode import flash_decode
    from lightllm.kernels.attention.decode.stage1 import decode_stage1_kernel
    from lightllm.kernels.launch_math import next_power_of_2

    return flash_decode, decode_stage1_kernel, INT4_OFFSET, next_power_of_2


def distinct_configs(configs: list) -> list:
    """The candidates' compile-relevant keys, once each, in the candidates' order."""
    out = []
    for cfg in configs:
        key = {k: cfg[k] for k in ("BLOCK_N", "num_warps", "num_stages")}
        key["MIN_BLOCKS"] = cfg.get("MIN_BLOCKS", 1)
        if key not in out:
            out.append(key)
    return out


def signature(arg_names, constexprs: dict, kind: str) -> dict:
    """Triton's type string per argument: bf16 queries and partial outputs, the KV codes' dtype, float16 scales."""
    codes = {"none": "*bf16", "int8": "*i8", "int4": "*u8"}[kind]
    types = {
        "Q": "*bf16",
        "K": codes,
        "V": codes,
        "K_scale": "*fp16",
        "V_scale": "*fp16",
        "mid_o": "*fp32",
        "mid_lse": "*fp32",
        "qk_scale": "fp32",
        **{n: "*i32" for n in ("req_to_token", "b_req_idx", "b_seq_len")},
    }
    return {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in arg_names}


def int_args(shape, kind: str, group: int, splits: int = 32, table_width: int = 32768) -> dict:
    """The integer arguments as a batch of the model's tensors gives them (q ``[B, hq, D]``, the pool ``[T, hk, D]``,
    half as wide for INT4, scales ``[T, hk, D / group]``, partials ``[B, hq, splits, D]``)."""
    hq, hk, d = shape
    width = d // 2 if kind == "int4" else d
    groups = d // group if kind != "none" else width  # bf16: the scale arguments are the pool itself
    return dict(stride_qb=hq * d, stride_qh=d, stride_kt=hk * width, stride_kh=width, stride_vt=hk * width,
                stride_vh=width, stride_kst=hk * groups, stride_ksh=groups, stride_vst=hk * groups, stride_vsh=groups,
                stride_rr=table_width, stride_mob=hq * splits * d, stride_moh=splits * d, stride_mos=d,
                stride_mlb=hq * splits, stride_mlh=splits)  # fmt: skip


def divisibility(arg_names, types: dict, ints: dict) -> dict:
    """Triton's launch-time specialization: 16-byte-aligned pointers and integers that are multiples of 16 carry
    ``tt.divisibility`` (what lets the compiler vectorize loads); without it a CPU compile would overstate
    registers."""
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(arg_names)
            if types[n].startswith("*") or ints.get(n, 1) % 16 == 0}  # fmt: skip


def parse_resources(text: str) -> dict:
    """``cuobjdump --dump-resource-usage``'s first kernel line as numbers."""
    m = _RESOURCE.search(text)
    if m is None:
        raise ValueError(f"cuobjdump printed no resource line: {text[-300:]!r}")
    return dict(zip(("regs", "stack_bytes", "shared_static", "local_bytes"), map(int, m.groups())))


def resident(regs: int, num_warps: int, shared_bytes: int = 0, arch: int = 90) -> tuple:
    """(resident warps per SM, what limits them: "regs", "smem" or "slots"): the registers are allocated per warp in
    units of 256 from the register file of the warp's scheduler (a quarter of the SM's), the shared memory with the
    per-block reservation (not counted for an arch this table does not know), whole blocks only.

    The per-scheduler split is what Nsight Compute's register limit follows on the H200: a 2-warp program of 180
    registers fits 4 blocks (two 5760-register warps per 16384-register quarter), not the 5 that 65536 / 11520
    gives; at 168 registers it fits 6 (``decode_stage1_ncu_rungs_h200.json``'s launch statistics)."""
    per_warp = -(-regs * 32 // 256) * 256
    quarter = REGS_PER_SM // SCHEDULERS_PER_SM
    limits = {
        "regs": SCHEDULERS_PER_SM * (quarter // per_warp) // num_warps,
        "slots": min(MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM),
    }
    if shared_bytes and arch in SHARED_KIB_PER_SM:
        limits["smem"] = SHARED_KIB_PER_SM[arch] * 1024 // (shared_bytes + RESERVED_SHARED_PER_BLOCK)
    why = min(limits, key=limits.get)
    return limits[why] * num_warps, why


def staged_tiles(ttgir: str, block_n: int, half_d: int) -> int:
    """Register tensors of a KV tile's shape in a 16-bit float type that the kernel writes to shared memory: the
    dequantized tiles the dot cannot take from registers (async copies of the codes allocate without a source),
    summed over the kernel's copies of the block body (with the peel: the first block, the loop, the partial last)."""
    return len(re.findall(rf"ttg\.local_alloc %\S+ : \(tensor<{block_n}x{half_d}x(?:f16|bf16),", ttgir))


def loop_stats(sass: str) -> dict:
    """The main loop's instruction mix from ``cuobjdump -sass``: the body of the longest backward branch. Register
    moves are ``MOV`` and ``IMAD.MOV`` (ptxas's move on the integer pipe): copies into an MMA's register quad."""
    ins = [(int(a, 16), op, mods, args) for a, op, mods, args in _SASS_LINE.findall(sass)]
    body = []
    for addr, op, _, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            span = [(o, m) for a, o, m, _ in ins if lo <= a <= addr]
            body = span if len(span) > len(body) else body
    ops = collections.Counter(op for op, _ in body)
    moves = sum(op == "MOV" or (op == "IMAD" and mods.startswith(".MOV")) for op, mods in body)
    return {"loop_instructions": len(body), "loop_barriers": ops["BAR"], "loop_sync_loads": ops["LDG"],
            "loop_async_copies": ops["LDGSTS"], "loop_register_moves": moves}  # fmt: skip


def loop_conversions(ttgir: str) -> int:
    """Layout conversions inside the first loop of the TTGIR (through shared memory unless register-local)."""
    start = ttgir.find("scf.for")
    return ttgir.count("ttg.convert_layout", start, ttgir.find("scf.yield", start)) if start >= 0 else 0


def compile_one(kernel, arch: int, shape, kind: str, group: int, cfg: dict, int4_offset: int, p2,
                maxnreg=None, peel=None) -> dict:  # fmt: skip
    """One candidate's resources, ``PEEL`` among them: stage 1's peel, ``peel`` or else the launcher's rule."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightllm.kernels.attention.decode.flash_decode import peel_queries

    hq, hk, d = shape
    bits = {"none": 0, "int8": 8, "int4": 4}[kind]
    peel = peel_queries(bits > 0, d) if peel is None else peel
    constexprs = dict(GROUP=hq // hk, BLOCK_H=max(16, p2(hq // hk)), HALF_D=d // 2, BLOCK_N=cfg["BLOCK_N"],
                      MIN_BLOCKS=cfg["MIN_BLOCKS"], QUANT=bits, QGROUP=group if bits else 0,
                      INT4_OFFSET=int4_offset, F16=bits > 0, ASM=bits > 0, PEEL=peel, PRECISION=None,
                      USE_PDL=False)  # fmt: skip
    types = signature(kernel.arg_names, constexprs, kind)
    attrs = divisibility(kernel.arg_names, types, int_args(shape, kind, group))
    src = ASTSource(kernel, types, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                                       **({} if maxnreg is None else {"maxnreg": maxnreg})})  # fmt: skip
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    res = parse_resources(text)
    res["PEEL"] = peel
    res["shared_bytes"] = compiled.metadata.shared
    res["staged_tiles"] = staged_tiles(compiled.asm["ttgir"], cfg["BLOCK_N"], d // 2)
    res.update(loop_stats(sass), loop_conversions=loop_conversions(compiled.asm["ttgir"]))
    return res


def run(args) -> dict:
    flash_decode, kernel, int4_offset, p2 = _kernels()
    import torch

    results = {"arch": f"sm_{args.arch}", "cells": []}
    for name in args.shapes:
        hq, hk, d = SHAPES[name]
        q = torch.empty(1, hq, d)
        for kind in args.kinds:
            space = flash_decode.split_kv_configs(q) if kind == "none" else flash_decode.quant_split_kv_configs(q)
            if args.block_n:
                space = [c for c in space if c["BLOCK_N"] in args.block_n]
            for group in [0] if kind == "none" else args.groups:
                for cfg in distinct_configs(space)[: args.max_configs]:
                    # the launcher's own register cap unless --maxnreg sets one (quantized programs only)
                    cap = flash_decode.register_cap(cfg["num_warps"], kind != "none", d)
                    cap = args.maxnreg.get(cfg["num_warps"], cap) if kind != "none" else None
                    # --peel-all: every quantized program peels its first block, whatever its head_dim
                    peel = kind != "none" if args.peel_all else None
                    res = compile_one(kernel, args.arch, SHAPES[name], kind, group, cfg, int4_offset, p2, cap, peel)
                    results["cells"].append({"shape": name, "kind": kind, "group": group, **cfg, **res})
                    print(name, kind, group, cfg, res, flush=True)
                    save_json(results, args.out)  # a cut-short run keeps what compiled
    return results


def print_table(results: dict) -> None:
    arch = int(results["arch"].removeprefix("sm_"))
    print(
        f"# decode stage 1 compiled for {results['arch']}: registers per thread, spilled bytes (stack), shared "
        "memory, the warps per SM that registers and shared memory allow (and which limits them), the "
        "dequantized K/V tiles staged through shared memory (over the kernel's copies of the block body), and the main "
        "loop's instructions, "
        "barriers, synchronous global loads, layout conversions and register moves per tile ('-': a run before that "
        "was counted; "
        "qk: compiled with benchmarks/patches/stage1_qk_int8.patch; peel: the first block before the loop, '-' where a "
        "run did not record it)"
    )
    print(f"{'shape':14s} {'kv':5s} {'grp':>3s} {'BN':>4s} {'w':>2s} {'st':>2s} {'minb':>4s} {'qk':>2s} {'peel':>4s} "
          f"{'regs':>4s} {'spill B':>7s} {'smem KiB':>8s} {'warps/SM':>8s} {'limit':>5s} {'staged':>6s} "
          f"{'loop':>5s} {'BAR':>4s} {'LDG':>4s} {'cvt':>4s} {'mov':>4s}")  # fmt: skip
    for c in results["cells"]:
        warps, why = resident(c["regs"], c["num_warps"], c["shared_bytes"], arch)
        loop = [c.get(k, "-") for k in ("staged_tiles", "loop_instructions", "loop_barriers", "loop_sync_loads",
                                        "loop_conversions", "loop_register_moves")]  # fmt: skip
        peel = {True: "y", False: "", None: "-"}[c.get("PEEL")]
        print(f"{c['shape']:14s} {c['kind']:5s} {c['group']:3d} {c['BLOCK_N']:4d} {c['num_warps']:2d} "
              f"{c['num_stages']:2d} {c['MIN_BLOCKS']:4d} {'y' if c.get('QK_INT8') else '':>2s} "
              f"{peel:>4s} {c['regs']:4d} "
              f"{c['stack_bytes']:7d} {c['shared_bytes'] / 1024:8.1f} {warps:8d} {why:>5s} {loop[0]:>6} "
              f"{loop[1]:>5} {loop[2]:>4} {loop[3]:>4} {loop[4]:>4} {loop[5]:>4}")  # fmt: skip


def wave_fill(cell: dict, batch: int, waves: int, length: int = 32768, sms: int = 132, arch: int = 90) -> tuple:
    """``(programs, slots, rounds, fill)`` of one candidate's stage-1 grid at ``batch`` requests of ``length``
    tokens: the grid ``num_splits`` gives for ``WAVES`` = ``waves``, the programs the compiled candidate keeps
    resident on ``sms`` SMs, how many rounds of them the grid needs, and the share of those rounds' slots it fills."""
    from lightllm.kernels.attention.decode.splits import splits_for_sms

    kv_heads = SHAPES[cell["shape"]][1]
    programs = batch * kv_heads * splits_for_sms(batch, kv_heads, length, cell["BLOCK_N"], waves, sms)
    slots = resident(cell["regs"], cell["num_warps"], cell["shared_bytes"], arch)[0] // cell["num_warps"] * sms
    rounds = -(-programs // slots)
    return programs, slots, rounds, programs / (rounds * slots)


def print_waves(results: dict, batches, sms: int = 132, length: int = 32768, waves=WAVES) -> None:
    """Per candidate and batch, each ``WAVES`` value's grid as ``programs/slots rounds fill``: a latency-bound kernel
    whose last round is part-full idles the rest of it (docs/decode_attention.md, register moves)."""
    arch = int(results["arch"].removeprefix("sm_"))
    print(f"# stage-1 grids at L={length} on {sms} SMs: programs / resident slots, rounds, fill of those rounds")
    print(f"{'shape':14s} {'kv':5s} {'grp':>3s} {'BN':>4s} {'w':>2s} {'st':>2s} {'B':>4s} "
          + " ".join(f"{'WAVES ' + str(w):>20s}" for w in waves))  # fmt: skip
    seen = set()
    for c in results["cells"]:
        key = (c["shape"], c["kind"], c["group"], c["BLOCK_N"], c["num_warps"], c["num_stages"], c.get("QK_INT8", 0),
               c.get("PEEL"))  # fmt: skip
        if key in seen:  # MIN_BLOCKS changes nothing here
            continue
        seen.add(key)
        for batch in batches:
            cols = []
            for w in waves:
                programs, slots, rounds, fill = wave_fill(c, batch, w, length, sms, arch)
                cols.append(f"{programs:5d}/{slots:4d} {rounds}x {100 * fill:3.0f}%")
            print(f"{c['shape']:14s} {c['kind']:5s} {c['group']:3d} {c['BLOCK_N']:4d} {c['num_warps']:2d} "
                  f"{c['num_stages']:2d} {batch:4d} " + " ".join(f"{x:>20s}" for x in cols))  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: H100/H200)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--groups", nargs="+", type=int, default=[8, 32], help="INT8/INT4 quant group sizes")
    p.add_argument("--max-configs", type=int, default=None, help="compile only the first N configs of each space")
    p.add_argument("--block-n", nargs="+", type=int, metavar="N", help="only the candidates of these BLOCK_N")
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run")
    p.add_argument(
        "--waves",
        nargs="+",
        type=int,
        metavar="B",
        help="with --analyze: each candidate's grid at these batches (programs against resident slots, rounds, fill)",
    )
    p.add_argument("--sms", type=int, default=132, help="SMs for --waves (132: H100 SXM / H200)")
    p.add_argument(
        "--waves-values",
        nargs="+",
        type=int,
        default=list(WAVES),
        metavar="W",
        help=f"the WAVES values --waves shows (default the tuned ones, {list(WAVES)})",
    )
    p.add_argument("--maxnreg", nargs="+", default=[], metavar="WARPS:REGS", help="compile INT8/INT4 programs of "
                   "WARPS warps with Triton's maxnreg REGS instead of the launcher's cap "
                   "(flash_decode.register_cap: 2:168 4:128 up to head_dim 128)")  # fmt: skip
    p.add_argument("--peel-all", action="store_true", help="compile every INT8/INT4 program with its first block "
                   "peeled (queries in registers), also where the launcher does not peel (head_dim 256)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/decode_stage1_resources.json")
    args = p.parse_args(argv)
    caps = [c.split(":") for c in args.maxnreg]
    if not all(len(c) == 2 and c[0].isdigit() and c[1].isdigit() and int(c[0]) > 0 and int(c[1]) > 0 for c in caps):
        p.error(f"--maxnreg expected WARPS:REGS pairs of positive integers, got {args.maxnreg}")
    args.maxnreg = {int(w): int(r) for w, r in caps}
    if args.max_configs is not None and args.max_configs < 1:
        p.error(f"--max-configs expected a positive count, got {args.max_configs}")
    if args.waves and (not args.analyze or min(args.waves) < 1 or args.sms < 1 or min(args.waves_values) < 1):
        p.error(
            f"--waves expected positive batches with --analyze FILE, --sms and --waves-values >= 1, got "
            f"{args.waves}, --analyze {args.analyze}, --sms {args.sms}, --waves-values {args.waves_values}"
        )
    if args.arch < 80:
        p.error(f"--arch expected a compute capability of at least 80 (bf16 dots), got {args.arch}")
    if any(g < 1 or g & (g - 1) for g in args.groups):
        p.error(f"--groups expected powers of two, got {args.groups}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.analyze:
        with open(args.analyze) as f:
            results = json.load(f)
        if args.waves:
            print_waves(results, args.waves, args.sms, waves=args.waves_values)
            return
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # a real compile, not the interpreter
        results = run(args)
    print_table(results)


if __name__ == "__main__":
    sys.exit(main())
