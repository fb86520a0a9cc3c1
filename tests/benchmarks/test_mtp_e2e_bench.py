"""benchmarks/mtp.py, e2e part: its arguments, the noise that sets the agreeing head's acceptance (against a direct
simulation of the head's choice) and the table of a saved run (the GPU run itself is a benchmark, not a test)."""

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("mtp")


def test_e2e_arguments(bench):
    args = bench.parse_args(["--parts", "e2e"])
    assert args.parts == ["e2e"] and (args.e2e_layers, args.e2e_batches, args.e2e_steps) == (4, [16, 64], [1, 2, 3])
    assert bench.parse_args([]).parts == ["attention", "recurrent"]  # e2e builds large models: asked for only
    for bad in (["--e2e-steps", "5"], ["--e2e-layers", "0"], ["--e2e-new-tokens", "1"], ["--e2e-batches", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.parametrize("target", [0.2, 0.5, 0.8])
def test_noise_gives_the_target_acceptance_of_the_agreeing_heads_choice(target):
    """Random unit-variance embeddings, ``lm_head`` row ``j`` = embedding ``j - 1``: how often the argmax of
    ``lm_head @ (e_t + noise * z)`` is ``t + 1``."""
    e2e = load("mtp_e2e")
    hidden, vocab, n = 64, 512, 3000
    noise = e2e.noise_for_acceptance(target, hidden, vocab)
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    e = embed[tokens]
    y = e / e.pow(2).mean(-1, keepdim=True).sqrt() + noise * torch.randn(n, hidden, generator=g, dtype=torch.float64)
    chosen = (y @ embed.roll(1, dims=0).T).argmax(-1)
    rate = float((chosen == (tokens + 1) % vocab).double().mean())
    assert abs(rate - target) <= 0.05, (noise, rate)


def test_analyze_prints_a_saved_e2e_run(bench, tmp_path, capsys):
    rows = [{"head": "~100%", "batch": 16, "mtp_step": 0, "graphs": True, "decode_tok_s": 900.0, "acceptance": None},
            {"head": "~100%", "batch": 16, "mtp_step": 3, "graphs": True, "decode_tok_s": 2100.0,
             "acceptance": 0.987}]  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"device": "H200", "e2e": {"layers": 4, "prompt_len": 64, "new_tokens": 128,
                                                          "rows": rows}}))  # fmt: skip
    bench.main(["--analyze", str(path)])
    out = capsys.readouterr().out
    assert "off graphs        900.0" in out and "mtp 3       2100.0   98.7%" in out


def test_e2e_runs_every_engine_start_on_a_tiny_model(bench, capsys):
    """The whole e2e part on the CPU at tiny widths: MTP off once (graphs and eager rows), each head with MTP, each
    start serving every batch; the agreeing head's drafts are accepted, the random head's are not."""
    e2e = load("mtp_e2e")
    args = bench.parse_args(["--parts", "e2e", "--e2e-batches", "1", "3", "--e2e-steps", "2", "--e2e-prompt-len", "8",
                             "--e2e-new-tokens", "6"])  # fmt: skip
    results = e2e.run(args, shape={"hidden_size": 64}, data_type="fp32", device="cpu")
    rows = results["rows"]
    got = [(r["head"], r["mtp_step"], r["graphs"], r["batch"]) for r in rows]
    assert got == [("any", 0, True, 1), ("any", 0, True, 3), ("any", 0, False, 1), ("any", 0, False, 3),
                   ("~100%", 2, True, 1), ("~100%", 2, True, 3), ("~50%", 2, True, 1), ("~50%", 2, True, 3),
                   ("~0%", 2, True, 1), ("~0%", 2, True, 3)]  # fmt: skip
    assert all(math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0 for r in rows)
    # each decode step's wall time from the engine's observer; GPU time only on a GPU
    assert all(r["decode_step_ms"] > 0 and r["decode_gpu_ms"] is None for r in rows)
    assert all(r["acceptance"] is None for r in rows[:4])
    assert all(r["acceptance"] >= 0.9 for r in rows[4:6]), rows[4:6]
    assert all(r["acceptance"] <= 0.3 for r in rows[8:]), rows[8:]
    assert 0 < rows[6]["mtp_noise"] and rows[4]["mtp_noise"] == 0.0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(rows)  # a line per row as it lands


def test_e2e_runs_a_subset_of_heads_without_the_off_rows(bench):
    """``--e2e-heads half random --e2e-no-off``: the second half of a run split in two (shorter device calls)."""
    e2e = load("mtp_e2e")
    args = bench.parse_args(["--parts", "e2e", "--e2e-batches", "2", "--e2e-steps", "1", "--e2e-prompt-len", "8",
                             "--e2e-new-tokens", "4", "--e2e-heads", "half", "random", "--e2e-no-off"])  # fmt: skip
    rows = e2e.run(args, shape={"hidden_size": 64}, data_type="fp32", device="cpu")["rows"]
    assert [(r["head"], r["mtp_step"], r["batch"]) for r in rows] == [("~50%", 1, 2), ("~0%", 1, 2)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "e2e", "--e2e-heads", "most"])
