"""The configs shipped in the package: every file reads with the store's own checks, under a declared kernel."""

import importlib
import pkgutil
from pathlib import Path

from lightllm.common.autotuner import AutotuneKernelType, store, tuner

SHIPPED = Path(store.__file__).resolve().parent / "configs"  # the package's own (tests' fixtures isolate the root)


def test_every_shipped_file_reads_and_names_a_declared_kernel():
    import lightllm.kernels

    for module in pkgutil.walk_packages(lightllm.kernels.__path__, "lightllm.kernels."):
        importlib.import_module(module.name)  # each declares its tuned kernels as it is imported

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
