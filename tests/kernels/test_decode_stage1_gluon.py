"""The Gluon INT8 decode stage 1 (``stage1_gluon.py``): on the CPU, what it compiles to for sm_90 (its point: no
shared memory between the loaded code words and the tensor-core operands); on a GPU, its output through stage 2
against the float64 reference over the dequantized cache."""

import json
import os
import sys

import pytest
import torch

from lightllm.common import proc
from lightllm.kernels.attention.decode import stage1_gluon
from lightllm.kernels.attention.decode.flash_decode import launch_stage2
from lightllm.kernels.attention.decode.reference import decode_attention_ref

from tests.benchmarks.test_linear_attention_bench import REPO
from tests.kernels.test_decode_attention import make_batch, quantize, rel_err

_CHILD = """
import json, sys
sys.path.insert(0, "benchmarks")
from decode_stage1_resources import build_gluon
out = []
for q_heads, kv_heads, head_dim, block_n, prefetch in json.loads(sys.argv[1]):
    c = build_gluon(90, (q_heads, kv_heads, head_dim), block_n, prefetch)
    out.append({"shared": c.metadata.shared, "ttgir": c.asm["ttgir"], "ptx": c.asm["ptx"]})
print(json.dumps(out))
"""
_SHAPES = [(32, 8, 128, 16, False), (64, 8, 128, 32, False), (24, 4, 256, 16, False), (32, 8, 128, 16, True)]


@pytest.fixture(scope="module")
def compiled_sm90(tmp_path_factory):
    """Each shape compiled for sm_90 (benchmarks/decode_stage1_resources.py's build) in one child process without the
    interpreter (Gluon has none), into a Triton cache of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=REPO, TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    done = proc.run([sys.executable, "-c", _CHILD, json.dumps(_SHAPES)], timeout=proc.HANG_TIMEOUT_S, cwd=REPO,
                    env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(map(tuple, _SHAPES), json.loads(done.stdout)))


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_n, prefetch", _SHAPES)
def test_compiles_for_sm90_with_nothing_through_shared_memory(compiled_sm90, q_heads, kv_heads, head_dim, block_n,
                                                              prefetch):  # fmt: skip
    """The dequantized K and V go from the code words to the mma operands in registers: no shared memory, no
    barrier, every dot a register mma (four per tile and side, one per byte of a word), and the codes loaded 16
    bytes at a time."""
    compiled = compiled_sm90[q_heads, kv_heads, head_dim, block_n, prefetch]
    ptx = compiled["ptx"]
    assert compiled["shared"] == 0
    assert "local_alloc" not in compiled["ttgir"]
    assert not any(op in ptx for op in ("ld.shared", "st.shared", "bar.sync", "ldmatrix"))
    # per tile: S = sum_j Q_j K_j (16 x BLOCK_N over D/4 each) and O_j = P V_j (16 x D/4 over BLOCK_N)
    per_tile = 4 * (block_n // 8) * (head_dim // 4 // 16) + 4 * (head_dim // 4 // 8) * (block_n // 16)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == per_tile
    # the codes arrive four words (16 bytes) of a token per load, K and V alike (the first tile's also before the
    # loop with PREFETCH)
    assert ptx.count("ld.global.v4.b32") == 2 * (head_dim // 4) * block_n // 4 // 32 * (2 if prefetch else 1)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q_dtype=torch.float32), r"^q: expected float16 or bfloat16"),
        (dict(q_layout="strided"), r"^q: expected a contiguous last dim"),
        (dict(head_dim=64), r"^head_dim: expected 128 or 256"),
        (dict(q_heads=34, kv_heads=2), r"^query heads per KV head: expected 1-16"),
        (dict(quant_group=32), r"^quant_group: expected 8"),
        (dict(k_dtype=torch.uint8), r"^k_cache: expected int8 codes"),
    ],
)
def test_what_it_does_not_take_is_a_value_error_naming_it(change, match):
    shape = dict(q_heads=32, kv_heads=8, head_dim=128, q_dtype=torch.bfloat16, quant_group=8, k_dtype=torch.int8)
    shape.update(change)
    q = torch.zeros(2, shape["q_heads"], shape["head_dim"], dtype=shape["q_dtype"])
    if shape.get("q_layout") == "strided":
        q = torch.zeros(2, shape["q_heads"], 2 * shape["head_dim"], dtype=shape["q_dtype"])[..., ::2]
    k = torch.zeros(16, shape["kv_heads"], shape["head_dim"], dtype=shape["k_dtype"])
    with pytest.raises(ValueError, match=match):
        stage1_gluon.check_supported(q, k, shape["quant_group"])


def test_rows_off_a_word_boundary_are_refused():
    k = torch.zeros(16, 8, 130, dtype=torch.int8)[:, :, :128]  # row stride 130: not a multiple of 4
    with pytest.raises(ValueError, match=r"^k_cache: expected 4-byte aligned rows"):
        stage1_gluon.check_word_aligned(k, torch.zeros(16, 8, 128, dtype=torch.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(128, 32, 8), (128, 64, 8), (128, 16, 8), (256, 24, 4)])
@pytest.mark.parametrize("block_n, splits, prefetch", [(16, 7, False), (32, 3, False), (32, 40, False), (16, 7, True)])
def test_gpu_matches_the_reference_through_stage2(head_dim, q_heads, kv_heads, block_n, splits, prefetch):
    """Ragged lengths (a tail in every last tile, one empty request, one of a single token) and more splits than
    some requests have blocks; bf16 queries; every output element written."""
    lens = [1, 300, 4097, 0, 63, 2049]
    q, k, v, r2t, idx, seq = make_batch(len(lens), q_heads, kv_heads, head_dim, lens, torch.bfloat16, pool=32768,
                                        seed=5)  # fmt: skip
    kq, vq, ks, vs, kd, vd = quantize(k, v, "int8", 8)
    mid_o = torch.full((len(lens), q_heads, splits, head_dim), float("nan"), device=q.device)
    mid_lse = torch.full((len(lens), q_heads, splits), float("nan"), device=q.device)
    out = torch.full_like(q, float("nan"))
    stage1_gluon.launch_stage1_int8_gluon(q, kq, vq, ks, vs, r2t, idx, seq, mid_o, mid_lse, head_dim**-0.5, block_n,
                                          prefetch=prefetch)  # fmt: skip
    launch_stage2(mid_o, mid_lse, seq, out, block_n)
    assert not out.isnan().any(), "unwritten output"
    ref = decode_attention_ref(q, kd, vd, r2t, idx, seq)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
