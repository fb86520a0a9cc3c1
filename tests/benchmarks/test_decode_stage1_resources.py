"""benchmarks/decode_stage1_resources.py: stage 1 compiled for sm_90 on the CPU (a real compile to a cubin, not the
interpreter) and its resources read back; the table from a saved run; the pieces' arithmetic."""

import json
import os
import sys

import pytest
import torch

from lightllm.common import proc
from tests.benchmarks.helpers import REPO, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_stage1_resources")


def test_one_candidate_per_quantized_kind_compiles_for_sm90_and_reports_its_resources(tmp_path):
    out = tmp_path / "res.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "decode_stage1_resources.py"), "--shapes", "hq32-hk8-d128",
           "--kinds", "int8", "int4", "--groups", "8", "32", "--max-configs", "1", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a real compile: nothing left in the user's cache
    done = proc.run(cmd, timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cells = json.loads(out.read_text())["cells"]  # both PTX dequantization helpers through ptxas, at both groups
    got = sorted((c["shape"], c["kind"], c["group"]) for c in cells)  # the default group 8 and a wider one
    assert got == sorted(("hq32-hk8-d128", k, g) for k in ("int8", "int4") for g in (8, 32))
    for cell in cells:
        assert 16 <= cell["regs"] <= 255 and cell["shared_bytes"] > 0 and cell["stack_bytes"] >= 0
        # V's two halves in each copy of the block body: with the peel the first block, the loop and the partial last
        assert 0 <= cell["staged_tiles"] <= 2 * 3
        assert cell["PEEL"] is True  # the launcher's rule at head_dim 128
    assert "warps/SM" in done.stdout and "hq32-hk8-d128 int8" in done.stdout


def test_main_loop_statistics_of_whole_scale_rows(tmp_path):
    """The main loop's SASS, compiled for sm_90: group-32 scales load as asynchronous copies like group 8's (the
    whole-row hint; without it each scale was a synchronous 2-byte load, and its layout conversion added barriers)."""
    out = tmp_path / "res.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "decode_stage1_resources.py"), "--shapes", "hq32-hk8-d128",
           "--kinds", "int8", "--groups", "8", "32", "--block-n", "64", "--max-configs", "1", "--out",
           str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = proc.run(cmd, timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cells = {c["group"]: c for c in json.loads(out.read_text())["cells"]}
    assert sorted(cells) == [8, 32] and {c["BLOCK_N"] for c in cells.values()} == {64}
    for c in cells.values():
        assert c["loop_instructions"] > 200 and c["loop_barriers"] > 0 and c["loop_async_copies"] > 0
    assert cells[32]["loop_sync_loads"] <= cells[8]["loop_sync_loads"]
    assert cells[32]["loop_barriers"] <= cells[8]["loop_barriers"]
    assert " BAR " in done.stdout  # the table's loop columns


def compiled_in_a_process(tmp_path, expression: str, cfg="BLOCK_N=64, num_warps=2, num_stages=3, MIN_BLOCKS=1"):
    """The JSON value of ``expression``, evaluated in a fresh process that compiles for sm_90 (no interpreter, its
    own Triton cache), where ``R`` is the benchmark, ``fd, kernel, off, p2`` its ``_kernels()`` and ``cfg`` a config."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import decode_stage1_resources as R\n"
        f"fd, kernel, off, p2 = R._kernels(); cfg = dict({cfg})\n"
        f"print(json.dumps({expression}))"
    )
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = proc.run([sys.executable, "-c", code], timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_quantized_loop_keeps_queries_in_registers_within_the_register_cap(tmp_path):
    """The shipped INT8/INT4 d128 program (64 tokens, 2 warps, 3 stages) compiled for sm_90 as the launcher runs it:
    with the first block peeled, the queries stay in registers and V is a 2-wide operand, so the loop copies almost
    nothing into MMA register quads (201 moves a tile before), and the launcher's cap holds it to 168 registers with
    no spills."""
    cells = compiled_in_a_process(
        tmp_path,
        "{k: R.compile_one(kernel, 90, R.SHAPES['hq32-hk8-d128'], k, 8, cfg, off, p2, fd.register_cap(2, True, 128))"
        " for k in ('int8', 'int4')}",
    )
    for kind, c in cells.items():
        assert c["loop_instructions"] > 500, (kind, c)  # the whole tile's work was counted
        assert c["loop_register_moves"] <= 16, (kind, c)
        assert c["regs"] <= 168 and c["stack_bytes"] == 0, (kind, c)


def test_peel_all_keeps_d256_queries_in_registers(tmp_path):
    """At head_dim 256 the launcher does not peel (``peel=None`` follows it): d256's INT8 program of 32 tokens, 2 warps
    and 3 stages re-assembles its query fragments every tile (132 moves on sm_90). Peeled, as ``--peel-all``
    compiles it, the loop moves almost nothing, at 255 registers and no spill."""
    launcher, peeled = compiled_in_a_process(
        tmp_path,
        "[R.compile_one(kernel, 90, R.SHAPES['hq24-hk4-d256'], 'int8', 8, cfg, off, p2, None, peel)"
        " for peel in (None, True)]",
        cfg="BLOCK_N=32, num_warps=2, num_stages=3, MIN_BLOCKS=1",
    )
    assert launcher["PEEL"] is False and peeled["PEEL"] is True  # what each compiled, as a run records it
    assert launcher["loop_register_moves"] > 64 and peeled["loop_register_moves"] <= 16, (launcher, peeled)
    assert peeled["loop_instructions"] < launcher["loop_instructions"] and peeled["stack_bytes"] == 0


def test_loop_statistics_read_the_longest_backward_branch(bench):
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*0040*/              @!P0 LDG.E.U16 R8, desc[UR4][R10.64] ;
        /*0048*/                   IMAD.MOV.U32 R12, RZ, RZ, R9 ;
        /*004c*/                   IMAD.WIDE.U32 R14, R2, 0x4, R6 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   BRA 0x20 ;
        /*0070*/                   BRA 0x50 ;
        /*0080*/                   EXIT ;
    """
    assert bench.loop_stats(sass) == {"loop_instructions": 7, "loop_barriers": 1, "loop_sync_loads": 1,
                                      "loop_async_copies": 1, "loop_register_moves": 1}  # fmt: skip
    assert bench.loop_stats("no loop") == {"loop_instructions": 0, "loop_barriers": 0, "loop_sync_loads": 0,
                                           "loop_async_copies": 0, "loop_register_moves": 0}  # fmt: skip
    ttgir = "a ttg.convert_layout scf.for { ttg.convert_layout ttg.convert_layout scf.yield } ttg.convert_layout"
    assert bench.loop_conversions(ttgir) == 2 and bench.loop_conversions("no loop") == 0


def test_candidates_differing_only_in_waves_share_a_compile(bench):
    space = [{"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WAVES": w} for w in (1, 2, 4)]
    space.append({"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WAVES": 2, "MIN_BLOCKS": 2})
    plain = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "MIN_BLOCKS": 1}
    assert bench.distinct_configs(space) == [plain, {**plain, "MIN_BLOCKS": 2}]


def test_resident_warps_follow_the_register_file_and_shared_memory(bench):
    assert bench.resident(255, 4) == (8, "regs")  # 256 registers a thread: 2 blocks of 4 warps
    assert bench.resident(128, 4) == (16, "regs")
    assert bench.resident(16, 4) == (64, "slots")  # capped by the SM's warp slots (registers would allow 128)
    assert bench.resident(151, 2) == (12, "regs")  # 152 a thread (a warp takes registers in units of 256): 6 blocks
    # the INT8 config the H200 chose (BLOCK_N 64, 2 warps, 3 stages): 6 blocks by registers, 5 by 43 KiB of shared
    assert bench.resident(144, 2, 43264, 90) == (10, "smem")
    assert bench.resident(144, 2, 43264, 75) == (12, "regs")  # an arch the table does not know: registers only
    # what ncu's launch statistics gave on the H200: the register limit is per scheduler (a quarter of the file)
    assert bench.resident(180, 2) == (8, "regs")  # two 5760-register warps a quarter: 4 blocks, not 65536 // 11520 = 5
    assert bench.resident(168, 2) == (12, "regs")  # three 5376-register warps a quarter: 6 blocks
    assert bench.resident(57, 8) == (32, "regs")  # bf16's 8-warp program: 4 blocks
    assert bench.resident(16, 1, 0, 90) == (32, "slots")  # 32 blocks at most


def test_staged_tiles_count_16_bit_kv_tiles_written_from_registers(bench):
    ttgir = """
    %lo_86 = ttg.local_alloc : () -> !ttg.memdesc<1x64x64xi8, #shared2, #smem, mutable>
    %84 = ttg.local_alloc %83 : (tensor<64x64xf16, #blocked8>) -> !ttg.memdesc<64x64xf16, #shared5, #smem>
    %89 = ttg.local_alloc %88 : (tensor<64x64xbf16, #blocked8>) -> !ttg.memdesc<64x64xbf16, #shared5, #smem>
    %p_216 = ttg.local_alloc %p_215 : (tensor<16x64xf16, #mma>) -> !ttg.memdesc<16x64xf16, #shared, #smem>
    %q = ttg.local_alloc %q0 : (tensor<64x64xi32, #blocked>) -> !ttg.memdesc<64x64xi32, #shared, #smem>
    """
    assert bench.staged_tiles(ttgir, 64, 64) == 2  # not the codes' async buffer, the probabilities or int words
    assert bench.staged_tiles(ttgir, 32, 64) == 0


def test_resource_line_parsing_and_bad_arguments(bench):
    line = "Function decode_stage1_kernel:\n REG:235 STACK:24 SHARED:1024 LOCAL:0 CONSTANT[0]:696 TEXTURE:0"
    assert bench.parse_resources(line) == {"regs": 235, "stack_bytes": 24, "shared_static": 1024, "local_bytes": 0}
    with pytest.raises(ValueError, match="no resource line"):
        bench.parse_resources("cuobjdump: nothing")
    for bad in (["--arch", "75"], ["--groups", "6"], ["--max-configs", "0"], ["--kinds", "fp8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_table_from_a_saved_run(bench, tmp_path, capsys):
    cell = {"shape": "hq32-hk8-d128", "kind": "int4", "group": 8, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
            "MIN_BLOCKS": 1, "regs": 255, "stack_bytes": 728, "shared_static": 1024,
            "local_bytes": 0, "shared_bytes": 22528}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"arch": "sm_90", "cells": [cell, {**cell, "PEEL": True}]}))
    bench.main(["--analyze", str(path)])
    old, peeled = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("hq32")]
    head, tail = ["hq32-hk8-d128", "int4", "8", "64", "4", "2", "1"], ["255", "728", "22.0", "8", "regs"] + ["-"] * 6
    assert old == head + ["-"] + tail  # a run from before the peel was recorded
    assert peeled == head + ["y"] + tail


def test_launch_specialization_marks_aligned_pointers_and_multiples_of_16(bench):
    """Without Triton's divisibility hints a CPU compile cannot vectorize the KV loads and overstates registers."""
    ints = bench.int_args((32, 8, 128), "int4", 32)
    assert (ints["stride_kt"], ints["stride_kh"], ints["stride_kst"], ints["stride_ksh"]) == (512, 64, 32, 4)
    names = ["Q", "qk_scale", "stride_kt", "stride_ksh", "GROUP"]
    types = {"Q": "*bf16", "qk_scale": "fp32", "stride_kt": "i32", "stride_ksh": "i32", "GROUP": "constexpr"}
    assert bench.divisibility(names, types, ints) == {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}


def test_wave_fill_counts_rounds_of_resident_programs(bench):
    """The grid num_splits gives, against the programs the compiled candidate keeps resident: HEAD's INT8 choice
    (144 registers, 43 KiB: 5 programs per SM, 660 on an H200) at B=64 fills 78 % of two rounds at WAVES 4; with 180
    registers (4 per SM, 528) B=16's 640 programs need two rounds where 660 slots hold them in one."""
    head = {"shape": "hq32-hk8-d128", "BLOCK_N": 64, "num_warps": 2, "regs": 144, "shared_bytes": 43264}
    assert bench.wave_fill(head, 64, 4) == (1024, 660, 2, 1024 / 1320)
    assert bench.wave_fill(head, 16, 4) == (640, 660, 1, 640 / 660)
    patched = {**head, "regs": 180, "shared_bytes": 39168}
    assert bench.wave_fill(patched, 16, 4) == (640, 528, 2, 640 / 1056)
    # 66 SMs: half the slots, but ceil(264 / 128) = 3 splits, 384 programs, so two rounds
    assert bench.wave_fill(head, 16, 4, sms=66)[:3] == (384, 330, 2)


def test_waves_shown_by_default_are_the_tuned_ones(bench):
    flash_decode = bench._kernels()[0]
    q = torch.empty(1, 32, 128)
    spaces = flash_decode.split_kv_configs(q) + flash_decode.quant_split_kv_configs(q)
    assert tuple(sorted({c["WAVES"] for c in spaces})) == bench.WAVES


def test_waves_needs_a_saved_run_and_positive_batches(bench, capsys):
    saved = ["--analyze", "x.json"]
    for argv in (["--waves", "16"], [*saved, "--waves", "0"], [*saved, "--waves", "16", "--sms", "0"],
                 [*saved, "--waves", "16", "--waves-values", "4", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert "--waves expected positive batches with --analyze FILE" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["2", "2:x", "0:168"])
def test_bad_maxnreg_is_refused(bench, capsys, value):
    with pytest.raises(SystemExit):
        bench.parse_args(["--maxnreg", value])
    assert "--maxnreg expected WARPS:REGS pairs of positive integers" in capsys.readouterr().err


def test_maxnreg_is_read_per_warp_count(bench):
    assert bench.parse_args(["--maxnreg", "2:168", "4:128"]).maxnreg == {2: 168, 4: 128}
    assert bench.parse_args([]).maxnreg == {}
