"""benchmarks/decode_attention.py --buckets: the graphs' buckets, the points timed, and the analysis of a saved run
(which config each bucket's graph replays and its loss vs the cell's best and default eager launches). The GPU run
itself is a benchmark, not a test."""

import argparse
import importlib
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))  # the scripts import their siblings
    return importlib.import_module("decode_attention_buckets")


def test_buckets_below_the_longest_length_then_the_longest(bench):
    lens = [1024, 8192, 32768]
    assert bench.graph_lens([4096], lens) == [4096, 32768]
    assert bench.graph_lens([65536, 32768, 4096], lens) == [4096, 32768] and bench.graph_lens([], lens) == [32768]
    assert [bench.serving_bucket([4096, 32768], n) for n in (1, 4096, 4097, 32768)] == [4096, 4096, 32768, 32768]


def test_only_the_points_the_analysis_reads_are_timed(bench):
    """Each L eagerly and in its graph, each serving bucket's ladder launched for the bucket: 11 points, where timing
    every ladder length and every L for every bucket would be 21; one bucket (today) adds none here."""
    lens, ladder = [1024, 8192, 32768], {4096: [4096, 2048, 512], 32768: [32768, 16384, 4096, 1024]}
    ladders = {"4096,32768": ladder, "32768": ladder}
    points = bench.timing_points(lens, [[4096, 32768], [32768]], ladders)
    assert points == [(512, 4096), (1024, 1024), (1024, 4096), (1024, 32768), (2048, 4096), (4096, 4096),
                      (4096, 32768), (8192, 8192), (8192, 32768), (16384, 32768), (32768, 32768)]  # fmt: skip
    assert bench.timing_points(lens, [[4096, 32768]], ladders) == points


def test_each_set_s_ladders_are_the_engine_s_down_to_the_bucket_below(bench):
    """With a 4K graph below it, the 32K graph tunes on 32K..4K (the lengths it serves); alone, on 32K..1K. The
    points timed follow each set's own ladders, and an old run's one ladder per bucket still reads."""
    assert bench.bucket_ladders([4096, 32768]) == {4096: [4096, 2048, 512], 32768: [32768, 16384, 8192, 4096]}
    assert bench.bucket_ladders([32768]) == {32768: [32768, 16384, 4096, 1024]}
    lens, sets = [1024, 8192, 32768], [[4096, 32768], [32768]]
    ladders = {bench.set_name(s): bench.bucket_ladders(s) for s in sets}
    assert bench.timing_points(lens, sets, ladders) == [
        (512, 4096), (1024, 1024), (1024, 4096), (1024, 32768), (2048, 4096), (4096, 4096), (4096, 32768),
        (8192, 8192), (8192, 32768), (16384, 32768), (32768, 32768)]  # fmt: skip
    saved = {"ladders": {k: {str(b): v for b, v in m.items()} for k, m in ladders.items()}}
    assert bench.set_ladders(saved, [32768]) == {32768: [32768, 16384, 4096, 1024]}
    old = {"ladders": {"4096": [4096, 2048], "8192": [8192, 4096]}}
    assert (
        bench.set_ladders(old, [8192])
        == bench.set_ladders(old, [4096, 8192])
        == {4096: [4096, 2048], 8192: [8192, 4096]}
    )


A, B = {"WAVES": 1}, {"WAVES": 8}
# ms of (default, A, B) per (KV length, launch length)
TIMES = {
    (4096, 4096): (10, 8, 9), (2048, 4096): (6, 5, 7),  # bucket 4096's ladder: A wins under either rule
    (8192, 8192): (20, 22, 18), (4096, 8192): (11, 12, 10),  # bucket 8192's ladder: B wins
    (1024, 4096): (4, 3.0, 3.5), (1024, 8192): (5, 4, 4.4),  # L = 1K replayed in the 4K and in the 8K graph
    (1024, 1024): (3.0, 2.95, 3.3),  # L = 1K eagerly: best 2.95 (A), default 3.0
}  # fmt: skip


def saved_run():
    points = [{"shape": "hq32-hk8-d128", "B": 1, "kind": "none", "L": n, "launch": launch, "default_ms": t[0],
               "configs": [[A, t[1]], [B, t[2]]]} for (n, launch), t in TIMES.items()]  # fmt: skip
    return {"device": "test", "mode": "buckets", "buckets": [4096, 8192], "lens": [1024, 8192],
            "ladders": {"4096": [4096, 2048], "8192": [8192, 4096]}, "points": points}  # fmt: skip


def test_a_cell_replays_its_bucket_s_pick_against_its_own_eager_best_and_default(bench):
    entries = {(tuple(e["buckets"]), e["rule"]): e for e in bench.analyze_buckets(saved_run())}
    rules = ("tuning_len", "minimax_loss", "never_slower_than_default")
    assert set(entries) == {(b, r) for b in ((4096, 8192), (8192,)) for r in rules}
    two = entries[((4096, 8192), "minimax_loss")]
    assert two["configs"] == {"4096": json.dumps(A), "8192": json.dumps(B)}
    assert two["vs_best_pct"] == pytest.approx([(3.0 / 2.95 - 1) * 100, 0.0])  # 1K: A in the 4K graph; 8K: B
    assert two["vs_default_pct"] == pytest.approx([0.0, -10.0])
    one = entries[((8192,), "minimax_loss")]  # today: 1K replays B launched for 8K
    assert one["configs"] == {"8192": json.dumps(B)}
    assert one["vs_best_pct"] == pytest.approx([(4.4 / 2.95 - 1) * 100, 0.0])
    assert one["worst_vs_default_pct"] == pytest.approx((4.4 / 3.0 - 1) * 100)


def test_a_run_cut_short_leaves_out_what_it_lacks(bench):
    run = saved_run()
    run["points"] = [p for p in run["points"] if (p["L"], p["launch"]) != (1024, 4096)]
    assert {tuple(e["buckets"]) for e in bench.analyze_buckets(run)} == {(8192,)}


def test_analyze_prints_a_saved_bucket_run_and_still_an_old_one(bench, monkeypatch, tmp_path, capsys):
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps(saved_run()))
    main = importlib.import_module("decode_attention")
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--analyze", str(path)])
    main.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith("hq32-hk8-d128")]
    assert [(r[3], r[4], r[-1]) for r in rows] == [("<=4096,8192", "tuning_len", "ok"),
                                                   ("<=4096,8192", "minimax_loss", "ok"),
                                                   ("<=4096,8192", "never_slower_than_default", "ok"),
                                                   ("<=8192", "tuning_len", "MISS"),
                                                   ("<=8192", "minimax_loss", "MISS"),
                                                   ("<=8192", "never_slower_than_default", "MISS")]  # fmt: skip
    assert rows[1][5:9] == ["1.7/", "0.0", "0.0/", "-10.0"] and rows[1][-3:-1] == ["1.7/", "0.0"]  # 1K, 8K, worst
    old = os.path.join(REPO, "benchmarks", "results", "decode_attention_h200.json")
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--analyze", old])
    main.main()
    assert "frozen config (chosen from the ladder, applied at every L)" in capsys.readouterr().out


def test_more_sets_in_one_run_and_their_summary(bench):
    """``--also-buckets 2048,8192 8192``: each set as graph lengths (capped by the longest L), each once, then one
    bucket; the summary counts the rows meeting the goal per set and rule."""
    lens = [1024, 8192, 32768]
    also = [bench.parse_set("2048,8192"), bench.parse_set("8192"), bench.parse_set("65536,4096")]
    assert bench.bucket_sets([4096, 32768], also, lens) == [[4096, 32768], [2048, 8192, 32768], [8192, 32768],
                                                            [32768]]  # fmt: skip
    for bad in ("", "4k", "0,4096", "4096,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected comma-separated positive KV lengths"):
            bench.parse_set(bad)
    summary = bench.summarize(bench.analyze_buckets(saved_run()))
    assert summary[("4096,8192", "minimax_loss")] == {"rows": 1, "rows_ok": 1, "worst_vs_best_pct": pytest.approx(
        (3.0 / 2.95 - 1) * 100), "worst_vs_default_pct": pytest.approx(0.0)}  # fmt: skip
    assert summary[("8192", "minimax_loss")]["rows_ok"] == 0


def test_also_buckets_needs_buckets(bench, monkeypatch, capsys):
    main = importlib.import_module("decode_attention")
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--also-buckets", "2048"])
    with pytest.raises(SystemExit):
        main.main()
    assert "--also-buckets expected --buckets too" in capsys.readouterr().err


# ms of (default, A, B) per (KV length, launch length): graphs tuned at 1024 (A wins its ladder) and at 8192 (B wins),
# and a 2048 graph (L = 1K and 2K) that was never tuned
NEAREST_TIMES = {
    (1024, 1024): (3.0, 2.0, 2.5), (512, 1024): (2.0, 1.5, 1.8),  # 1024's ladder: A
    (8192, 8192): (20, 25, 18), (4096, 8192): (11, 13, 10), (1024, 8192): (5, 4.5, 4.4),
    (512, 8192): (3, 2.9, 2.8),  # 8192's ladder: B
    (1024, 2048): (4.0, 3.2, 3.0), (2048, 2048): (6.0, 7.5, 5.0),  # the 2048 graph (2K is also its eager launch)
}  # fmt: skip


def nearest_run():
    points = [{"shape": "hq32-hk8-d128", "B": 8, "kind": "none", "L": n, "launch": launch, "default_ms": t[0],
               "configs": [[A, t[1]], [B, t[2]]]} for (n, launch), t in NEAREST_TIMES.items()]  # fmt: skip
    return {"device": "test", "mode": "buckets", "buckets": [2048], "lens": [1024, 2048], "points": points}


def test_a_graph_never_tuned_replays_each_tuned_length_s_pick(bench):
    """The 2048 graph with configs tuned only at 1024 and 8192: the nearest-key rule takes 8192 (at or above the
    graph's length), plain L1 1024; each pick's loss at 1K and 2K against their eager best and default."""
    entries = {e["tuned_at"]: e for e in bench.analyze_nearest(nearest_run(), [2048], [1024, 8192])}
    assert set(entries) == {1024, 8192}
    short, long = entries[1024], entries[8192]
    assert (short["config"], long["config"]) == (json.dumps(A), json.dumps(B))
    assert (short["nearest"], short["l1"], long["nearest"], long["l1"]) == (False, True, True, False)
    assert short["ladder"] == [1024, 512] and long["ladder"] == [8192, 4096, 1024, 512]
    assert short["vs_best_pct"] == pytest.approx([60.0, 50.0]) and short["vs_default_pct"] == pytest.approx(
        [(3.2 / 3.0 - 1) * 100, 25.0])  # fmt: skip
    assert long["vs_best_pct"] == pytest.approx([50.0, 0.0]) and long["worst_vs_default_pct"] == pytest.approx(0.0)
    assert bench.analyze_nearest(nearest_run(), [4096], [1024, 8192]) == []  # no 4096 graph timed


def run_cli(monkeypatch, tmp_path, flag):
    """``decode_attention.py --analyze RUN FLAG 2048 --tuned-lens 1024 8192`` on ``nearest_run``: (the module, its
    argv without ``--out``, the saved JSON's path)."""
    run, out = tmp_path / "run.json", tmp_path / "out.json"
    run.write_text(json.dumps(nearest_run()))
    main = importlib.import_module("decode_attention")
    argv = ["decode_attention.py", "--analyze", str(run), flag, "2048", "--tuned-lens", "1024", "8192"]
    monkeypatch.setattr(sys, "argv", argv + ["--out", str(out)])
    main.main()
    return main, argv, out


def test_nearest_analysis_from_the_command_line(bench, monkeypatch, tmp_path, capsys):
    main, _, out = run_cli(monkeypatch, tmp_path, "--nearest")
    run = tmp_path / "run.json"
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("hq32-hk8-d128")]
    assert [(r[4], r[5]) for r in rows] == [("1024", "-/L1"), ("8192", "N")]
    saved = json.loads(out.read_text())
    assert saved["graphs"] == [2048] and [e["tuned_at"] for e in saved["analysis"]] == [1024, 8192]
    for extra, why in (
        (["--nearest", "2048"], "--nearest expected --analyze too"),
        (["--analyze", str(run), "--nearest", "0"], "--nearest expected positive KV lengths"),
    ):
        monkeypatch.setattr(sys, "argv", ["decode_attention.py", *extra])
        with pytest.raises(SystemExit):
            main.main()
        assert why in capsys.readouterr().err
    old = os.path.join(REPO, "benchmarks", "results", "decode_attention_h200.json")
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--analyze", old, "--nearest", "2048"])
    with pytest.raises(SystemExit, match="expected a bucket run"):
        main.main()


def test_bucket_sets_at_level_0_replay_what_the_nearest_key_rule_takes(bench):
    """With configs tuned only for graphs of 1024 and 8192: a 2048 graph alone takes 8192's pick (B), and a 1024
    bucket under it takes 1024's (A) for L = 1K; the 2048 bucket above it still takes 8192's."""
    assert bench.nearest_tuned_len(8, 2048, [2048], [1024, 8192]) == 8192
    assert bench.nearest_tuned_len(8, 1024, [1024, 2048], [1024, 8192]) == 1024
    assert bench.nearest_tuned_len(8, 2048, [1024, 2048], [1024, 8192]) == 8192  # its key carries the floor 1024
    assert bench.nearest_tuned_len(8, 512, [512], [1024]) == 1024
    run = nearest_run()
    entries = {tuple(e["buckets"]): e for e in bench.analyze_level0(run, [[2048], [1024, 2048]], [1024, 8192])}
    one, two = entries[(2048,)], entries[(1024, 2048)]
    assert one["tuned_at"] == {"2048": 8192} and two["tuned_at"] == {"1024": 1024, "2048": 8192}
    assert one["vs_best_pct"] == pytest.approx([50.0, 0.0])  # B in the 2048 graph: 3.0 at 1K (best 2.0), 5.0 at 2K
    assert two["vs_best_pct"] == pytest.approx([0.0, 0.0])  # A in the 1K graph at 1K: 2.0, the best
    assert two["vs_default_pct"] == pytest.approx([(2.0 / 3.0 - 1) * 100, (5.0 / 6.0 - 1) * 100])
    assert bench.analyze_level0(run, [[4096]], [1024, 8192]) == []  # no 4096 graph timed


def test_level0_from_the_command_line(bench, monkeypatch, tmp_path, capsys):
    main, argv, out = run_cli(monkeypatch, tmp_path, "--level0")
    printed = capsys.readouterr().out
    assert "graphs <=2048 (configs 2K<-8K)" in printed and "<=2048                       0 of   1" in printed
    saved = json.loads(out.read_text())
    assert saved["sets"] == [[2048]] and saved["analysis"][0]["worst_vs_best_pct"] == pytest.approx(50.0)
    monkeypatch.setattr(sys, "argv", argv + ["--nearest", "2048"])
    with pytest.raises(SystemExit):
        main.main()
    assert "--nearest and --level0 expected one at a time" in capsys.readouterr().err
