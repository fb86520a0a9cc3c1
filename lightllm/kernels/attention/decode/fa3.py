"""FlashAttention-3 KV-cache decode with ``num_splits`` tuned in the DECODE_ATTENTION phase.

Providers, in order of preference (each exposes ``flash_attn_with_kvcache``):

- ``flash_attn_interface``: FlashAttention's Hopper build (paged KV);
- ``sgl_kernel.flash_attn``: sgl-kernel's build (paged KV);
- ``fa3_fwd_interface``: the ``fa3-fwd`` wheel (split-KV and ``cache_batch_idx``; paged KV compiled out).

KV layouts over the engine's cache:

- ``"paged"``: page size 1. The token pool ``[tokens, kv_heads, D]`` is seen as ``[tokens, 1, kv_heads, D]``
  and ``page_table`` rows are ``req_to_token[b_req_idx, :max_len_in_batch]``: the width is the launch's
  max length (the graph's maximum when captured, the real one otherwise).
- ``"slots"``: request slot ``r`` owns tokens ``r * max_len + [0, max_len)`` (``KVCacheManager(...,
  contiguous_slots=True)``); the pool is seen as ``[max_reqs, max_len, kv_heads, D]`` and ``b_req_idx`` is
  ``cache_batch_idx``. For providers without paged KV.

Importing this module never fails; :func:`fa3_unusable` says why FA3 can't run (start-up refuses an explicit fa3
with its line, before any weight loads), and :func:`require_fa3` raises the same line when FA3 can't be used.
"""

import importlib
import importlib.metadata
import logging
import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable, Optional, Tuple

import torch

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.attention.decode.tuning import (
    decode_attn_autotune_seq_lens,
    decode_attn_run_key_distance,
    decode_attn_run_key_lens,
)

logger = logging.getLogger(__name__)

SPLIT_CANDIDATES = (1, 2, 4, 8, 16, 32)  # 0, FA3's own heuristic, is the launcher default: always timed
# FA3's heuristic is within a few % of the best fixed split almost everywhere, and `minimax_loss` froze a split 10 %
# slower than it (docs/decode_attention.md): a split must never lose to it. Such small margins don't interpolate
# between ladder lengths 4x apart, so 1/4 of the tuning length is timed too (8K at 32K).
FA3_CHOICE_RULE = "never_slower_than_default"
FA3_LADDER_DIVISORS = (2, 4, 8, 32)
INSTALL_HINT = (
    "install FlashAttention-3 for Hopper: `pip install fa3-fwd` (forward-only wheel), FlashAttention's "
    "hopper build (`flash_attn_interface`), or `sgl-kernel`"
)


@dataclass(frozen=True)
class FA3Provider:
    name: str
    version: str
    paged: bool  # accepts page_table
    split: bool  # honours num_splits > 1
    fn: Callable
    fp16: bool = True  # runs float16 (every build runs bfloat16)

    def describe(self) -> str:
        caps = ", ".join(f"{k}={'yes' if getattr(self, k) else 'no'}" for k in ("paged", "split", "fp16"))
        return f"{self.name} {self.version} ({caps})"

    def dtype_problem(self, dtype: torch.dtype) -> Optional[str]:
        """Why this build can't run a model of ``dtype``, or None when it can."""
        if dtype not in (torch.bfloat16, torch.float16):
            return f"FA3 runs bfloat16/float16 models, got {dtype}"
        if dtype == torch.float16 and not self.fp16:
            return f"{self.name} {self.version} was built without float16"
        return None


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _try(module: str) -> Optional[object]:
    try:
        return importlib.import_module(module)
    except Exception:  # ImportError, or a broken build failing to load its extension
        return None


def _probe_flash_attn_interface() -> Optional[FA3Provider]:
    mod = _try("flash_attn_interface")
    if mod is None or not hasattr(mod, "flash_attn_with_kvcache"):
        return None
    version = _version("flash_attn_3", "flash-attn-3", "flash_attn")
    return FA3Provider("flash_attn_interface", version, True, True, mod.flash_attn_with_kvcache)


def _probe_sgl_kernel() -> Optional[FA3Provider]:
    mod = _try("sgl_kernel.flash_attn")
    if mod is None or not hasattr(mod, "flash_attn_with_kvcache"):
        return None
    return FA3Provider("sgl_kernel.flash_attn", _version("sgl-kernel", "sgl_kernel"), True, True,
                       mod.flash_attn_with_kvcache)  # fmt: skip


def _probe_fa3_fwd() -> Optional[FA3Provider]:
    mod = _try("fa3_fwd_interface")
    if mod is None or not hasattr(mod, "flash_attn_with_kvcache"):
        return None
    config = _try("fa3_fwd_config")
    flags = getattr(config, "CONFIG", {}).get("build_flags", {}) if config is not None else {}
    paged = not flags.get("FLASHATTENTION_DISABLE_PAGEDKV", True)
    split = not flags.get("FLASHATTENTION_DISABLE_SPLIT", False)
    fp16 = not flags.get("FLASHATTENTION_DISABLE_FP16", False)
    return FA3Provider("fa3_fwd_interface", _version("fa3-fwd", "fa3_fwd"), paged, split, mod.flash_attn_with_kvcache,
                       fp16)  # fmt: skip


_PROBES = (_probe_flash_attn_interface, _probe_sgl_kernel, _probe_fa3_fwd)


@lru_cache(maxsize=None)
def find_fa3_provider() -> Optional[FA3Provider]:
    """The first usable provider, or None. Cached: call ``find_fa3_provider.cache_clear()`` after installs."""
    for probe in _PROBES:
        provider = probe()
        if provider is not None:
            logger.info("FA3 provider: %s", provider.describe())
            return provider
    return None


def is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@dataclass(frozen=True)
class FA3Unusable:
    """Why FA3 can't run: ``reason`` (what ``auto`` logs) and ``fix``, what the user can do (``{flag}``: the flag
    set to fa3)."""

    reason: str
    fix: str = "use {flag} triton"

    def error(self, flag: str) -> str:
        """The one line that stops start-up for ``flag`` set to fa3."""
        return f"{flag} fa3: {self.reason}; {self.fix.format(flag=flag)}"


def fa3_unusable(device, kv_type: str = "None", dtype: Optional[torch.dtype] = None) -> Optional[FA3Unusable]:
    """Why FA3 can't run on ``device`` with ``--llm_kv_type kv_type`` for a model of ``dtype`` (None: not known yet,
    not checked), or None when it can. The one rule behind ``auto``'s choice, the start-up check of an explicit fa3
    and :func:`require_fa3`. The user's own flags come first, then the GPU (no install makes another GPU run FA3),
    then the provider and the dtypes it runs."""
    device = torch.device(device)
    if kv_type != "None":
        return FA3Unusable(f"FA3 reads no quantized KV cache (--llm_kv_type {kv_type})",
                           "use --llm_kv_type None or {flag} triton")  # fmt: skip
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    if not on_gpu or not is_hopper(device):
        found = torch.cuda.get_device_name(device) if on_gpu else "no GPU"
        return FA3Unusable(f"FA3 needs a Hopper GPU (sm90, H100/H200), found {found}")
    provider = find_fa3_provider()
    if provider is None:
        return FA3Unusable("no FlashAttention-3 provider found", INSTALL_HINT)
    why = provider.dtype_problem(dtype) if dtype is not None else None
    return FA3Unusable(why) if why is not None else None


def require_fa3(device=None, flag: str = "--llm_decode_att_backend") -> FA3Provider:
    """The provider to use on ``device`` (default cuda); ``RuntimeError`` with :func:`fa3_unusable`'s line for
    ``flag`` when FA3 can't run there. The backend's last guard: start-up refuses the same (``check_fa3_flags``)."""
    problem = fa3_unusable(device if device is not None else "cuda")
    if problem is not None:
        raise RuntimeError(problem.error(flag))
    return find_fa3_provider()


# ---- tuned launcher ---------------------------------------------------------------------------------------


def _configs(provider):
    # Not pruned by length: the candidates of a static key must be the same at every launch, since configs
    # read from a file are checked against them (one tuned at 4K must stay valid for a 512-token launch).
    return [{"num_splits": s} for s in SPLIT_CANDIDATES] if provider.split else [{"num_splits": 1}]


def _static_key(q, k_cache, page_table, causal, window, softcap, provider):
    return {
        "q_dtype": str(q.dtype),
        "kv_dtype": str(k_cache.dtype),
        "q_heads": q.shape[2],
        "kv_heads": k_cache.shape[2],
        "head_dim": q.shape[3],
        "page_size": k_cache.shape[1] if page_table is not None else 0,  # 0: contiguous request slots
        "causal": bool(causal),
        "window": list(window),
        "softcap": float(softcap),
        "provider": f"{provider.name}=={provider.version}",
    }


def _run_key(q, max_len_in_batch):
    return (q.shape[0], q.shape[1], *decode_attn_run_key_lens(max_len_in_batch))


def _representative_batches(named: dict) -> list:
    """The caller's batch with every request at each tuning length, over the existing cache (no new KV).

    Paged: a fresh page table over the pool (indices modulo its size), as wide as the launch's max length.
    Slots: each request's own row, at most its capacity."""
    q, k_cache, width = named["q"], named["k_cache"], named["max_len_in_batch"]
    batch = q.shape[0]
    lens = decode_attn_autotune_seq_lens(width, FA3_LADDER_DIVISORS)  # capped at the launch's max length
    if named["page_table"] is not None:
        pool = k_cache.shape[0]
        table = (torch.arange(batch * width, device=q.device, dtype=torch.int64) % pool).to(torch.int32)
        table = table.view(batch, width)
    else:
        capacity = k_cache.shape[1]
        if lens[0] > capacity:
            logger.warning("FA3 tuning length %d is over the slot capacity %d: tuning at %d", lens[0], capacity,
                           capacity)  # fmt: skip
        lens = sorted({min(n, capacity) for n in lens}, reverse=True)
        table = None
    seqlens = [torch.full((batch,), n, device=q.device, dtype=torch.int32) for n in lens]
    return [{**named, "page_table": table, "cache_seqlens": s} for s in seqlens]


@autotune(
    kernel_name="fa3_decode",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    run_key_distance_func=partial(decode_attn_run_key_distance, prefix=2),  # (batch, q_len, length[, floor])
    kernel_type=AutotuneKernelType.DECODE_ATTENTION,
    rebuild_input_func=_representative_batches,
    choice_rule=FA3_CHOICE_RULE,
)
def _launch_fa3_decode(
    q, k_cache, v_cache, page_table, cache_batch_idx, cache_seqlens, max_len_in_batch, sm_scale, causal,
    window, softcap, provider, run_config=None,
):  # fmt: skip
    """One provider call; ``q`` is ``[batch, q_len, q_heads, D]``. ``run_config=None``: FA3's split heuristic."""
    num_splits = 0 if run_config is None else run_config["num_splits"]
    return provider.fn(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, page_table=page_table,
        softmax_scale=sm_scale, causal=causal, window_size=window, softcap=softcap, num_splits=num_splits,
    )  # fmt: skip


# ---- public API -------------------------------------------------------------------------------------------


class FA3DecodePlan:
    """FA3 decode attention of one step, made from shapes and the pool before any layer runs: provider and layout
    chosen, arguments checked and the page table gathered once; the tuned config is resolved at the first
    :meth:`run`. Every layer's ``q`` and caches must have the planned shapes and dtype (``run`` checks them).

    Args: ``q_shape`` (``[batch, q_heads, D]`` or ``[batch, q_len, q_heads, D]``) and ``q_dtype`` for ``q``;
    ``k_cache``/``v_cache`` any layer's (all share one shape); the rest as :func:`fa3_decode_attention`.
    """

    def __init__(
        self, q_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, layout=None,
        sm_scale=None, causal=True, window=(-1, -1), softcap=0.0, provider=None, run_config=None,
    ):  # fmt: skip
        provider = provider or require_fa3(k_cache.device)
        layout = layout or ("paged" if provider.paged else "slots")
        q_shape = torch.Size(q_shape)
        q4_shape = q_shape[:1] + (1,) + q_shape[1:] if len(q_shape) == 3 else q_shape
        _check(q4_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, layout,
               provider)  # fmt: skip
        self.page_table, self.batch_idx, self.slot_shape = pool_rows(layout, req_to_token, b_req_idx, max_len_in_batch)
        self.inputs = PlannedInputs(
            "fa3 decode attention", q=(q_shape, q_dtype), k_cache=(k_cache.shape, k_cache.dtype)
        )
        self.b_seq_len, self.max_len_in_batch = b_seq_len, int(max_len_in_batch)
        self.sm_scale = float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q_shape[-1]))
        self.causal, self.window, self.softcap, self.provider = bool(causal), tuple(window), float(softcap), provider
        self._tuned = _launch_fa3_decode.plan(run_config=run_config)

    def run(self, q, k_cache, v_cache) -> torch.Tensor:
        self.inputs.check((q.shape, q.dtype), (k_cache.shape, k_cache.dtype))
        q4 = q.unsqueeze(1) if q.dim() == 3 else q
        k4, v4 = pool_views(k_cache, v_cache, self.slot_shape)
        out = self._tuned.run(q4, k4, v4, self.page_table, self.batch_idx, self.b_seq_len, self.max_len_in_batch,
                              self.sm_scale, self.causal, self.window, self.softcap, self.provider)  # fmt: skip
        return out.squeeze(1) if q.dim() == 3 else out


def fa3_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_seq_len: torch.Tensor,
    max_len_in_batch: int,
    layout: Optional[str] = None,
    sm_scale: Optional[float] = None,
    causal: bool = True,
    window: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    provider: Optional[FA3Provider] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """Decode attention through FlashAttention-3.

    Args:
        q: ``[batch, q_heads, D]`` or ``[batch, q_len, q_heads, D]`` (several tokens per request, e.g. MTP
            verify; causal aligns them to the end of each request's KV).
        k_cache, v_cache: the layer's token pool ``[tokens, kv_heads, D]`` (q's dtype).
        req_to_token, b_req_idx, b_seq_len: as for :func:`gqa_decode_attention`; ``b_seq_len`` counts the new
            tokens, already written to the cache.
        max_len_in_batch: the most the launch must serve (the graph's maximum when captured).
        layout: ``"paged"`` or ``"slots"`` (see the module doc); default: paged when the provider can.
    Returns:
        Output of q's shape and dtype. Every layer of a step: :class:`FA3DecodePlan` checks and gathers once.
    """
    if q.device != k_cache.device:
        raise ValueError(f"fa3 decode attention: q expected k_cache's device {k_cache.device}, got {q.device}")
    plan = FA3DecodePlan(q.shape, q.dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch,
                         layout, sm_scale, causal, window, softcap, provider, run_config)  # fmt: skip
    return plan.run(q, k_cache, v_cache)


def _check(q4_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, layout,
           provider):  # fmt: skip
    owner = "fa3 decode attention"
    if len(q4_shape) != 4 or q_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{owner}: q expected a [batch, (q_len,) q_heads, head_dim] float16/bfloat16 tensor, got "
                         f"{tuple(q4_shape)} {q_dtype}")  # fmt: skip
    batch, _, q_heads, head_dim = q4_shape
    check_pool(owner, q_heads, head_dim, q_dtype, k_cache, v_cache, req_to_token, layout, provider)
    for name, t in (("b_req_idx", b_req_idx), ("b_seq_len", b_seq_len)):
        if t.shape != (batch,) or t.dtype != torch.int32:
            raise ValueError(f"{owner}: {name} expected an int32 [{batch}] tensor, got {tuple(t.shape)} {t.dtype}")
    if layout == "paged" and not 0 < max_len_in_batch <= req_to_token.shape[1]:
        raise ValueError(f"{owner}: max_len_in_batch expected a length in [1, {req_to_token.shape[1]}], got "
                         f"{max_len_in_batch}")  # fmt: skip


def check_pool(owner, q_heads, head_dim, q_dtype, k_cache, v_cache, req_to_token, layout, provider) -> None:
    """What every FA3 call over the engine's pool needs (decode and prefill): the layout the provider can read,
    caches of q's dtype and head dim, whole KV groups, an int32 token table the slots layout covers exactly."""

    def fail(name, expected, got):
        raise ValueError(f"{owner}: {name} expected {expected}, got {got}")

    if layout not in ("paged", "slots"):
        fail("layout", "'paged' or 'slots'", repr(layout))
    if layout == "paged" and not provider.paged:
        fail("layout", f"'slots' ({provider.name} {provider.version} has no paged KV)", "'paged'")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 3 or t.dtype != q_dtype or t.shape[2] != head_dim or t.device != k_cache.device:
            fail(name, f"a [tokens, kv_heads, {head_dim}] {q_dtype} tensor on {k_cache.device}", f"{tuple(t.shape)}")
    if q_heads % k_cache.shape[1]:
        fail("kv_heads", f"a divisor of q_heads ({q_heads})", k_cache.shape[1])
    if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2:
        fail("req_to_token", "an int32 [max_reqs, max_len] tensor", f"{req_to_token.dtype} {tuple(req_to_token.shape)}")
    if layout == "slots" and k_cache.shape[0] != req_to_token.numel():
        fail("k_cache", f"{req_to_token.numel()} tokens (max_reqs * max_len) for the slots layout", k_cache.shape[0])


def pool_rows(layout: str, req_to_token, b_req_idx, max_len_in_batch: int):
    """How FA3 finds each request's KV, gathered once per step: ``(page_table, cache_batch_idx, slot_shape)``; paged,
    the requests' ``req_to_token`` rows up to ``max_len_in_batch`` (page size 1); slots, each request's fixed row of
    the pool (``slot_shape`` for ``pool_views``)."""
    if layout == "paged":
        return req_to_token[b_req_idx.long(), :max_len_in_batch], None, None
    return None, b_req_idx, req_to_token.shape


def pool_views(k_cache, v_cache, slot_shape) -> Tuple[torch.Tensor, torch.Tensor]:
    """The caches as FA3 reads them: ``[tokens, 1, kv_heads, D]`` pages of one token (``slot_shape`` None: paged),
    else ``[max_reqs, max_len, kv_heads, D]`` rows of request slots."""
    if slot_shape is None:
        return k_cache.unsqueeze(1), v_cache.unsqueeze(1)
    return k_cache.view(*slot_shape, *k_cache.shape[1:]), v_cache.view(*slot_shape, *v_cache.shape[1:])
