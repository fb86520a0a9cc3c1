"""pinned_copy_cost's method: the rows it writes and the checks of its flags, not how fast."""

import json

import pytest
import torch

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("pinned_copy_cost")


def test_every_variant_is_timed_idle_and_behind_a_busy_device(bench, tmp_path):
    out = tmp_path / "cost.json"
    bench.main(["--device", "cpu", "--sizes", "1", "8", "--calls", "20", "--rounds", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["values"], r["variant"]) for r in rows] == [
        (1, "host_to_device"), (1, "pageable torch.tensor"), (8, "host_to_device"), (8, "pageable torch.tensor")
    ]  # fmt: skip
    assert all(r["idle_us"] > 0 for r in rows) and result["busy_launch_us"] > 0


def test_each_variant_puts_the_values_on_the_device(bench):
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        calls = bench.variants([5, 6, 7], torch.device(device))
        pinned = {"persistent pinned buffer", "pin_memory only"} if device == "cuda" else set()
        assert set(calls) == {"host_to_device", "pageable torch.tensor"} | pinned
        for name, call in calls.items():
            got = call()
            where = "cpu" if name == "pin_memory only" else device
            assert got.device.type == where and got.tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sizes", "0"], "--sizes, --calls and --rounds expected positive integers, got [0], 2000, 5"),
        (["--rounds", "0"], "--sizes, --calls and --rounds expected positive integers, got [1, 64, 4096], 2000, 0"),
        ([], "--device cuda expected a CUDA GPU, found none"),
    ],
)
def test_bad_flags_name_the_flag(bench, tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(flags + ["--out", str(tmp_path / "x.json")])
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_times_the_pinned_variants_too(bench, tmp_path):
    out = tmp_path / "cost.json"
    bench.main(["--sizes", "64", "--calls", "50", "--rounds", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["variant"] for r in rows} == {"host_to_device", "pageable torch.tensor", "persistent pinned buffer",
                                            "pin_memory only"}  # fmt: skip
    for name, call in bench.variants([5, 6, 7], torch.device("cuda")).items():
        for _ in range(bench.RING + 1):  # round the persistent ring once
            got = call()
            assert got.device.type == ("cpu" if name == "pin_memory only" else "cuda") and got.tolist() == [5, 6, 7]
