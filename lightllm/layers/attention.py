"""Attention backends: write the new K/V into the pool, then attend (prefill or decode).

- ``triton`` (GPU): Triton context attention for prefill (over a cached prefix too: chunked prefill); Triton GQA
  flash decode (bf16/fp16, INT8, INT4 KV) for one query token per request, and the MTP diverse kernel for
  ``q_len > 1`` (MTP verify; bf16/fp16 KV).
- ``fa3`` (Hopper GPU): FlashAttention-3 decode (bf16/fp16 KV, any ``q_len``).

Prefill (``--llm_prefill_att_backend``): ``triton`` (Triton context attention) or ``fa3`` (FlashAttention-3 over the
pool, ``prefill/fa3_prefill.py``: unquantized KV; with a provider without paged KV the pool takes the slots layout,
which turns the prefix cache off).

- On a CPU device the triton backend runs the torch references, so the engine runs (slowly) without a GPU. An
  explicit fa3 needs a Hopper GPU, a provider, ``--llm_kv_type None`` and a dtype the provider runs: start-up stops
  otherwise, before any weight loads (``check_fa3_flags``; ``fa3_unusable`` is the one rule, ``require_fa3`` the
  backend's last guard). CPU tests run the fa3 backend's GPU path with a stand-in provider (``require_fa3`` patched).
- ``auto`` (the flags' value, resolved at start-up by ``pick_decode_backend`` and ``pick_prefill_backend``, once the
  model's dtype is known): decode fa3 where it can run, prefill fa3 where decode runs it with a provider without
  paged KV (the path measured on the H200); else triton.
"""

import logging
from typing import Optional

import torch

from lightllm.common.kv_cache import Int4KVPool, Int8KVPool, KVPool, dequantize_int4_ref, dequantize_int8_ref
from lightllm.layers.infer_state import InferState
from lightllm.kernels import kv_cache_write as kvw
from lightllm.kernels.kv_cache_read import gather_dequant_kv, launch_gather_dequant
from lightllm.kernels.attention.decode.flash_decode import GQADecodePlan
from lightllm.kernels.attention.decode.reference import decode_attention_ref
from lightllm.kernels.attention.prefill.context_attention import (
    CachedPrefix,
    ContextAttentionPlan,
    context_attention_ref,
)

logger = logging.getLogger(__name__)

DECODE_BACKENDS = ("triton", "fa3")
DECODE_BACKEND_CHOICES = ("auto", *DECODE_BACKENDS)  # what --llm_decode_att_backend takes
PREFILL_BACKENDS = ("triton", "fa3")
PREFILL_BACKEND_CHOICES = ("auto", *PREFILL_BACKENDS)  # what --llm_prefill_att_backend takes
KV_TYPES = ("None", "int8kv", "int4kv")
GPU_HEAD_DIMS = (64, 128, 256)  # what the Triton prefill and decode kernels compile for


def check_head_dim(head_dim: int, device: torch.device) -> None:
    """Fail at start-up, before any weight is loaded, for a head_dim the GPU kernels don't take."""
    if device.type == "cuda" and head_dim not in GPU_HEAD_DIMS:
        raise ValueError(f"model head_dim expected one of {GPU_HEAD_DIMS} on a GPU, got {head_dim} "
                         "(the CPU device runs any head_dim through the torch references)")  # fmt: skip


def pick_decode_backend(requested: str, device: torch.device, kv_type: str, dtype: torch.dtype) -> str:
    """``requested`` itself, or for ``auto``: fa3 on a Hopper GPU with an FA3 provider installed that runs the
    model's dtype and an unquantized KV cache (the only one FA3 reads), else triton. The choice is logged with its
    reason."""
    if requested != "auto":
        return requested
    from lightllm.kernels.attention.decode.fa3 import fa3_unusable, find_fa3_provider

    problem = fa3_unusable(device, kv_type, dtype)
    if problem is None:
        logger.info("--llm_decode_att_backend auto -> fa3 (Hopper GPU, %s)", find_fa3_provider().name)
        return "fa3"
    logger.info("--llm_decode_att_backend auto -> triton (%s)", problem.reason)
    return "triton"


def pick_prefill_backend(requested: str, decode_backend: str) -> str:
    """``requested`` itself, or for ``auto``: fa3 where decode runs FA3 with a provider without paged KV (the same
    provider, dtype and KV layout; on its own, FA3 prefill with such a provider would change the layout to fixed
    request rows, which turns the prefix cache off; a paged provider's prefill path has not run on a GPU yet), else
    triton. The choice is logged with its reason."""
    if requested != "auto":
        return requested
    if decode_backend == "fa3":
        from lightllm.kernels.attention.decode.fa3 import find_fa3_provider

        provider = find_fa3_provider()
        if provider is None:  # an explicit decode fa3 with no provider: check_fa3_flags stops start-up next
            return "triton"
        if not provider.paged:
            logger.info("--llm_prefill_att_backend auto -> fa3 (FA3 decode: the same provider and KV layout)")
            return "fa3"
        # the paged-KV prefill path has run only on a CPU stand-in: a GPU must pick it explicitly until it is checked
        logger.info(
            "--llm_prefill_att_backend auto -> triton (%s has paged KV, whose FA3 prefill path has not run on "
            "a GPU yet; --llm_prefill_att_backend fa3 asks for it)",
            provider.name,
        )
        return "triton"
    logger.info("--llm_prefill_att_backend auto -> triton (FA3 decode is off; --llm_prefill_att_backend fa3 asks for "
                "FA3 prefill alone)")  # fmt: skip
    return "triton"


def check_fa3_flags(backends: dict, device: torch.device, kv_type: str, dtype: Optional[torch.dtype]) -> None:
    """One start-up error, before any weight loads, for a backend flag set to fa3 that can't run here: the line
    ``require_fa3`` would raise once the backend is built (``fa3_unusable``; ``dtype`` None: not known yet)."""
    from lightllm.kernels.attention.decode.fa3 import fa3_unusable

    flags = [flag for flag, backend in backends.items() if backend == "fa3"]
    problem = fa3_unusable(device, kv_type, dtype) if flags else None
    if problem is not None:
        raise ValueError(problem.error(flags[0]))


class AttentionBackend:
    def __init__(self, pool, decode_backend: str, device: torch.device, prefill_backend: str = "triton"):
        if decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"--llm_decode_att_backend expected one of {DECODE_BACKENDS}, got {decode_backend!r}")
        if prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"--llm_prefill_att_backend expected one of {PREFILL_BACKENDS}, got {prefill_backend!r}")
        self.pool = pool
        self.quant = "int8" if isinstance(pool, Int8KVPool) else "int4" if isinstance(pool, Int4KVPool) else "none"
        self.decode_backend = decode_backend
        self.on_gpu = device.type == "cuda"
        self.prefill_backend = prefill_backend
        backends = (("--llm_decode_att_backend", decode_backend), ("--llm_prefill_att_backend", prefill_backend))
        fa3_flags = [flag for flag, backend in backends if backend == "fa3"]
        if fa3_flags:
            if self.quant != "none":
                raise ValueError(f"{fa3_flags[0]} fa3 expected --llm_kv_type None, got a quantized KV cache")
            from lightllm.kernels.attention.decode.fa3 import require_fa3

            self.fa3_provider = require_fa3(device, fa3_flags[0])
        self._kv_write = None  # the KV write plan of the forward whose token_idx it holds (made at its first write)
        # A float pool's per-layer views, made once: a model's q/k kernel writes the new K/V through them, and
        # decode reads them (no per-layer indexing op). None for a quantized pool (``write_kv`` quantizes).
        self.kv_layers = kvw.KVLayers(pool.k, pool.v) if self.quant == "none" else None

    # ---- KV writes ----------------------------------------------------------------------------------------

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_idx: torch.Tensor) -> None:
        """On a GPU the first write of a forward (a ``token_idx`` not seen before) checks everything and plans the
        writes of the later layers, which check only their shapes (``KVWritePlan``)."""
        p = self.pool
        scales = () if self.quant == "none" else (p.k_scale[layer], p.v_scale[layer])
        if self.on_gpu:
            plan = self._kv_write
            if plan is None or plan.token_idx is not token_idx:
                group = 0 if self.quant == "none" else p.group_size
                plan = self._kv_write = kvw.KVWritePlan(self.quant, k, v, p.k[layer], p.v[layer], token_idx, *scales,
                                                        group_size=group)  # fmt: skip
            plan.run(k, v, p.k[layer], p.v[layer], *scales)
        elif self.quant == "none":
            kvw.write_kv_ref(k, v, p.k[layer], p.v[layer], token_idx)
        else:
            fn = kvw.write_kv_int8_ref if self.quant == "int8" else kvw.write_kv_int4_ref
            fn(k, v, p.k[layer], p.v[layer], *scales, token_idx, p.group_size)

    def _dequantized(self, layer: int, dtype: torch.dtype):
        p = self.pool
        if self.quant == "none":
            return p.k[layer], p.v[layer]
        deq = dequantize_int8_ref if self.quant == "int8" else dequantize_int4_ref
        return (deq(p.k[layer], p.k_scale[layer], p.group_size).to(dtype),
                deq(p.v[layer], p.v_scale[layer], p.group_size).to(dtype))  # fmt: skip

    # ---- planning: once per forward, before any layer runs -------------------------------------------------

    def plan_prefill(self, state: InferState, q_heads: int, q_dtype: torch.dtype):
        """Plan prefill attention for every layer of this forward from the batch metadata and the pool's shapes
        (argument checks once, the tuned config at the first layer's run); sets and returns ``state.attn_plan``.
        The CPU references need no plan (None)."""
        plan = None
        if self.on_gpu:
            tokens, p = state.out_token_idx.shape[0], self.pool
            shapes = ((tokens, q_heads, p.head_dim), (tokens, p.kv_heads, p.head_dim), q_dtype, state.b_q_start,
                      state.b_q_len, state.max_q_len)  # fmt: skip
            if self.prefill_backend == "fa3":
                from lightllm.kernels.attention.prefill.fa3_prefill import FA3PrefillPlan

                plan = FA3PrefillPlan(shapes[0], q_dtype, p.k[0], p.v[0], state.req_to_token, state.b_req_idx,
                                      state.b_seq_len, state.b_q_start, state.b_q_len, state.max_q_len,
                                      state.max_len_in_batch, provider=self.fa3_provider)  # fmt: skip
            elif not state.max_prefix_len:
                plan = ContextAttentionPlan(*shapes, reuse_outputs=True)
            elif self.quant == "none":
                plan = ContextAttentionPlan(*shapes, prefix=_prefix_of(state), reuse_outputs=True)
            else:
                plan = _QuantPrefixPlan(state, p.num_tokens, shapes)
        state.attn_plan = plan
        return plan

    def plan_decode(self, state: InferState, q_heads: int, q_dtype: torch.dtype):
        """Plan decode attention for every layer of this forward (all share the batch and the pool's shapes):
        checks, FA3's page table and the tuned config (resolved at the first layer's run, which may search there
        inside the DECODE_ATTENTION warm-up); sets and returns ``state.attn_plan``. CPU: None."""
        plan = None
        if self.on_gpu:
            plan = self._plan_decode(state, q_heads, q_dtype)
        state.attn_plan = plan
        return plan

    def _plan_decode(self, state: InferState, q_heads: int, q_dtype: torch.dtype):
        p, req_to_token, args = self.pool, state.req_to_token, (state.b_req_idx, state.b_seq_len, state.launch_max_len)
        batch, q_len = state.batch_size, state.q_len
        q_shape = (batch, q_heads, p.head_dim) if q_len == 1 else (batch, q_len, q_heads, p.head_dim)
        if self.decode_backend == "fa3":
            from lightllm.kernels.attention.decode.fa3 import FA3DecodePlan

            return FA3DecodePlan(q_shape, q_dtype, p.k[0], p.v[0], req_to_token, *args, provider=self.fa3_provider)
        if q_len != 1:
            if self.quant != "none":
                raise NotImplementedError(f"Triton MTP verify attention (q_len {q_len}) reads bf16/fp16 KV, got "
                                          f"{self.quant} KV (--llm_kv_type {self.quant}kv); MTP needs --llm_kv_type "
                                          "None")  # fmt: skip
            from lightllm.kernels.attention.decode.mtp_diverse import MTPDiverseDecodePlan

            return MTPDiverseDecodePlan(q_shape, q_dtype, p.k[0], p.v[0], req_to_token, *args, reuse_outputs=True)
        if self.quant == "none":
            return GQADecodePlan("none", q_shape, q_dtype, p.k[0], p.v[0], req_to_token, *args, reuse_outputs=True)
        return GQADecodePlan(self.quant, q_shape, q_dtype, p.k[0], p.v[0], req_to_token, *args, p.k_scale[0],
                             p.v_scale[0], quant_group=p.group_size, reuse_outputs=True)  # fmt: skip

    def _plan_of(self, state: InferState, kind: str):
        plan = state.attn_plan
        if plan is None:
            raise RuntimeError(f"attention {kind} on a GPU expected a plan: call plan_{kind}(state, ...) once per "
                               "forward, before the first layer")  # fmt: skip
        return plan

    # ---- attention: every layer runs the forward's plan ---------------------------------------------------

    def prefill(self, layer: int, q, k, v, state: InferState) -> torch.Tensor:
        """Causal attention of each request's packed new tokens over its cached prefix (chunked prefill, read from
        the pool; a quantized pool's prefix dequantized) and over themselves. The new tokens' own K/V are used
        as computed, unquantized (FA3: read back from the pool, where the layer wrote them). On a GPU with Triton
        the output is the forward's one buffer: the next layer's call overwrites it."""
        if self.on_gpu and self.prefill_backend == "fa3":
            return self._plan_of(state, "prefill").run(q, self.pool.k[layer], self.pool.v[layer])
        if not state.max_prefix_len:
            if self.on_gpu:
                return self._plan_of(state, "prefill").run(q, k, v)
            return context_attention_ref(q, k, v, state.b_q_start, state.b_q_len).to(q.dtype)
        if not self.on_gpu:
            k_cache, v_cache = self._dequantized(layer, q.dtype)
            return context_attention_ref(q, k, v, state.b_q_start, state.b_q_len, prefix=_prefix_of(state),
                                         k_cache=k_cache, v_cache=v_cache).to(q.dtype)  # fmt: skip
        plan, p = self._plan_of(state, "prefill"), self.pool
        if self.quant == "none":
            return plan.run(q, k, v, k_cache=p.k[layer], v_cache=p.v[layer])
        return plan.run(q, k, v, p, layer)

    def decode(self, layer: int, q: torch.Tensor, state: InferState) -> torch.Tensor:
        """``q [batch * q_len, q_heads, D]`` against each request's cached KV (new tokens already written). With
        Triton on a GPU the output is the forward's one buffer: the next layer's call overwrites it."""
        q_len = state.q_len
        q_b = q.view(state.batch_size, q_len, *q.shape[1:]) if q_len > 1 else q
        if not self.on_gpu:
            k, v = self._dequantized(layer, q.dtype)
            out = decode_attention_ref(q_b, k, v, state.req_to_token, state.b_req_idx, state.b_seq_len)
            return out.to(q.dtype).reshape(q.shape)
        plan, kv = self._plan_of(state, "decode"), self.kv_layers
        if kv is None:  # quantized: Triton only, one query token per request (the plan refuses more)
            p = self.pool
            return plan.run(q, p.k[layer], p.v[layer], p.k_scale[layer], p.v_scale[layer])
        if q_len > 1:  # FA3, or Triton's MTP diverse kernel
            return plan.run(q_b, kv.k[layer], kv.v[layer]).reshape(q.shape)
        return plan.run(q, kv.k[layer], kv.v[layer])  # FA3's output of one token per request is q's shape too


def _prefix_of(state: InferState) -> CachedPrefix:
    return CachedPrefix(state.req_to_token, state.b_req_idx, state.b_prefix_len)


class _QuantPrefixPlan:
    """Prefill over a quantized pool's prefix on the GPU: per layer, each request's cached tokens (``batch x
    max_prefix_len``, found once per forward) are gathered and dequantized into a scratch buffer
    (``kernels/kv_cache_read.py``, one launch for K and V), which the prefix kernel reads through a table of its own
    (row ``i`` = request ``i``)."""

    def __init__(self, state: InferState, pool_tokens: int, shapes: tuple):
        batch, width, dev = state.batch_size, state.max_prefix_len, state.b_req_idx.device
        rows = state.req_to_token[state.b_req_idx.long(), :width]
        inside = torch.arange(width, device=dev) < state.b_prefix_len[:, None]
        self.token_idx = torch.where(inside, rows, 0).long().flatten().clamp_(0, pool_tokens - 1)
        table = torch.arange(batch * width, dtype=torch.int32, device=dev).view(batch, width)
        own_rows = torch.arange(batch, dtype=torch.int32, device=dev)
        self.attn = ContextAttentionPlan(*shapes, prefix=CachedPrefix(table, own_rows, state.b_prefix_len),
                                         reuse_outputs=True)  # fmt: skip
        self._prefix = None  # the dequantized prefix (K, V), made by the first layer

    def run(self, q, k, v, pool, layer: int) -> torch.Tensor:
        quant = "int8" if isinstance(pool, Int8KVPool) else "int4"
        layer_kv = (pool.k[layer], pool.k_scale[layer], pool.v[layer], pool.v_scale[layer], self.token_idx, quant,
                    pool.group_size)  # fmt: skip
        # one gather-and-dequantize launch; its two buffers serve every layer of the forward (read before the next),
        # checked at the first layer (every layer of a pool has one shape, dtype and strides)
        if self._prefix is None:
            self._prefix = gather_dequant_kv(*layer_kv, q.dtype)
        else:
            launch_gather_dequant(*layer_kv, self._prefix)
        k_cache, v_cache = self._prefix
        return self.attn.run(q, k, v, k_cache=k_cache, v_cache=v_cache)


def make_pool(kv_type: str, num_tokens: int, num_layers: int, kv_heads: int, head_dim: int, dtype, device,
              group_size: int = 8):  # fmt: skip
    if kv_type not in KV_TYPES:
        raise ValueError(f"--llm_kv_type expected one of {KV_TYPES}, got {kv_type!r}")
    if kv_type == "None":
        return KVPool(num_tokens, num_layers, kv_heads, head_dim, dtype, device)
    cls = Int8KVPool if kv_type == "int8kv" else Int4KVPool
    return cls(num_tokens, num_layers, kv_heads, head_dim, device=device, group_size=group_size)
