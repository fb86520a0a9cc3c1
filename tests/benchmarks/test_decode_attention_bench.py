"""benchmarks/decode_attention.py, analysis part: what each choice rule freezes from a saved run, its loss against
each length's best and against the default (FA3: its own split heuristic), and the geo-mean gain over it."""

import json
import math

import pytest

from tests.benchmarks.helpers import load_benchmark

LENS = [1024, 4096, 8192, 16384, 32768]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_attention")


def saved_run():
    """One shape at B=16. FA3: split 1 is 10 % faster than the heuristic except 2 % slower at 8K (a length only
    FA3's ladder times); split 2 is 3 % faster everywhere. Triton: config "fast" beats the default except at 1K."""
    fa3 = {0: [1.0] * 5, 1: [0.9, 0.9, 1.02, 0.9, 0.9], 2: [0.97] * 5}
    triton = {"default": [1.0] * 5, "fast": [1.05, 0.5, 0.5, 0.5, 0.5]}
    cells = []
    for j, n in enumerate(LENS):
        cells.append({"shape": "hq32-hk8-d128", "B": 16, "L": n, "kind": "none", "bytes": 1e6,
                      "default_ms": triton["default"][j], "configs": [[{"name": "fast"}, triton["fast"][j]]],
                      "fa3_ms": {str(sp): ms[j] for sp, ms in fa3.items()}})  # fmt: skip
    return {"device": "test", "copy_GBs": 3000.0, "graph_max_len": 32768, "ladder": [32768, 16384, 4096, 1024],
            "quant_group": 8, "cells": cells, "stage2": []}  # fmt: skip


def test_fa3_rules_against_the_heuristic(bench):
    (entry,) = bench.analyze_fa3(saved_run())
    rules = entry["rules"]
    assert {rule: v["num_splits"] for rule, v in rules.items()} == {
        "heuristic": 0,
        "minimax_loss": 1,  # least worst-case loss (1.02 / 0.97), though 2 % slower than the heuristic at 8K
        "tuning_len": 1,
        "never_slower_than_default": 2,
    }
    assert rules["minimax_loss"]["vs_default_pct"] == pytest.approx([-10, -10, 2, -10, -10])
    assert rules["never_slower_than_default"]["vs_default_pct"] == pytest.approx([-3] * 5)
    assert rules["heuristic"]["loss_pct"] == pytest.approx([100 / 9, 100 / 9, 100 / 97 * 3, 100 / 9, 100 / 9])
    gains = bench.fa3_gains([entry])
    best = math.exp((4 * math.log(1 / 0.9) + math.log(1 / 0.97)) / 5)
    assert gains["all"]["best"] == pytest.approx((best - 1) * 100)
    assert gains["all"]["never_slower_than_default"] == pytest.approx((1 / 0.97 - 1) * 100)
    assert bench.fa3_gains([entry], min_batch=32) == {}  # no cell at B >= 32


def test_triton_rules_report_the_loss_against_the_default(bench):
    _, (entry,) = bench.analyze(saved_run())
    assert entry["rules"]["minimax_loss"]["config"] == '{"name": "fast"}'
    assert entry["rules"]["minimax_loss"]["vs_default_pct"] == pytest.approx([5, -50, -50, -50, -50])
    assert entry["rules"]["never_slower_than_default"]["config"] is None
    assert entry["rules"]["never_slower_than_default"]["worst_loss_pct"] == pytest.approx(100)


def test_tables_print_every_rule_and_the_gain(bench, capsys):
    results = saved_run()
    rows, frozen = bench.analyze(results)
    results["fa3_frozen"] = bench.analyze_fa3(results)
    bench.print_tables(results, rows, frozen)
    out = capsys.readouterr().out
    assert "never_slower_than_default vs default  +0.0 (0 of 1 rows > 2 %), vs best 100.0" in out
    assert "minimax_loss              vs default  +5.0 (1 of 1 rows > 2 %)" in out
    assert "B= 16 never_slower_than_default splits= 2 worst   7.8/ -3.0" in out
    assert "all           best +9.46 %" in out and "never_slower_than_default +3.09 %" in out


def test_passes_alternate_the_order_and_keep_each_launch_s_fastest(bench, monkeypatch):
    """The second pass runs backwards, so the launches timed first (slow after a new pool) are timed again last; a
    config that fails is not retried."""
    order, broken, slow = [], [], iter([3.0, 2.5])  # the first two timings of the run are slow

    def fake_decode_fn(kind, q, pool, r2t, idx, seq, launch_len, out, group, cfg):
        name = "default" if cfg is None else cfg["name"]
        if name == "broken":
            broken.append(name)
            raise RuntimeError("out of resources")
        return name

    def fake_bench(name):
        order.append(name)
        return next(slow, {"default": 1.0, "a": 0.9, "b": 1.1}[name])

    monkeypatch.setattr(bench, "decode_fn", fake_decode_fn)
    monkeypatch.setattr(bench, "cuda_graph_bench", fake_bench)
    configs = [{"name": "a"}, {"name": "broken"}, {"name": "b"}]
    default, timed = bench.time_configs("none", *[None] * 7, 8, configs, passes=2)
    assert order == ["default", "a", "b", "b", "a", "default"] and len(broken) == 1
    assert default == 1.0 and timed == [[configs[0], 0.9], [configs[1], math.inf], [configs[2], 1.1]]
    order.clear()
    slow = iter([3.0])
    default, timed = bench.time_configs("none", *[None] * 7, 8, configs)  # one pass: the slow first timing stays
    assert order == ["default", "a", "b"] and default == 3.0


def test_passes_must_be_positive(bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["decode_attention.py", "--passes", "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--passes expected a positive count, got 0" in capsys.readouterr().err


def test_repeated_runs_compare_the_frozen_config_with_fa3s_best_per_run_and_over_the_runs(bench):
    """Two saved runs: the frozen config ("fast" at 32K: 0.5 ms, then 0.6) against FA3's splits. Each run's best split
    is its fastest; over the runs each split's median is taken first, so a split that was lucky once does not win."""
    first, second = saved_run(), saved_run()
    for cell in second["cells"]:
        cell["configs"][0][1] += 0.1  # "fast" 0.1 ms slower in the second run
        cell["fa3_ms"] = {"0": 1.0, "1": 0.45, "2": 0.55}  # split 1 lucky in this run alone
    runs = []
    for run in (first, second):
        run["rows"], run["frozen"] = bench.analyze(run)
        run["fa3_frozen"] = bench.analyze_fa3(run)
        runs.append(run)
    entries = bench.compare_runs(runs)
    assert [(e["shape"], e["B"], e["L"]) for e in entries] == [("hq32-hk8-d128", 16, n) for n in LENS]
    at_32k = entries[-1]
    assert at_32k["tuned_ms"] == pytest.approx([0.5, 0.6]) and at_32k["fa3_best_ms"] == pytest.approx([0.9, 0.45])
    assert at_32k["ratio"] == pytest.approx([0.5 / 0.9, 0.6 / 0.45])
    assert at_32k["ratio_median"] == pytest.approx((0.5 / 0.9 + 0.6 / 0.45) / 2)
    # medians over the runs: split 1 (0.9, 0.45) -> 0.675, split 2 (0.97, 0.55) -> 0.76, heuristic 1.0
    assert at_32k["fa3_split_of_best_median"] == 1 and at_32k["ratio_of_medians"] == pytest.approx(0.55 / 0.675)
    assert bench.compare_runs([first, {"frozen": [], "fa3_frozen": []}]) == []  # a cell must be in every run


def test_runs_from_the_command_line(bench, monkeypatch, tmp_path, capsys):
    run = saved_run()
    run["rows"], run["frozen"] = bench.analyze(run)
    run["fa3_frozen"] = bench.analyze_fa3(run)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    monkeypatch.setattr("sys.argv", ["decode_attention.py", "--runs", str(path), str(path), "--out",
                                     str(tmp_path / "out.json")])  # fmt: skip
    bench.main()
    out = capsys.readouterr().out
    assert "over FA3's best num_splits, 2 runs" in out
    assert "hq32-hk8-d128     16  32768 |  0.556  0.556 |  0.556 |  0.556 (1)" in out
    assert len(json.loads((tmp_path / "out.json").read_text())["cells"]) == len(LENS)


@pytest.mark.parametrize("content, says", [(None, "cannot read a saved run"), ("{", "cannot read a saved run"),
                                           ("{}", "not a saved decode_attention.py run")])  # fmt: skip
def test_runs_that_cannot_be_read_are_one_line_errors(bench, monkeypatch, tmp_path, capsys, content, says):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr("sys.argv", ["decode_attention.py", "--runs", str(path), "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert stop.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
