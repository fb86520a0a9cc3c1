"""benchmarks/decode_stage1_ladder.py: its two rung kernels (under the interpreter) against the float32 reference
on every KV type, and its table from a saved run."""

import json
import zlib

import pytest
import torch

from lightllm.common.kv_cache.quant import round_up_scale_bits
from lightllm.kernels.attention.decode.splits import num_splits
from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def ladder():
    return load_benchmark("decode_stage1_ladder")


@pytest.mark.parametrize("dots", [False, True])
@pytest.mark.parametrize(
    "kind,group,head_major",
    [
        ("none", 0, False),
        ("int8", 8, False),
        ("int4", 8, False),
        ("int8", 32, False),
        ("int8", 8, True),
        ("int4", 8, True),
    ],
)
def test_each_rung_sums_what_its_work_makes_of_each_splits_tokens(ladder, kind, group, head_major, dots):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{group}{head_major}{dots}".encode()))
    kv_heads, head_dim, graph_max, tokens = 2, 64, 160, 700
    pool = ladder.make_pool(kind, tokens, kv_heads, head_dim, group or 8, head_major, device="cpu", generator=gen)
    q = torch.randn(4, 2 * kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    if kind == "none":  # float16: Triton 3.6's interpreter does bfloat16 arithmetic on the raw bits
        q, pool = q.half(), (pool[0].half(), pool[1].half(), None, None)
    lens = torch.tensor([160, 0, 37, 129], dtype=torch.int32)  # full, empty, ragged, one past a block
    r2t = torch.randperm(tokens, generator=gen)[: 4 * graph_max].to(torch.int32).view(4, graph_max)
    cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WAVES": 8}
    splits = num_splits(4, kv_heads, graph_max, 32, 8, torch.device("cpu"))
    assert splits == 3  # 5 blocks of the longest request over 3 splits: 2, 2 and 1 blocks
    out = torch.full((4, kv_heads, splits, head_dim), float("nan"))  # every element must be written
    ladder.launch_rung(dots, kind, q, pool, r2t, lens, graph_max, group or 8, cfg, out=out)
    want = ladder.ladder_reference(dots, kind, q, pool, r2t, lens, splits, 32, group or 8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)
    assert (want[0].abs().amax(-1) > 0).all() and (want[1] == 0).all()  # real sums where there are tokens


def test_the_reference_weighs_v_by_the_rounded_products(ladder):
    """Rung ``dots`` by hand for one token: ``f16(q . k) * v`` summed over the group's two query heads."""
    k = torch.tensor([[[1.0, 2.0]]], dtype=torch.bfloat16)  # [tokens 1, kv_heads 1, D 2]
    v = torch.tensor([[[3.0, -1.0]]], dtype=torch.bfloat16)
    q = torch.tensor([[[0.5, 0.25], [1.0, 1.0]]], dtype=torch.bfloat16)  # q . k = 1.0 and 3.0
    one = (torch.tensor([[0]]), torch.tensor([1]), 1, 16, 8)  # token 0, one request of 1 token, one split
    got = ladder.ladder_reference(True, "none", q, (k, v, None, None), *one)
    assert got.tolist() == [[[[12.0, -4.0]]]]
    got = ladder.ladder_reference(False, "none", q, (k, v, None, None), *one)
    assert got.tolist() == [[[[4.0, 1.0]]]]


def test_timing_pools_hold_int8_scales_in_the_format(ladder):
    """The GPU path's one-FMA INT8 dequantization is exact only on the format's 7-bit scales: the timing pools' INT8
    scales are such scales (and spread, not one value), INT4's are drawn as they are."""
    gen = torch.Generator().manual_seed(0)
    _, _, ks, vs = ladder.make_pool("int8", 256, 2, 64, 8, device="cpu", generator=gen)
    for s in (ks, vs):
        assert torch.equal(round_up_scale_bits(s), s) and s.unique().numel() > 16
    _, _, ks4, _ = ladder.make_pool("int4", 256, 2, 64, 8, device="cpu", generator=gen)
    assert not torch.equal(round_up_scale_bits(ks4), ks4)


def test_a_wrong_output_shape_is_an_error_naming_it(ladder):
    pool = ladder.make_pool("int8", 64, 2, 64, 8, device="cpu", generator=torch.Generator().manual_seed(0))
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    r2t, lens = torch.arange(64, dtype=torch.int32).view(1, 64), torch.tensor([64], dtype=torch.int32)
    cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WAVES": 1}
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, \d+, 64\), got \(1, 2, 9, 64\)"):
        ladder.launch_rung(False, "int8", q, pool, r2t, lens, 64, 8, cfg, out=torch.empty(1, 2, 9, 64))


def test_the_table_reads_a_saved_run(ladder, tmp_path, capsys):
    row = {"shape": "hq32-hk8-d128", "B": 64, "L": 32768, "kind": "int8", "group": 8, "bytes": 5.4e9,
           "reads_ms": 1.2, "dequant_ms": 1.3, "dots_ms": 1.6, "kernel_ms": 1.8, "cfg": {}}  # fmt: skip
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"rows": [row]}))
    ladder.main(["--analyze", str(path)])
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hq32")][0]
    assert line.split() == ["hq32-hk8-d128", "64", "int8", "8", "1200.0", "1300.0", "(+100.0)", "1600.0", "(+300.0)",
                            "1800.0", "(+200.0)", "4.50", "3.00"]  # fmt: skip


def test_bad_arguments_stop_with_one_line_naming_them(ladder, capsys):
    with pytest.raises(SystemExit):
        ladder.main(["--cells", "hq32-hk8-d128:x"])
    assert "--cells expected SHAPE:BATCH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ladder.main(["--groups", "6"])
    assert "--groups expected quant groups of 8, 16, 32 or 64 elements, got [6]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ladder.main(["--len", "0"])
    assert "--len expected a KV length of at least 1 token, got 0" in capsys.readouterr().err
