"""prefix_cache_ttft's method on the CPU (tiny models): which sends read what from the cache, not how fast."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("prefix_cache_ttft")


def rows(bench, tmp_path, *args):
    out = tmp_path / "ttft.json"
    bench.main(["--tiny", "--prompt", "120", "--repeats", "2", "--out", str(out), *args])
    on, off = json.loads(out.read_text())["rows"]
    assert (on["mode"], off["mode"]) == ("cache on", "cache off")
    assert off["second_cached_tokens"] == off["third_cached_tokens"] == [0, 0]
    assert len(on["firsts_ms"]) == len(on["thirds_ms"]) == 2
    return on


@pytest.mark.parametrize("model", ["qwen3", "qwen3.5"])
def test_a_repeated_prompt_is_read_from_the_cache(bench, tmp_path, model):
    """All but the last token from the second send on (Qwen3); Qwen3.5's second send stops at the branch (119) and
    leaves a state checkpoint there, so its third send is the first to read the cache."""
    on = rows(bench, tmp_path, "--model", model)
    hit = [119, 119]
    assert on["second_cached_tokens"] == (hit if model == "qwen3" else [0, 0]) and on["third_cached_tokens"] == hit


@pytest.mark.parametrize("model", ["qwen3", "qwen3.5"])
def test_a_shared_system_prompt_is_read_from_the_cache(bench, tmp_path, model):
    on = rows(bench, tmp_path, "--model", model, "--shared", "80")
    assert on["shared"] == 80 and on["third_cached_tokens"] == [80, 80]
    assert on["second_cached_tokens"] == ([80, 80] if model == "qwen3" else [0, 0])


def test_a_shared_prefix_must_leave_each_send_its_own_tokens(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--prompt", "120", "--shared", "120", "--out", str(tmp_path / "x.json")])
    assert "--shared expected in [0, --prompt 120), got 120" in capsys.readouterr().err


def test_with_mtp_a_shared_prefix_is_read_but_its_last_slot(bench, tmp_path):
    """With an MTP head a slot is keyed by its token and the next: a repeated prompt reads what it reads without
    MTP, and a shared system prompt all but its last slot, whose next token differs between the sends."""
    assert rows(bench, tmp_path, "--model", "qwen3.5", "--mtp_step", "2")["third_cached_tokens"] == [119, 119]
    on = rows(bench, tmp_path, "--model", "qwen3.5", "--mtp_step", "2", "--shared", "80")
    assert on["mtp_step"] == 2 and on["second_cached_tokens"] == [0, 0] and on["third_cached_tokens"] == [79, 79]


def test_mtp_needs_the_model_with_a_head(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--mtp_step", "2", "--out", str(tmp_path / "x.json")])
    assert (
        "--mtp_step expected --model qwen3.5 (the model with an MTP head), got --model qwen3" in capsys.readouterr().err
    )
