"""overlap_decode's method on the CPU (tiny model): what it measures and compares, not how fast anything is."""

import json
import types

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("overlap_decode")


def test_each_batch_gets_a_row_per_mode_from_the_same_rounds_and_equal_outputs(bench, tmp_path, monkeypatch):
    out = tmp_path / "overlap.json"
    modes = []
    real = bench.one_round
    monkeypatch.setattr(bench, "one_round", lambda engine, *a: (modes.append(engine.overlap), real(engine, *a))[1])
    assert bench.main(["--tiny", "--batches", "1", "3", "--prompt", "4", "--output", "6", "--rounds", "2",
                       "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [(1, True), (1, False), (3, True), (3, False)]
    # per batch: a warm-up round per mode, then the modes alternate their order round by round
    assert modes == [True, False, True, False, False, True] * 2
    for on, off in zip(rows[::2], rows[1::2]):
        assert on["outputs_equal"] and off["outputs_equal"]
        assert len(on["decode_tok_s_rounds"]) == len(off["decode_tok_s_rounds"]) == 2
        assert on["speedup"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
        assert on["step_ms"] > 0 and off["step_ms"] > 0 and on["gpu_step_ms"] is None  # no GPU timer on the CPU


@pytest.mark.parametrize("output", [3, 6])
def test_decode_rate_counts_the_tokens_of_the_timed_steps(bench, tmp_path, monkeypatch, output):
    """A fake clock that advances one second per engine step: every step after the prefill decodes the whole batch,
    so the decode rate is ``batch`` tokens/s in both modes. The clock starts as the first decode step ends; counting
    that step's tokens too overstated the rate by (output - 1) / (output - 2)."""
    from lightllm.engine.args import EngineArgs
    from lightllm.engine.engine import Engine
    from lightllm.engine.model_runner import ModelRunner

    batch, clock = 2, [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    model, common = bench.random_model(str(tmp_path), True, 1, 64, tiny_tokens=batch * 64 + 1)
    runner = ModelRunner(EngineArgs(model_dir=model, running_max_req_size=batch, graph_max_batch_size=batch,
                                    max_req_total_len=64, **common))  # fmt: skip
    observer = bench.StepTimes()
    engine = Engine(runner, eos_ids=[], observer=observer)
    step = engine.step

    def timed_step():
        clock[0] += 1.0
        return step()

    engine.step = timed_step
    args = types.SimpleNamespace(prompt=3, output=output, rounds=2)
    rows = bench.measure(engine, observer, batch, args, runner.config.vocab_size)
    assert [r["overlap"] for r in rows] == [True, False]
    for r in rows:
        assert r["decode_tok_s_rounds"] == [batch, batch] and r["outputs_equal"]


def test_bad_arguments_stop_it_with_one_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--output", "2"])
    assert "expected --prompt, --rounds and --batches >= 1 and --output >= 3" in capsys.readouterr().err
