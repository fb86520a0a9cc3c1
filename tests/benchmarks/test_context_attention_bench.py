"""benchmarks/context_attention.py: its method end to end on a tiny shape (``--dry-run``, the interpreter on a CPU),
the FLOP count and the table from a saved run; the GPU timings are the benchmark's, not a test's."""

import json
import math

import pytest
import torch

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("context_attention")


def test_flops_count_the_visible_pairs(bench):
    # Qwen3-8B heads, a 512-token chunk after 32K cached tokens: ~277 GFLOP per layer
    assert bench.attention_flops(32, 128, 512, 32768) == 4 * 128 * 32 * 512 * (32768 + 256.5)
    assert bench.attention_flops(1, 1, 3, 0) == 4 * 6  # 3 new tokens see 1 + 2 + 3 keys


def test_dry_run_times_every_candidate_and_the_default(bench, tmp_path, capsys):
    from lightllm.kernels.attention.prefill.context_attention import _default_config, _prefix_configs

    out = tmp_path / "ctx.json"
    bench.main(["--dry-run", "--no-fa3", "--out", str(out)])
    saved = json.loads(out.read_text())
    configs = _prefix_configs(torch.empty(1, 6, 64))
    assert [(c["chunk"], c["prefix"], c["kernel"]) for c in saved["cells"]] == [
        (8, 0, "context_attention"), (8, 20, "context_attention_prefix")]  # fmt: skip
    twins = bench.unpacked_twins(configs)
    # the packed tiles at 4 warps, 2 stages; at 8 warps, 2 stages each is an unpacked candidate already
    tiles = ((64, 64), (128, 64), (128, 32))
    assert twins == [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4, "num_stages": 2} for m, n in tiles]
    for cell in saved["cells"]:
        assert [cfg for cfg, _ in cell["configs"]] == configs and cell["default"] == _default_config(64)
        assert [cfg for cfg, _ in cell["twins"]] == twins
        assert all(math.isfinite(ms) and ms > 0 for _, ms in cell["configs"] + cell["twins"]) and cell["default_ms"] > 0
    assert [(r["unpacked_cfg"] is not None, r["packed_cfg"]["PACK_GQA"]) for r in saved["rows"]] == [(True, True)] * 2
    table = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("hq6-hk1-d64        8") for line in table) == 2


def test_analyze_prints_a_saved_run(bench, tmp_path, capsys):
    unpacked, twin = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}, {
        "BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}  # fmt: skip
    packed = {**twin, "PACK_GQA": True}
    cell = {"shape": "hq32-hk8-d128", "chunk": 512, "prefix": 32768, "kernel": "context_attention_prefix",
            "flops": 2e11, "default": unpacked, "default_ms": 2.0, "fa3_ms": 0.5,
            "configs": [[unpacked, 2.0], [{**unpacked, "num_warps": 8}, 1.6], [packed, 0.8],
                        [{**packed, "BLOCK_M": 64}, math.inf]],
            "twins": [[{**twin, "BLOCK_M": 64}, 0.1], [twin, 1.0]]}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "dtype": "torch.bfloat16", "fa3": "x", "cells": [cell]}))
    bench.main(["--analyze", str(path)])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hq32-hk8-d128")]
    # 2e11 FLOP: 125 TFLOP/s at 1.6 ms, 250 at 0.8 ms, 100 at 2 ms, 400 at 0.5 ms; the best packed (0.8 ms) over the
    # best unpacked candidate (1.6: twins are no candidates) 0.5, over its own twin (1.0) 0.8
    assert row.split() == ["hq32-hk8-d128", "512", "32768", "1.600", "125.0", "0.800", "250.0", "2.000", "100.0",
                           "0.500", "400.0", "-", "0.50", "0.80", "64x64", "w8", "s1", "128x32", "w4", "s2",
                           "-"]  # fmt: skip
    # --explore's configs (never candidates) get a column of their own: the best of them, 320 TFLOP/s at 0.625 ms
    deep = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    cell["explore"] = [[deep, 0.625], [{**deep, "num_stages": 4}, math.inf]]
    path.write_text(json.dumps({"device": "NVIDIA H200", "dtype": "torch.bfloat16", "fa3": "x", "cells": [cell]}))
    bench.main(["--analyze", str(path)])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hq32-hk8-d128")]
    assert row.split()[11:13] == ["0.625", "320.0"] and row.split()[-3:] == ["128x64", "w8", "s3"]
    from lightllm.kernels.attention.prefill.context_attention import _prefix_configs

    for heads, d in ((32, 128), (24, 256)):  # outside the tuned space, or the column would repeat a candidate's
        assert not [c for c in bench.explore_configs(d) if c in _prefix_configs(torch.empty(1, heads, d))]


def test_bad_arguments(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--chunks", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "hq1"])
