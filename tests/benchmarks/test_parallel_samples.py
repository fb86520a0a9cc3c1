"""parallel_samples' method on the CPU (tiny models): how many prompt tokens each mode computes, not how fast."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("parallel_samples")


@pytest.mark.parametrize(
    "model", [["--model", "qwen3"], ["--model", "qwen3.5"], ["--model", "qwen3.5", "--mtp_step", "1"]]
)
def test_samples_read_the_prompt_the_first_computed(bench, tmp_path, model):
    out = tmp_path / "samples.json"
    bench.main(["--tiny", "--prompt", "90", "--samples", "3", "--repeats", "2", "--out", str(out), *model])
    on, off = json.loads(out.read_text())["rows"]
    assert (on["mode"], off["mode"]) == ("cache on", "cache off")
    assert on["computed_tokens"] == [90 + 2, 90 + 2] and off["computed_tokens"] == [3 * 90, 3 * 90]
    assert on["cached_tokens"] == [[0, 89, 89]] * 2 and off["cached_tokens"] == [[0, 0, 0]] * 2
    assert len(on["rounds_ms"]) == 2


def test_one_sample_is_refused(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--samples", "1", "--out", str(tmp_path / "x.json")])
    assert "--samples and --prompt expected at least 2, got 1 and 4096" in capsys.readouterr().err


def test_each_modes_runner_is_freed_before_the_next_sizes_its_pool(bench, tmp_path, monkeypatch):
    """On a GPU the second mode's KV pool is sized from the free memory, so the first mode's runner must be gone by
    then (a runner kept alive left the second one a pool of 0 tokens on the H100)."""
    import gc
    import weakref

    made, alive_at_start = [], []
    real = bench.ModelRunner

    def tracked(*args, **kwargs):
        alive_at_start.append(sum(ref() is not None for ref in made))
        runner = real(*args, **kwargs)
        made.append(weakref.ref(runner))
        return runner

    monkeypatch.setattr(bench, "ModelRunner", tracked)
    bench.main(["--tiny", "--prompt", "40", "--samples", "2", "--repeats", "1", "--out", str(tmp_path / "s.json")])
    gc.collect()
    assert alive_at_start == [0, 0] and [ref() for ref in made] == [None, None]
