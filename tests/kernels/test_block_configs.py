"""The candidate spaces and defaults the row- and head-tiled kernels share (kernels/block_configs.py), pinned."""

import pytest

from lightllm.kernels.block_configs import head_block_configs, head_block_default, row_chunk_configs, row_chunk_default


def test_row_chunks_cap_at_the_row_and_leave_out_a_whole_row_past_16384():
    assert row_chunk_configs(300) == [{"BLOCK_N": 256, "num_warps": w} for w in (1, 2, 4, 8)] + [
        {"BLOCK_N": 512, "num_warps": w} for w in (1, 2, 4, 8, 16)
    ]
    assert sorted({c["BLOCK_N"] for c in row_chunk_configs(40000)}) == [256, 1024, 4096]
    assert sorted({c["BLOCK_N"] for c in row_chunk_configs(4096)}) == [256, 1024, 4096]
    assert row_chunk_default(4096) == {"BLOCK_N": 4096, "num_warps": 16}
    assert row_chunk_default(40000) == {"BLOCK_N": 16384, "num_warps": 16}
    assert row_chunk_default(100) == {"BLOCK_N": 128, "num_warps": 1}


@pytest.mark.parametrize("heads, blocks", [(1, [1]), (3, [1, 2, 4]), (40, [1, 2, 4, 8, 16])])
def test_head_blocks_stay_within_the_row(heads, blocks):
    assert head_block_configs(heads) == [{"BLOCK_H": b, "num_warps": w} for b in blocks for w in (1, 2, 4, 8)]
    assert head_block_default(heads) == {"BLOCK_H": min(4, blocks[-1]), "num_warps": 4}


def test_each_kernel_searches_its_tiling_space():
    import torch

    from lightllm.kernels import gates
    from lightllm.kernels.norm import add_rmsnorm, gated_rmsnorm, qk_norm_rope, rmsnorm

    x = torch.empty(2, 3, 1000)
    assert rmsnorm._launch_rmsnorm.configs_gen_func(x) == row_chunk_configs(1000)
    assert add_rmsnorm._launch_add_rmsnorm.configs_gen_func(x[0]) == row_chunk_configs(1000)
    assert gates._launch_sigmoid_gate_mul.configs_gen_func(x) == head_block_configs(3)
    assert gated_rmsnorm._launch_gated_rmsnorm.configs_gen_func(x) == head_block_configs(3)
    assert qk_norm_rope._launch_qk_norm_rope.configs_gen_func(x, x[:, :2]) == head_block_configs(5)
