"""benchmarks/decode_attention_quant.py, table part: speed-up over bf16 and the byte-rate ratio from a saved run."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark, run_benchmark


def test_table_gives_speedup_and_byte_rate_against_bf16(capsys):
    bench = load_benchmark("decode_attention_quant")
    b, L = 16, 32768
    bf16_bytes = bench.kv_bytes("none", b, L, 8, 128, 8)
    int8_bytes = bench.kv_bytes("int8", b, L, 8, 128, 8)  # 1.25 bytes per element against bf16's 2
    rows = [
        {"shape": "hq32-hk8-d128", "B": b, "L": L, "kind": "none", "group": 0, "ms": 0.5, "bytes": bf16_bytes},
        {"shape": "hq32-hk8-d128", "B": b, "L": L, "kind": "int8", "group": 8, "ms": 0.4, "bytes": int8_bytes},
    ]
    bench.print_table(rows)
    line = [ln for ln in capsys.readouterr().out.splitlines() if " int8 " in ln][0].split()
    assert line[-2:] == ["1.25", f"{(int8_bytes / 0.4) / (bf16_bytes / 0.5):.2f}"] and line[-1] == "0.78"


def test_bad_cells_name_the_flag():
    done = run_benchmark("decode_attention_quant", "--cells", "hq32-hk8-d128:x")
    assert done.returncode == 2 and "--cells expected SHAPE:BATCH" in done.stderr


def test_variant_spaces_twin_every_quantized_candidate():
    """--block-n-128 twins every INT8/INT4 candidate of BLOCK_N 64 at 128; bf16 keeps its own space only; the table
    prints each variant's best beside the row."""
    bench = load_benchmark("decode_attention_quant")
    space = bench.flash_decode.quant_split_kv_configs(None)
    spaces = bench.variant_spaces("int8", None, ("block_n_128",))
    assert spaces["tuned space"] == space
    assert len(spaces["block_n_128"]) == len(space) // 2 and {c["BLOCK_N"] for c in spaces["block_n_128"]} == {128}
    assert list(bench.variant_spaces("none", None, ("block_n_128",))) == ["tuned space"]


def test_more_stages_and_element_path_spaces():
    """--more-stages adds a stage to every 2- and 4-warp candidate; --element-path times the tuned space again with
    the PTX dequantization off (and restores it)."""
    bench = load_benchmark("decode_attention_quant")
    space = bench.flash_decode.quant_split_kv_configs(None)
    spaces = bench.variant_spaces("int4", None, ("more_stages", "element_path"))
    assert spaces["element_path"] == space
    assert spaces["more_stages"] == [{**c, "num_stages": c["num_stages"] + 1} for c in space if c["num_warps"] < 8]
    assert list(bench.variant_spaces("none", None, ("more_stages", "element_path"))) == ["tuned space"]


def test_peel_all_times_the_space_again_with_the_peel_at_every_head_dim(monkeypatch):
    """--peel-all: the tuned space once more, timed with stage 1 peeling at head_dim 256 too; the launcher's bound
    is back afterwards, also when a timing fails."""
    bench = load_benchmark("decode_attention_quant")
    fd = bench.flash_decode
    seen = []

    def fake_time_configs(kind, q, pool, r2t, idx, seq, graph_max, out, group, space):
        seen.append(fd.peel_queries(True, 256))
        return None, [(cfg, 1.0 + i) for i, cfg in enumerate(space)]

    monkeypatch.setattr(bench, "time_configs", fake_time_configs)
    best = bench.best_of_space("int8", None, None, None, None, None, 32768, None, 8, ("peel_all",))
    assert list(best) == ["tuned space", "peel_all"] and seen == [False, True]
    assert best["peel_all"]["cfg"] == json.dumps(fd.quant_split_kv_configs(None)[0])
    assert not fd.peel_queries(True, 256)
    assert list(bench.variant_spaces("none", None, ("peel_all",))) == ["tuned space"]

    def failing_when_peeled(*args):
        if fd.peel_queries(True, 256):
            raise RuntimeError("out of memory")
        return fake_time_configs(*args)

    monkeypatch.setattr(bench, "time_configs", failing_when_peeled)
    with pytest.raises(RuntimeError):
        bench.best_of_space("int4", None, None, None, None, None, 32768, None, 8, ("peel_all",))
    assert not fd.peel_queries(True, 256)


def test_table_prints_the_variants(capsys):
    bench = load_benchmark("decode_attention_quant")
    base = {"shape": "hq32-hk8-d128", "B": 16, "L": 32768, "group": 8, "bytes": 1.0}
    variants = {"tuned space": {"ms": 0.5, "cfg": "{}"}, "block_n_128": {"ms": 0.4, "cfg": "{}"}}
    bench.print_table([{**base, "kind": "none", "ms": 0.5}, {**base, "kind": "int8", "ms": 0.4, "variants": variants}])
    line = [ln for ln in capsys.readouterr().out.splitlines() if " int8 " in ln][0]
    assert line.endswith("tuned space 500.0  block_n_128 400.0")


def test_configs_replace_the_quantized_space_and_the_table_prints_each(capsys):
    """--configs: INT8/INT4 time exactly the given configs (bf16 keeps its tuned space as the baseline), and the
    table prints every config's time in the order given."""
    bench = load_benchmark("decode_attention_quant")
    cfgs = [{"BLOCK_N": 64, "num_warps": 2, "num_stages": 3, "WAVES": 4},
            {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "WAVES": 2, "MIN_BLOCKS": 2}]  # fmt: skip
    assert bench.variant_spaces("int8", None, ("block_n_128",), cfgs) == {"configs": cfgs}
    assert list(bench.variant_spaces("none", None, (), cfgs)) == ["tuned space"]
    base = {"shape": "hq32-hk8-d128", "B": 16, "L": 32768, "group": 8, "bytes": 1.0}
    variants = {"configs": {"ms": 0.44, "cfg": "{}", "timed": [[cfgs[0], 0.5256], [cfgs[1], 0.44]]}}
    bench.print_table([{**base, "kind": "none", "ms": 0.5}, {**base, "kind": "int8", "ms": 0.44, "variants": variants}])
    line = [ln for ln in capsys.readouterr().out.splitlines() if " int8 " in ln][0]
    assert line.endswith("configs 525.6 440.0")


@pytest.mark.parametrize("value", ['{"BLOCK_N": 64}', "not json", '{"BLOCK_N": 64, "num_warps": 2, "num_stages": 3, '
                                   '"WAVES": 4, "SPLITS": 3}'])  # fmt: skip
def test_bad_configs_name_the_flag(value):
    done = run_benchmark("decode_attention_quant", "--configs", value)
    assert done.returncode == 2 and "--configs expected JSON objects with keys" in done.stderr and value in done.stderr


def test_bad_kinds_name_the_flag():
    done = run_benchmark("decode_attention_quant", "--kinds", "fp8")
    assert done.returncode == 2 and "--kinds: invalid choice: 'fp8'" in done.stderr
