"""short_prefill's method on the CPU (the tiny Qwen3.5): which mode each round ran and what it timed, not how fast."""

import json

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
    assert seen == [0, 64, 64, 0] and [r["mode"] for r in rounds] == ["chunked", "recurrent", "recurrent", "chunked"]
    assert linear_attention.RECURRENT_MAX_TOKENS == 64  # restored
    for r in rounds:
        assert r["repeated_cached_tokens"][2] == 99 and r["fresh_1_ms"] > 0 and r["fresh_5_ms"] > 0
    assert set(summary) == {"chunked", "recurrent"}
    assert set(summary["chunked"]) == {"fresh_1_ms", "fresh_5_ms", "cache_hit_ms"}
    assert json.loads(out.read_text())["rows"][0]["summary"] == summary


def test_bad_lengths_are_refused(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--lens", "0", "--out", str(tmp_path / "x.json")])
    assert "--lens, --sends and --rounds expected positive integers" in capsys.readouterr().err
