"""Host-to-device helpers: the same values as ``torch.tensor``, from lists, nested lists and numpy arrays."""

import numpy as np
import pytest
import torch

from lightllm.common.transfer import host_tensor, host_to_device, tensor_to_device

DTYPES = [torch.int64, torch.int32, torch.float32, torch.float64, torch.bool, torch.bfloat16]
VALUES = ([3, 0, 7, 1], [], [1.5, -2.0, 0.0], [[1, 2], [3, 4]], np.array([5, 6, 9], dtype=np.int64),
          np.arange(6, dtype=np.int64).reshape(2, 3))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_tensor_is_torch_tensor(dtype):
    for values in VALUES:
        want = torch.tensor(values, dtype=dtype)
        got = host_tensor(values, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), values


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_to_device_on_cpu_is_torch_tensor(dtype):
    for values in VALUES:
        got = host_to_device(values, dtype, torch.device("cpu"))
        assert torch.equal(got, torch.tensor(values, dtype=dtype)), values


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_to_device_on_gpu_takes_lists_and_numpy_arrays(dtype):
    dev = torch.device("cuda")
    for values in VALUES:
        got = host_to_device(values, dtype, dev)
        assert got.is_cuda and torch.equal(got.cpu(), torch.tensor(values, dtype=dtype)), values
        moved = tensor_to_device(torch.tensor(values, dtype=dtype), dev)
        assert moved.is_cuda and torch.equal(moved.cpu(), torch.tensor(values, dtype=dtype)), values
