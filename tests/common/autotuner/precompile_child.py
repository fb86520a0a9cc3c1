"""The child process of ``test_precompile_triton.py``: real Triton kernels through the compile pass on a machine
without a GPU. Started without ``TRITON_INTERPRET`` (so the kernels are ``JITFunction``s) and with an empty
``TRITON_CACHE_DIR``; a stand-in driver gives Triton an sm_90 target and a current device, so it binds and compiles
(every launch in a compile pass only compiles; nothing here launches). Prints one JSON report."""

import json

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class CompileOnlyDriver:
    """What Triton's ``JITFunction.run`` asks of a driver before it launches: the device, the stream, the target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def compiled(launcher) -> list:
    """The kernels in a ``DirectLaunch``'s Triton cache (device 0): whether each holds a cubin."""
    return [bool(k.asm.get("cubin")) for k in launcher.kernel.device_caches[0][0].values()]


def rmsnorm_through_the_tuner() -> dict:
    """The tuner's own pass (``Autotuner._compile_ahead``) over RMSNorm's default and candidates, twice."""
    from lightllm.kernels.norm.rmsnorm import _RMSNORM, _configs, _launch_rmsnorm

    x = torch.randn(16, 4096, dtype=torch.bfloat16)
    inputs = [((x, torch.rand(4096, dtype=torch.bfloat16), 1e-6, torch.empty_like(x)), {})]
    configs = [None] + _configs(x)
    first = _launch_rmsnorm._compile_ahead(configs, inputs, lambda: None)
    again = _launch_rmsnorm._compile_ahead(configs, inputs, lambda: None)
    return {"configs": len(configs), "kernels": first.kernels, "failed": first.failed, "again": again.kernels,
            "cubins": compiled(_RMSNORM)}  # fmt: skip


def decode_attention_pass() -> dict:
    """Decode attention's two kernels (stage 1 per candidate, stage 2 per split tile) through ``compile_ahead``."""
    from lightllm.common.autotuner import precompile
    from lightllm.kernels.attention.decode import flash_decode

    batch, q_heads, kv_heads, d, length = 2, 8, 2, 128, 4096
    q = torch.randn(batch, q_heads, d, dtype=torch.bfloat16)
    k = torch.randn(batch * length, kv_heads, d, dtype=torch.bfloat16)
    r2t = torch.arange(batch * length, dtype=torch.int32).view(batch, length)
    idx = torch.arange(batch, dtype=torch.int32)
    seq = torch.full((batch,), length, dtype=torch.int32)
    out = torch.empty_like(q)

    def run(cfg):
        flash_decode.gqa_decode_attention(q, k, k, r2t, idx, seq, length, out=out, run_config=cfg)

    configs = [None] + flash_decode.split_kv_configs(q)
    first = precompile.compile_ahead(run, configs, threads=2)
    again = precompile.compile_ahead(run, configs, threads=2)
    keys = {(c or flash_decode.default_config(d))["BLOCK_N"] for c in configs}
    return {"configs": len(configs), "kernels": first.kernels, "failed": first.failed, "again": again.kernels,
            "stage1": compiled(flash_decode._STAGE1), "stage2": compiled(flash_decode._STAGE2),
            "block_ns": sorted(keys)}  # fmt: skip


if __name__ == "__main__":
    driver.set_active(CompileOnlyDriver())
    print(json.dumps({"rmsnorm": rmsnorm_through_the_tuner(), "decode": decode_attention_pass()}))
