"""benchmarks/conv_prefill.py's method on the CPU (Triton's interpreter): the kernel agrees with the torch anchor it
replaced, fresh and continued, and the table and JSON come out; not how fast."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("conv_prefill")


def test_dry_run_checks_both_paths_and_writes_the_table(bench, tmp_path, capsys):
    out = tmp_path / "conv.json"
    bench.main(["--dry-run", "--lens", "5", "17", "--channels", "24", "--repeats", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    cells = {(c["tokens"], c["continued"], c["impl"]) for c in saved["cells"]}
    assert cells == {(n, c, i) for n in (5, 17) for c in (False, True) for i in ("triton", "torch")}
    assert [(r["tokens"], r["continued"]) for r in saved["rows"]] == [(5, False), (5, True), (17, False), (17, True)]
    assert all(r["triton_host_us"] > 0 and r["torch_host_us"] > 0 for r in saved["rows"])
    assert saved["rows"][0]["tokens"] == 5 and saved["channels"] == 24
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "cpu, 24 channels, K = 4, bf16" and len(lines) == 6


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--lens", "0"])
    assert "--lens, --channels and --repeats expected positive integers" in capsys.readouterr().err
