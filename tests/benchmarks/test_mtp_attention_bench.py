"""benchmarks/mtp.py, attention part: arguments, per-row lengths, byte counts and the table of a saved run (the GPU
run itself is a benchmark, not a test)."""

import importlib.util
import json
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("mtp_bench", os.path.join(REPO, "benchmarks", "mtp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(bench):
    args = bench.parse_args([])
    assert args.parts == ["attention", "recurrent"] and args.mtp_step == 3
    assert args.batches == [16, 64, 128] and args.lens == [1024, 8192, 32768]
    for bad in (["--mtp-step", "5"], ["--batches", "0"], ["--lens", "3"], ["--parts", "everything"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_row_lengths_and_bytes(bench):
    seq = torch.tensor([10, 7], dtype=torch.int32)
    assert bench.row_lengths(seq, 3).tolist() == [7, 8, 9, 10, 4, 5, 6, 7]  # token t of a request sees L - N + t
    assert bench.kv_bytes(16, 1024, 4, 256) == 2 * 16 * 1024 * 4 * 256 * 2  # K and V in bf16, read once


def test_analyze_prints_a_saved_run(bench, tmp_path, capsys):
    cell = {"B": 16, "L": 8192, "N": 3, "kv_bytes": bench.kv_bytes(16, 8192, 4, 256),
            "diverse_ms": {"default": 0.16, '{"WAVES": 2}': 0.13}, "plain_rows_ms": {"default": 0.40},
            "plain_loop_ms": {"default": 0.52}, "fa3_ms": {"0": 0.16, "4": 0.15}}  # fmt: skip
    saved = tmp_path / "mtp.json"
    saved.write_text(
        json.dumps(
            {
                "device": "NVIDIA H200",
                "attention": {"shape": [24, 4, 256], "N": 3, "graph_max_len": 32768, "cells": [cell]},
            }
        )
    )
    bench.main(["--analyze", str(saved)])
    lines = capsys.readouterr().out.splitlines()
    row = lines[-1].split()
    # B, L, default us, best us, rows us, loop us, rows/div, loop/div, fa3 best us, fa3/div, TB/s
    assert row == ["16", "8192", "160.0", "130.0", "400.0", "520.0", "3.08", "4.00", "150.0", "1.15", "4.13"]
