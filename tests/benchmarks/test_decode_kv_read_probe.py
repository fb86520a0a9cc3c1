"""benchmarks/decode_kv_read_probe.py: its probe kernel (under the interpreter) against the numpy reference, on
every KV layout it reads, and its table from a saved run."""

import json
import os
import sys
import zlib

import pytest
import torch

from lightllm.common import proc
from lightllm.kernels.attention.decode.splits import num_splits
from tests.benchmarks.helpers import REPO, load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("decode_kv_read_probe")


# every kind in both layouts without prefetch; the prefetch without work token-major, with work head-major
CASES = [
    (kind, group, head_major, prefetch, work)
    for kind, group in [("none", 0), ("int8", 8), ("int4", 8), ("int8", 32)]
    for head_major, prefetch, work in [(False, False, 0), (True, False, 0), (False, True, 0), (True, True, 3)]
]


@pytest.mark.parametrize("kind,group,head_major,prefetch,work", CASES)
def test_the_probe_xors_every_word_of_each_splits_tokens(probe, kind, group, head_major, prefetch, work):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{group}{head_major}".encode()))
    heads, head_dim, graph_max, tokens = 2, 64, 160, 700
    pool = probe.make_pool(kind, tokens, heads, head_dim, group or 8, head_major, device="cpu", generator=gen)
    lens = torch.tensor([160, 0, 37, 129], dtype=torch.int32)  # full, empty, ragged, one past a block
    r2t = torch.randperm(tokens, generator=gen)[: 4 * graph_max].to(torch.int32).view(4, graph_max)
    cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WAVES": 8, "PREFETCH": prefetch, "WORK": work}
    splits = num_splits(4, heads, graph_max, 32, 8, torch.device("cpu"))
    assert splits == 3  # 5 blocks of the longest request over 3 splits: 2, 2 and 1 blocks
    out = torch.full((4, heads, splits), -12345, dtype=torch.int32)  # every element must be written
    probe.launch_probe(pool, r2t, lens, graph_max, cfg, out=out)
    want = probe.probe_reference(pool, r2t, lens, splits, 32, work)
    assert torch.equal(out, want)
    assert (want[0] != 0).all()  # the full request's splits read real words (zero only for splits with no tokens)


def test_the_work_per_word_is_the_wrapping_square_and_add_chain(probe):
    words = torch.tensor([0, 1, -1, 2**31 - 1, -(2**31), 123456789], dtype=torch.int32).numpy()
    want = [int(w) & 0xFFFFFFFF for w in words]
    for _ in range(3):
        want = [(w * w + 0x9E3779B9) & 0xFFFFFFFF for w in want]
    got = probe.mix_reference(words, 3)
    assert [int(g) & 0xFFFFFFFF for g in got] == want
    assert (probe.mix_reference(words, 0) == words).all()


def test_the_work_survives_the_sm90_compile(tmp_path):
    """What the --work rows mean: each round is one more integer multiply per code word a thread loads (4 rounds, 32
    words a token, 64-token tiles over 64 threads: 256 more), not folded away by the compiler. A real compile in a
    child process, in a Triton cache of its own."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import decode_kv_read_probe as p; "
            "print(p.ptx_multiplies(32, 0), p.ptx_multiplies(32, 4))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    env.pop("TRITON_INTERPRET", None)
    done = proc.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=proc.HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    without, with_work = map(int, done.stdout.split())
    assert with_work - without == 4 * 64 * 32 * 2 // 64  # K and V words of a tile, per thread


def test_a_wrong_output_shape_is_an_error_naming_it(probe):
    pool = probe.make_pool("int8", 64, 2, 64, 8, device="cpu", generator=torch.Generator().manual_seed(0))
    r2t, lens = torch.arange(64, dtype=torch.int32).view(1, 64), torch.tensor([64], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, \d+\), got \(1, 2, 999\)"):
        probe.launch_probe(pool, r2t, lens, 64, probe.CONFIGS[0], out=torch.empty(1, 2, 999, dtype=torch.int32))


def test_the_table_reads_a_saved_run(probe, tmp_path, capsys):
    rows = [
        {"shape": "hq32-hk8-d128", "B": 64, "L": 32768, "kind": "none", "group": 0, "work": 0, "probe_ms": 1.8,
         "cfg": {}, "bytes": 8.6e9, "kernel_ms": 1.884},
        {"shape": "hq32-hk8-d128", "B": 64, "L": 32768, "kind": "none", "group": 0, "work": 4, "probe_ms": 3.6,
         "cfg": {}, "bytes": 8.6e9, "kernel_ms": 1.884},
        {"shape": "hq32-hk8-d128", "B": 64, "L": 32768, "kind": "int8", "group": 8, "work": 0, "probe_ms": 1.2,
         "cfg": {}, "bytes": 5.4e9, "kernel_ms": None},
    ]  # fmt: skip
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"rows": rows}))
    probe.main(["--analyze", str(path)])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("hq32")]
    assert lines[0] == ["hq32-hk8-d128", "64", "none", "0", "0", "1800.0", "4.78", "1.00", "1884.0", "4.56"]
    assert lines[1] == ["hq32-hk8-d128", "64", "none", "0", "4", "3600.0", "2.39", "0.50", "1884.0", "4.56"]
    assert lines[2] == ["hq32-hk8-d128", "64", "int8", "8", "0", "1200.0", "4.50", "0.94", "-", "-"]


def test_the_real_kernels_time_comes_from_the_matching_row(probe):
    rows = [{"shape": "s", "B": 1, "L": 8, "kind": "int8", "group": 32, "ms": 2.0},
            {"shape": "s", "B": 1, "L": 8, "kind": "int8", "group": 8, "ms": 1.0},
            {"shape": "s", "B": 1, "L": 8, "kind": "none", "group": 0, "ms": 3.0}]  # fmt: skip
    assert probe.real_kernel_ms(rows, "s", 1, 8, "int8", 8) == 1.0
    assert probe.real_kernel_ms(rows, "s", 1, 8, "none", 0) == 3.0
    assert (
        probe.real_kernel_ms(rows, "s", 1, 8, "int4", 8) is None
        and probe.real_kernel_ms(None, "s", 1, 8, "x", 0) is None
    )
