import pytest
import torch

from lightllm.common.kv_cache import Int4KVPool, Int8KVPool, KVPool, tokens_for_budget


def _storage_bytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_kv_pool_shapes(dtype):
    pool = KVPool(num_tokens=10, num_layers=3, kv_heads=2, head_dim=64, dtype=dtype, device="cpu")
    for layer in range(3):
        for side in (pool.k[layer], pool.v[layer]):
            assert side.shape == (10, 2, 64) and side.dtype == dtype and side.is_contiguous()
    assert pool.k[0].data_ptr() != pool.k[1].data_ptr() != pool.v[1].data_ptr()
    assert pool.bytes_per_token() == 2 * 3 * 2 * 64 * pool.k.element_size()
    assert pool.bytes_per_token() * 10 == _storage_bytes(pool.k, pool.v)
    assert KVPool.token_bytes(3, 2, 64, dtype) == pool.bytes_per_token()


@pytest.mark.parametrize("group_size", [8, 32], ids=["g8", "g32"])
def test_int8_pool_shapes(group_size):
    pool = Int8KVPool(10, 3, 2, 64, "cpu", group_size=group_size)
    for layer in range(3):
        assert pool.k[layer].shape == pool.v[layer].shape == (10, 2, 64)
        assert pool.k[layer].dtype == pool.v[layer].dtype == torch.int8
        assert pool.k_scale[layer].shape == pool.v_scale[layer].shape == (10, 2, 64 // group_size)
        assert pool.k_scale[layer].dtype == pool.v_scale[layer].dtype == torch.float16
    assert pool.bytes_per_token() * 10 == _storage_bytes(pool.k, pool.v, pool.k_scale, pool.v_scale)
    assert Int8KVPool.token_bytes(3, 2, 64, group_size) == pool.bytes_per_token()


@pytest.mark.parametrize("head_dim, group_size", [(64, 8), (128, 64)], ids=["d64-g8", "d128-g64"])
def test_int4_pool_shapes(head_dim, group_size):
    pool = Int4KVPool(10, 3, 2, head_dim, "cpu", group_size=group_size)
    for layer in range(3):
        assert pool.k[layer].shape == pool.v[layer].shape == (10, 2, head_dim // 2)
        assert pool.k[layer].dtype == pool.v[layer].dtype == torch.uint8
        assert pool.k_scale[layer].shape == pool.v_scale[layer].shape == (10, 2, head_dim // group_size)
        assert pool.k_scale[layer].dtype == torch.float16
    assert pool.bytes_per_token() * 10 == _storage_bytes(pool.k, pool.v, pool.k_scale, pool.v_scale)
    assert Int4KVPool.token_bytes(3, 2, head_dim, group_size) == pool.bytes_per_token()


def test_default_group_size_is_8():
    assert Int8KVPool(4, 1, 1, 64, "cpu").group_size == Int4KVPool(4, 1, 1, 64, "cpu").group_size == 8


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: KVPool(0, 1, 1, 64, torch.float16, "cpu"), "KVPool: num_tokens expected an int >= 1, got 0"),
        (lambda: KVPool(4, 0, 1, 64, torch.float16, "cpu"), "num_layers expected an int >= 1, got 0"),
        (lambda: KVPool(4, 1, -2, 64, torch.float16, "cpu"), "kv_heads expected an int >= 1, got -2"),
        (lambda: KVPool(4, 1, 1, 64.0, torch.float16, "cpu"), "head_dim expected an int, got float"),
        (lambda: KVPool(4, 1, 1, 64, torch.int8, "cpu"), "KVPool: dtype expected one of"),
        (lambda: Int8KVPool(4, 1, 1, 64, "cpu", group_size=12), "Int8KVPool: group_size expected a divisor of"),
        (lambda: Int8KVPool(4, 1, 1, 64, "cpu", group_size=0), "group_size expected a positive int, got 0"),
        (lambda: Int4KVPool(4, 1, 1, 63, "cpu", group_size=3), "Int4KVPool: head_dim expected an even value"),
        (lambda: Int4KVPool(4, 1, 1, 64, "cpu", group_size=64), r"group_size expected a divisor of head_dim // 2"),
        (lambda: Int4KVPool(4, 1, 1, 24, "cpu", group_size=8), r"group_size expected a divisor of head_dim // 2"),
        (lambda: Int4KVPool.token_bytes(1, 1, 64, 64), r"group_size expected a divisor of head_dim // 2"),
    ],
    ids=[
        "tokens",
        "layers",
        "heads",
        "head-dim-float",
        "dtype",
        "int8-group",
        "int8-group-zero",
        "int4-odd-dim",
        "int4-group-straddles",
        "int4-group-not-dividing-half",
        "int4-token-bytes",
    ],
)
def test_bad_pool_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_tokens_for_budget():
    assert tokens_for_budget(1000, 100) == 10
    assert tokens_for_budget(1099, 100) == 10
    assert tokens_for_budget(100, 100) == 1
    with pytest.raises(ValueError, match=r"bytes_budget expected at least one token \(100 bytes\), got 99"):
        tokens_for_budget(99, 100)
    with pytest.raises(ValueError, match="bytes_per_token expected an int >= 1, got 0"):
        tokens_for_budget(1000, 0)
    with pytest.raises(ValueError, match="bytes_budget expected an int >= 0, got -5"):
        tokens_for_budget(-5, 10)
