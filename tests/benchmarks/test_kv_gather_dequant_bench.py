"""benchmarks/kv_gather_dequant.py: the table of a saved run (the GPU timings are the benchmark's, not a test's)."""

from tests.benchmarks.helpers import load_benchmark


def test_table_reports_speedup_and_rate(capsys):
    bench = load_benchmark("kv_gather_dequant")
    row = {"quant": "int4", "tokens": 4096, "kernel_ms": 0.01, "torch_ms": 0.05, "kernel_GBs": 2500.0, "speedup": 5.0}
    bench.print_table({"device": "GPU", "kv_heads": 8, "head_dim": 128, "group": 8, "rows": [row]})
    out = capsys.readouterr().out.splitlines()
    assert out[-1].split() == ["int4", "4096", "10.0", "50.0", "5.00", "2500"]
