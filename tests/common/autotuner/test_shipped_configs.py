"""The configs shipped in the package: every file reads with the store's own checks, under a declared kernel."""

from pathlib import Path

from lightllm.common.autotuner import AutotuneKernelType, store, tuner

SHIPPED = Path(store.__file__).resolve().parent / "configs"  # the package's own (tests' fixtures isolate the root)


def test_every_shipped_file_reads_and_names_a_declared_kernel():
    import lightllm.kernels.attention.decode.fa3  # noqa: F401  (declares the tuned kernels)
    import lightllm.kernels.attention.decode.flash_decode  # noqa: F401
    import lightllm.kernels.attention.prefill.context_attention  # noqa: F401
    import lightllm.kernels.activation  # noqa: F401
    import lightllm.kernels.gates  # noqa: F401
    import lightllm.kernels.linear_attention.gated_delta_decode  # noqa: F401
    import lightllm.kernels.linear.small_m_linear  # noqa: F401
    import lightllm.kernels.norm.add_rmsnorm  # noqa: F401
    import lightllm.kernels.norm.gated_rmsnorm  # noqa: F401
    import lightllm.kernels.norm.qk_norm_rope  # noqa: F401
    import lightllm.kernels.norm.rmsnorm  # noqa: F401

    declared = set().union(*(tuner.kernel_names(t) for t in AutotuneKernelType))
    files = list(store.iter_config_files(SHIPPED))
    assert files, f"no shipped configs under {SHIPPED}"
    for path in files:
        data = store.read_config_file(path)
        assert data is not None, path
        assert data["configs"], path
        kernel = path.parent.name
        assert kernel in declared, f"{path}: kernel folder {kernel!r} is no declared kernel ({sorted(declared)})"
        assert data["kernel"] == kernel
