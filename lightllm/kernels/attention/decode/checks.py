"""Argument checks the Triton decode kernels (plain GQA and MTP diverse) share. Each takes the caller's
``fail(name, expected, got)``, so every message keeps its kernel's prefix."""

import torch


def check_q_device(label: str, q, k_cache) -> None:
    if q.device != k_cache.device:
        raise ValueError(f"{label}: q expected k_cache's device {k_cache.device}, got {q.device}")


def check_head_dim(fail, head_dim: int, head_dims: tuple) -> None:
    if head_dim not in head_dims:
        fail("head_dim", f"one of {head_dims}", head_dim)


def check_kv_pair(fail, k_cache, v_cache, last_dim: int, kv_dtype) -> None:
    """``k_cache``/``v_cache``: ``[pool_tokens, kv_heads, last_dim]`` of ``kv_dtype`` on k_cache's device."""
    device = k_cache.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 3 or t.shape[2] != last_dim or t.dtype != kv_dtype or t.stride(-1) != 1:
            fail(name, f"a [pool_tokens, kv_heads, {last_dim}] {kv_dtype} tensor", f"{tuple(t.shape)} {t.dtype}")
        if t.device != device:
            fail(name, f"device {device}", t.device)


def check_request_rows(fail, batch: int, device, b_req_idx, b_seq_len) -> None:
    for name, t in (("b_req_idx", b_req_idx), ("b_seq_len", b_seq_len)):
        if t.shape != (batch,) or t.dtype != torch.int32 or t.device != device:
            fail(name, f"an int32 [{batch}] tensor on {device}", f"{tuple(t.shape)} {t.dtype} on {t.device}")


def check_run_q_out(label: str, q, out) -> None:
    """What a plan's ``run`` checks beyond the planned shapes: q's last dim contiguous, ``out`` (if given) like q."""
    if q.stride(-1) != 1:
        raise ValueError(f"{label}: q expected a contiguous last dim, got strides {q.stride()}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"{label}: out expected a {tuple(q.shape)} {q.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")  # fmt: skip
