"""warmup_compiles' method on the CPU (the tiny models: nothing compiles there): what each arm and item records, not
how fast."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("warmup_compiles")


def test_the_program_log_times_each_program_and_lets_triton_compile(bench):
    log = bench.ProgramLog()
    fn = type("Info", (), {"name": "rmsnorm_kernel"})()
    assert log._before(key=("k", 1), repr="rmsnorm_kernel[...](N: i32)", fn=fn, compile={}) is False
    assert log._after(key=("k", 1), repr="rmsnorm_kernel[...](N: i32)", fn=fn, compile={}) is False
    (got,) = log.since(0)
    assert got["kernel"] == "rmsnorm_kernel" and got["program"].endswith("(N: i32)") and got["s"] >= 0
    assert log.since(1) == []


def test_an_arm_runs_every_item_twice_in_order(bench, tmp_path, capsys):
    """Qwen3.5: the prefix cache's third send reads its state checkpoint too. One arm (a process of its own each):
    on the CPU both run the same references."""
    out = tmp_path / "w.json"
    bench.main(["--tiny", "--model", "qwen3.5", "--arms", "unaligned", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["arm"] for r in rows] == ["unaligned"]
    names = [name for name, _, _ in bench.TRAFFIC]
    for r in rows:
        assert [(i["pass"], i["item"]) for i in r["items"]] == [(p, n) for p in (0, 1) for n in names]
        assert r["after_startup"] == 0 and r["startup_programs"] == 0  # the CPU runs the torch references
        for i in r["items"]:
            sends = 3 if "x3" in i["item"] else 1
            assert len(i["ttft_ms"]) == len(i["cached_tokens"]) == sends and all(t > 0 for t in i["ttft_ms"])
        repeated = next(i for i in r["items"] if "x3" in i["item"])
        assert repeated["cached_tokens"][0] == 0 and repeated["cached_tokens"][2] == 776  # all but the last token
    table = capsys.readouterr().out
    assert "| unaligned | 777 x3 (prefix cache) |" in table and "| unaligned | 1 |" in table
