"""short_prefill's method on the CPU (the tiny Qwen3.5): which mode each round ran and what it timed, not how fast."""

import json
from types import SimpleNamespace

import pytest

from lightllm.layers import linear_attention
from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("short_prefill")


def test_modes_alternate_and_the_third_send_is_a_cache_hit(bench, tmp_path, monkeypatch):
    seen, real = [], bench.one_round

    def watched(*args):
        seen.append(linear_attention.RECURRENT_MAX_TOKENS)
        return real(*args)

    monkeypatch.setattr(bench, "one_round", watched)
    out = tmp_path / "short.json"
    summary, rounds = bench.main(["--tiny", "--lens", "1", "5", "--prompt", "100", "--sends", "1", "--rounds", "2",
                                  "--out", str(out)])  # fmt: skip
    modes = ["chunked", "recurrent", "graphs", "graphs", "recurrent", "chunked"]
    assert seen == [0, 64, 64, 64, 64, 0] and [r["mode"] for r in rounds] == modes
    assert linear_attention.RECURRENT_MAX_TOKENS == 64  # restored
    for r in rounds:
        assert r["repeated_cached_tokens"][2] == 99 and r["fresh_1_ms"] > 0 and r["fresh_5_ms"] > 0
    assert set(summary) == {"chunked", "recurrent", "graphs"}
    assert set(summary["chunked"]) == {"fresh_1_ms", "fresh_5_ms", "cache_hit_ms"}
    saved = json.loads(out.read_text())["rows"][0]
    assert saved["summary"] == summary and saved["profile"] is None
    startup = saved["startup"]  # the CPU captures no graphs; the start-up's parts are timed
    assert startup["prefill_graphs"] == 0 and startup["prefill_buckets"] == [] and startup["prefill_graph_mib"] == 0
    assert startup["seconds"] and all(v >= 0 for v in startup["seconds"].values())


def test_each_mode_sets_the_kernel_choice_and_the_graphs(bench, monkeypatch):
    monkeypatch.setattr(linear_attention, "RECURRENT_MAX_TOKENS", 64)
    runner, captured = SimpleNamespace(prefill_graphs=None), object()
    got = {}
    for mode in ("graphs", "chunked", "recurrent", "graphs"):
        bench.set_mode(runner, captured, mode)
        got[mode] = (linear_attention.RECURRENT_MAX_TOKENS, runner.prefill_graphs is captured)
    assert got == {"chunked": (0, False), "recurrent": (64, False), "graphs": (64, True)}


def test_profile_of_a_cache_hit(bench, tmp_path):
    out = tmp_path / "short.json"
    bench.main(["--tiny", "--lens", "1", "--prompt", "100", "--sends", "1", "--rounds", "1", "--profile", "chunked",
                "--top", "5", "--out", str(out)])  # fmt: skip
    profile = json.loads(out.read_text())["rows"][0]["profile"]
    assert profile["mode"] == "chunked" and profile["cached_tokens"] == 99
    assert len(profile["top_ops"]) == 5 and profile["host_ms"] > 0
    hosts = [op["host_total_ms"] for op in profile["top_ops"]]
    assert hosts == sorted(hosts, reverse=True) and all(op["calls"] >= 1 for op in profile["top_ops"])
    assert linear_attention.RECURRENT_MAX_TOKENS == 64


def test_bad_lengths_are_refused(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--lens", "0", "--out", str(tmp_path / "x.json")])
    assert "--lens, --sends, --rounds and --top expected positive integers" in capsys.readouterr().err


def test_chunked_graphs_are_set_for_the_run_only(bench, tmp_path, monkeypatch, capsys):
    seen, real, default = [], bench.one_round, linear_attention.CHUNKED_GRAPH_MAX_TOKENS

    def watched(*args):
        seen.append(linear_attention.CHUNKED_GRAPH_MAX_TOKENS)
        return real(*args)

    monkeypatch.setattr(bench, "one_round", watched)
    bench.main(["--tiny", "--lens", "1", "--prompt", "100", "--sends", "1", "--rounds", "1",
                "--chunked-graph-max-tokens", "128", "--out", str(tmp_path / "s.json")])  # fmt: skip
    assert seen == [128] * 3 and linear_attention.CHUNKED_GRAPH_MAX_TOKENS == default == 512
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--chunked-graph-max-tokens", "-1", "--out", str(tmp_path / "x.json")])
    assert "--chunked-graph-max-tokens expected a non-negative integer" in capsys.readouterr().err
