import pytest
import triton

from lightllm.kernels.launch_math import cdiv, next_power_of_2


@pytest.mark.parametrize("b", [1, 2, 7, 16, 128])
def test_same_as_tritons_host_helpers(b):
    for a in range(0, 3000):
        assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in range(1, 70000, 7):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert [next_power_of_2(n) for n in (1, 2, 3, 4, 5, 4096, 4097)] == [1, 2, 4, 4, 8, 4096, 8192]
