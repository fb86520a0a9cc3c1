"""benchmarks/decode_stage1_ncu.py: its summary of ncu's CSV exports (details or raw page, SASS source page), on
small exports in ncu's layouts; the profile itself is the GPU's."""

import pytest

from tests.benchmarks.helpers import load_benchmark

DETAILS = """==PROF== Connected
"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"
"0","decode_stage1_kernel","GPU Speed Of Light Throughput","DRAM Throughput","%","58.21"
"0","decode_stage1_kernel","GPU Speed Of Light Throughput","Duration","ns","2,002,336"
"0","decode_stage1_kernel","Launch Statistics","Registers Per Thread","register/thread","213"
"0","decode_stage1_kernel","Occupancy","Achieved Active Warps Per SM","warp","7.59"
"0","decode_stage1_kernel","Instruction Statistics","Executed Instructions","inst","833,095,680"
"""
RAW = """"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread","sm__warps_active.avg.per_cycle_active","smsp__inst_executed.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio","launch__occupancy_limit_registers","launch__occupancy_limit_shared_mem"
"","","msecond","register/thread","warp","inst","ratio","ratio","ratio","block","block"
"0","decode_stage1_kernel","1.917440","168","8.49","647,435,264.000000","0.183","2.012","0","6","5"
"""  # noqa: E501
SASS = """"Kernel Name","decode_stage1_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x10","      PRMT R1, R2, 0x4140, R3","10","300"
"0x20","  @!P0 PRMT R4, R5, 0x4342, R3","0","100"
"0x28","      IMAD.MOV.U32 R6, RZ, RZ, R7","0","100"
"0x30","      BAR.SYNC.DEFER_BLOCKING 0x0","30","100"
"0x40","","0","0"
"""


def test_summary_reads_both_metric_pages_and_the_sass_page(tmp_path):
    bench = load_benchmark("decode_stage1_ncu")
    for name, text in (("details.csv", DETAILS), ("raw.csv", RAW), ("sass.csv", SASS)):
        (tmp_path / name).write_text(text)
    out = tmp_path / "summary.json"
    specs = [f"before:int8={tmp_path / 'details.csv'},{tmp_path / 'sass.csv'}", f"ptx:int8={tmp_path / 'raw.csv'}"]
    bench.main(["--summarize", *specs, "--out", str(out)])
    got = bench.json.loads(out.read_text())
    assert got["before"]["int8"] == {
        "duration_us": 2002.336, "registers": 213.0, "warps_active_per_sm": 7.59, "warp_instructions": 833095680.0,
        "dram_throughput_pct": 58.21,
        "opcodes": {"PRMT": {"executed_pct": 66.7, "stall_samples_pct": 25.0},
                    "IMAD.MOV": {"executed_pct": 16.7, "stall_samples_pct": 0.0},
                    "BAR": {"executed_pct": 16.7, "stall_samples_pct": 75.0}},
    }  # fmt: skip
    assert got["ptx"]["int8"] == {"duration_us": 1917.44, "registers": 168.0, "warps_active_per_sm": 8.49,
                                  "warp_instructions": 647435264.0,
                                  "stalls_per_issue": {"long_scoreboard": 2.01, "barrier": 0.18},
                                  "blocks_per_sm_by_registers": 6.0, "blocks_per_sm_by_shared_mem": 5.0}  # fmt: skip


def test_a_rung_of_the_ladder_is_a_target_and_a_bad_one_is_refused(capsys):
    bench = load_benchmark("decode_stage1_ncu")
    with pytest.raises(SystemExit):
        bench.main(["int8", "--rung", "softmax"])
    err = capsys.readouterr().err
    assert "--rung: invalid choice: 'softmax'" in err and "'dequant'" in err and "'dots'" in err


BAD_CONFIG = "--config expected BLOCK_N/WARPS/STAGES/WAVES"
BAD_BATCH = "--batch expected a positive integer, got 0"


BAD_ARGS = [(["--config", "64/2/x/4"], BAD_CONFIG), (["--config", "64/2/3"], BAD_CONFIG), (["--batch", "0"], BAD_BATCH)]


@pytest.mark.parametrize("args, message", BAD_ARGS)
def test_bad_batch_or_config_is_refused_before_any_launch(capsys, args, message):
    bench = load_benchmark("decode_stage1_ncu")
    with pytest.raises(SystemExit):
        bench.main(["int8", *args])
    assert message in capsys.readouterr().err
