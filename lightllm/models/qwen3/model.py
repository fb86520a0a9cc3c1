"""Qwen3 forward: embedding, RMSNorm, q/k norm, rotary, GQA attention over the KV cache, SwiGLU, lm_head.

Follows transformers' Qwen3 rounding steps (norms in float32 then cast, rotary tables cast to the model
dtype, softmax in float32) so the CPU float32 path matches it to float rounding.

Per layer, on a GPU: four GEMMs (fused qkv, o, fused gate/up, down: cuBLAS on the weights' ``[in, out]`` views; at
most 16 tokens the tuned small-M linear, ``kernels/linear/``, whose untuned default is that same cuBLAS call), one
q/k norm + rotary kernel that also writes the layer's new K/V into a float KV cache (a quantized cache: a KV write
kernel after it), attention, two residual add + norm kernels (post-attention, and the next layer's input norm or the
final norm) and one SiLU(gate) * up kernel. Every kernel is planned once per forward (:meth:`Qwen3Model.plan_step`);
on the CPU each is its torch reference (the same rounding steps). ``benchmarks/layer_launches.py`` counts a layer's
launches.
"""

from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.kernels.activation import SiluMulPlan, silu_mul_ref
from lightllm.kernels.linear.reference import mm_on_view
from lightllm.kernels.linear.small_m_linear import linear_op
from lightllm.kernels.norm.add_rmsnorm import AddRMSNormPlan, add_rmsnorm_ref
from lightllm.kernels.norm.qk_norm_rope import QKNormRopePlan, qk_norm_rope_ref
from lightllm.kernels.norm.rmsnorm import RMSNormPlan, rmsnorm_ref
from lightllm.layers.attention import AttentionBackend
from lightllm.layers.infer_state import InferState
from lightllm.layers.logits import plan_logits
from lightllm.layers.parallel import all_reduce_
from lightllm.models.qwen3.config import Qwen3ModelConfig
from lightllm.models.qwen3.tensor_parallel import local_heads
from lightllm.models.qwen3.weights import Qwen3Weights


class LayerOps(NamedTuple):
    """What the layers of one forward run besides attention, planned before the first layer."""

    norm: Callable  # (x, weight) -> y: the first layer's input norm
    qk_norm_rope_kv: Callable  # (qkv, q_weight, k_weight, layer) -> (q, k): q/k heads normed and rotated; the
    # tokens' k and v written to the layer's KV cache
    add_norm: Callable  # (residual, x, weight) -> y: residual += x, y = norm(residual); [tokens, hidden]
    silu_mul: Callable  # (gate_up) -> silu(gate) * up
    final_add_norm: Callable  # add_norm over the output rows (one per request in prefill)
    qkv: Callable  # (x, w, w_t) -> x @ w^T, the fused q/k/v projection (w [out, in], w_t its [in, out] view)
    o: Callable  # o_proj, as qkv
    gate_up: Callable  # the fused gate/up projection, as qkv
    down: Callable  # down_proj, as qkv
    logits: Callable  # (h) -> float32 logits [output rows, vocab]


class Qwen3Model:
    def __init__(self, config: Qwen3ModelConfig, weights: Qwen3Weights, device: torch.device, tp: int = 1):
        self.config = config
        self.w = weights
        self.device = device
        self.dtype = weights.embed.dtype
        self.tp = tp
        self.heads, self.kv_heads = local_heads(config, tp)  # this rank's share of ``tp`` ranks (the weights' shard)
        self.intermediate = config.intermediate_size // tp
        self.use_kernels = device.type == "cuda"  # the Triton kernels, else their torch references
        self.attn: Optional[AttentionBackend] = None  # set once the KV cache is sized, after the weights load
        self._cos, self._sin = rope_tables(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                           device, self.dtype)  # fmt: skip

    def _plan_ops(self, tokens: int, rows_out: int, state: InferState) -> LayerOps:
        """The layer ops of one forward, planned from its shapes before any layer runs. With kernels each is a
        plan run by every layer (checks and the tuned config once per forward); else the torch references."""
        eps, dtype, positions, kv_layers = self.config.rms_norm_eps, self.dtype, state.positions, self.attn.kv_layers
        if not self.use_kernels:
            cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]  # once per step
            heads, kv_heads = self.heads, self.kv_heads

            def qk_norm_rope(qkv, qw, kw):
                return qk_norm_rope_ref(qkv, qw, kw, cos, sin, heads, kv_heads, eps)

            def add_norm(residual, x, weight):
                return add_rmsnorm_ref(residual, x, weight, eps)

            return LayerOps(
                norm=lambda x, weight: rmsnorm_ref(x, weight, eps),
                qk_norm_rope_kv=then_write_kv(qk_norm_rope, self, state.out_token_idx),
                add_norm=add_norm,
                silu_mul=silu_mul_ref,
                final_add_norm=add_norm,
                **projections(False, tokens, dtype, **layer_projections(self.w.layers[0])),
                logits=plan_logits(rows_out, self.w.lm_head, use_kernels=False),
            )
        # Each layer consumes an op's outputs before the next layer's run: one output buffer per op and forward.
        hidden, reuse = self.config.hidden_size, dict(reuse_outputs=True)
        add_norm = AddRMSNormPlan((tokens, hidden), dtype, eps, **reuse).run
        final = add_norm if rows_out == tokens else AddRMSNormPlan((rows_out, hidden), dtype, eps).run
        # A float cache is written by the q/k norm + rotary launch itself; a quantized one by its own kernel after it
        kv_write = {} if kv_layers is None else dict(kv_layers=kv_layers, token_idx=state.out_token_idx)
        qk = QKNormRopePlan(tokens, self.heads, self.kv_heads, self.config.head_dim, dtype, self._cos, self._sin,
                            positions, eps, **reuse, **kv_write)  # fmt: skip
        qk_norm_rope_kv = qk.run if kv_write else then_write_kv(qk.run, self, state.out_token_idx)
        return LayerOps(norm=RMSNormPlan((tokens, hidden), dtype, eps).run, qk_norm_rope_kv=qk_norm_rope_kv,
                        add_norm=add_norm, silu_mul=SiluMulPlan(tokens, self.intermediate, dtype, **reuse).run,
                        final_add_norm=final, **projections(True, tokens, dtype, **layer_projections(self.w.layers[0])),
                        logits=plan_logits(rows_out, self.w.lm_head, use_kernels=True))  # fmt: skip

    def plan_step(self, tokens: int, state: InferState) -> LayerOps:
        """Everything one forward plans before its first layer: the attention plan (set on ``state``, from the
        batch metadata and the pool's shapes) and the layer ops (returned, see :meth:`_plan_ops`)."""
        rows_out = plan_attention(self.attn, state, self.heads, self.dtype, tokens)
        return self._plan_ops(tokens, rows_out, state)

    def set_attention(self, attn: AttentionBackend) -> None:
        """The backend that owns the KV pool this model writes and attends over."""
        self.attn = attn

    def alloc_request_state(self, num_slots: int, ssm_dtype: torch.dtype, checkpoints: int = 0,
                            slots_per_request: int = 1) -> int:  # fmt: skip
        return 0  # the KV cache is all the state a request has

    def save_state(self, row: int, checkpoint: int) -> None:
        raise RuntimeError("Qwen3 has no per-request state to checkpoint")

    load_state = save_state

    def prefix_cache_blocker(self) -> Optional[str]:
        return None

    def prefill_graph_blocker(self) -> Optional[str]:
        return None  # every op but causal attention is row by row; padding rows come after the real ones

    def prefill_graph_max_tokens(self) -> Optional[int]:
        return None

    def forward(self, input_ids: torch.Tensor, state: InferState) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]``: the last token of each request (prefill), every new token (decode)."""
        attn = self.attn
        if attn is None:
            raise RuntimeError("Qwen3Model.forward expected an attention backend: call set_attention(...) first")
        tokens, d, layers, prefill = input_ids.shape[0], self.config.head_dim, self.w.layers, state.is_prefill
        v_start = (self.heads + self.kv_heads) * d  # qkv's columns: q heads, k heads, v heads
        ops = self.plan_step(tokens, state)
        reduce = all_reduce_ if self.tp > 1 else unchanged  # one rank: no all-reduce, nor its world-size query
        h = F.embedding(input_ids, self.w.embed)  # the residual stream, updated in place by add_norm
        x = ops.norm(h, layers[0].input_norm)
        for i, lw in enumerate(layers):
            qkv = ops.qkv(x, lw.qkv_proj, lw.qkv_t)
            q, k = ops.qk_norm_rope_kv(qkv, lw.q_norm, lw.k_norm, i)
            if prefill:
                o = attn.prefill(i, q, k, qkv[:, v_start:].view(tokens, self.kv_heads, d), state)
            else:
                o = attn.decode(i, q, state)
            x = ops.add_norm(h, reduce(ops.o(o.reshape(tokens, -1), lw.o_proj, lw.o_t)), lw.post_norm)
            mlp = reduce(ops.down(ops.silu_mul(ops.gate_up(x, lw.gate_up_proj, lw.gate_up_t)), lw.down_proj, lw.down_t))
            if i + 1 < len(layers):
                x = ops.add_norm(h, mlp, layers[i + 1].input_norm)
        if prefill:  # only each request's last token goes on
            last = (state.b_q_start + state.b_q_len - 1).long()
            h, mlp = h[last], mlp[last]
        return ops.logits(ops.final_add_norm(h, mlp, self.w.final_norm))


def then_write_kv(qk_norm_rope: Callable, model, token_idx: torch.Tensor) -> Callable:
    """``qk_norm_rope`` followed by the attention backend's own KV write (a quantized cache, or the CPU references):
    ``(qkv, q_weight, k_weight, layer) -> (q, k)``. v is qkv's last ``kv_heads`` heads (Qwen3.5's wider gated q heads
    come before them as plain ones do)."""
    attn, kv_heads, d = model.attn, model.kv_heads, model.config.head_dim
    v_width = kv_heads * d

    def qk_norm_rope_kv(qkv, q_weight, k_weight, layer):
        q, k = qk_norm_rope(qkv, q_weight, k_weight)
        attn.write_kv(layer, k, qkv[:, -v_width:].view(qkv.shape[0], kv_heads, d), token_idx)
        return q, k

    return qk_norm_rope_kv


def projections(use_kernels: bool, tokens: int, dtype: torch.dtype, **weights: Optional[torch.Tensor]) -> dict:
    """One forward's projections by LayerOps field, ``(x, w, w_t) -> x @ w^T``, planned from each field's weight
    ``[out, in]`` (every layer's has that shape): ``linear_op`` with kernels (the tuned small-M linear at most 16
    tokens, else ``torch.mm`` on the view), else (or for a weight no layer has: None) ``torch.mm`` on the view."""
    return {field: linear_op(tokens, *w.shape, dtype) if use_kernels and w is not None else mm_on_view
            for field, w in weights.items()}  # fmt: skip


def layer_projections(lw) -> dict:
    """A Qwen3 layer's four projection weights by LayerOps field."""
    return dict(qkv=lw.qkv_proj, o=lw.o_proj, gate_up=lw.gate_up_proj, down=lw.down_proj)


def unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def rope_tables(rotary_dim: int, theta: float, max_positions: int, device, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE ``cos``/``sin`` ``[max_positions, rotary_dim]`` in ``dtype`` (each frequency twice: rotate-half)."""
    d = rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(device) / d))
    freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def plan_attention(attn: AttentionBackend, state: InferState, heads: int, dtype: torch.dtype, tokens: int) -> int:
    """Plan the step's attention on ``state``; the rows the forward outputs (one per request in prefill)."""
    if state.is_prefill:
        attn.plan_prefill(state, heads, dtype)
        return state.batch_size
    attn.plan_decode(state, heads, dtype)
    return tokens
