"""layers/parallel.py: how a CPU tensor-parallel group shares the cores out among its ranks."""

import pytest

from lightllm.layers.parallel import cpu_threads_per_rank


@pytest.mark.parametrize(
    "world, cores, omp, want",
    [
        (2, 2, None, 1),  # two ranks on two cores: one thread each, not two spinning per rank
        (2, 16, None, 8),
        (4, 2, None, 1),  # more ranks than cores: still one
        (3, None, None, 1),  # os.cpu_count() unknown
        (1, 16, None, None),  # one rank: torch's own choice
        (2, 16, "4", None),  # the user's OMP_NUM_THREADS wins
    ],
)
def test_cpu_threads_per_rank(world, cores, omp, want):
    assert cpu_threads_per_rank(world, cores, omp) == want
