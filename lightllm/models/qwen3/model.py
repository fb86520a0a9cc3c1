"""Qwen3 forward: embedding, RMSNorm, q/k norm, rotary, GQA attention over the KV cache, SwiGLU, lm_head.

Follows transformers' Qwen3 rounding steps (norms in float32 then cast, rotary tables cast to the model
dtype, softmax in float32) so the CPU float32 path matches it to float rounding.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from lightllm.kernels.norm.rmsnorm import RMSNormPlan, rmsnorm_ref
from lightllm.layers.attention import AttentionBackend
from lightllm.layers.infer_state import InferState
from lightllm.layers.parallel import all_reduce_
from lightllm.models.qwen3.config import Qwen3ModelConfig
from lightllm.models.qwen3.tensor_parallel import local_heads
from lightllm.models.qwen3.weights import Qwen3Weights


class Qwen3Model:
    def __init__(self, config: Qwen3ModelConfig, weights: Qwen3Weights, device: torch.device, tp: int = 1):
        self.config = config
        self.w = weights
        self.device = device
        self.dtype = weights.embed.dtype
        self.heads, self.kv_heads = local_heads(config, tp)  # this rank's share of ``tp`` ranks (the weights' shard)
        self.attn: Optional[AttentionBackend] = None  # set once the KV cache is sized, after the weights load
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(device) / d))
        t = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.dtype)
        self._sin = emb.sin().to(self.dtype)

    def _plan_norms(self, tokens: int, rows_out: int) -> tuple:
        """The RMSNorms of one forward, planned from its shapes before any layer runs: ``(hidden, q heads,
        k heads, final)`` callables ``(x, weight) -> y``. On a GPU each is an :class:`RMSNormPlan` run by every
        layer (the final norm sees ``rows_out`` rows: one per request in prefill); elsewhere the torch reference."""
        eps = self.config.rms_norm_eps
        if self.device.type != "cuda":
            ref = lambda x, weight: rmsnorm_ref(x, weight, eps)  # noqa: E731
            return ref, ref, ref, ref
        hidden, head_dim = self.config.hidden_size, self.config.head_dim

        def plan(*shape: int):
            return RMSNormPlan(shape, self.dtype, eps).run

        norm_h = plan(tokens, hidden)
        final = norm_h if rows_out == tokens else plan(rows_out, hidden)
        return norm_h, plan(tokens, self.heads, head_dim), plan(tokens, self.kv_heads, head_dim), final

    def plan_step(self, tokens: int, state: InferState) -> tuple:
        """Everything one forward plans before its first layer: the attention plan (set on ``state``, from the
        batch metadata and the pool's shapes) and the norm plans (returned, see :meth:`_plan_norms`)."""
        if state.is_prefill:
            self.attn.plan_prefill(state, self.heads, self.dtype)
            rows_out = state.batch_size
        else:
            self.attn.plan_decode(state, self.heads, self.dtype)
            rows_out = tokens
        return self._plan_norms(tokens, rows_out)

    @staticmethod
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def set_attention(self, attn: AttentionBackend) -> None:
        """The backend that owns the KV pool this model writes and attends over."""
        self.attn = attn

    def alloc_request_state(self, num_slots: int, ssm_dtype: torch.dtype) -> int:
        return 0  # the KV cache is all the state a request has

    def forward(self, input_ids: torch.Tensor, state: InferState) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]``: the last token of each request (prefill), every new token (decode)."""
        attn = self.attn
        if attn is None:
            raise RuntimeError("Qwen3Model.forward expected an attention backend: call set_attention(...) first")
        cfg, tokens = self.config, input_ids.shape[0]
        norm, q_norm, k_norm, final_norm = self.plan_step(tokens, state)
        h = F.embedding(input_ids, self.w.embed)
        cos = self._cos[state.positions][:, None, :]  # gathered once per step, not per layer and tensor
        sin = self._sin[state.positions][:, None, :]
        for i, lw in enumerate(self.w.layers):
            x = norm(h, lw.input_norm)
            q = F.linear(x, lw.q_proj).view(tokens, self.heads, cfg.head_dim)
            k = F.linear(x, lw.k_proj).view(tokens, self.kv_heads, cfg.head_dim)
            v = F.linear(x, lw.v_proj).view(tokens, self.kv_heads, cfg.head_dim)
            q = self._rotary(q_norm(q.contiguous(), lw.q_norm), cos, sin)
            k = self._rotary(k_norm(k.contiguous(), lw.k_norm), cos, sin)
            attn.write_kv(i, k, v, state.out_token_idx)
            if state.is_prefill:
                o = attn.prefill(i, q, k, v, state)
            else:
                o = attn.decode(i, q, state)
            h = h + all_reduce_(F.linear(o.reshape(tokens, -1), lw.o_proj))
            x = norm(h, lw.post_norm)
            h = h + all_reduce_(F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj))
        if state.is_prefill:
            h = h[(state.b_q_start + state.b_q_len - 1).long()]
        h = final_norm(h.contiguous(), self.w.final_norm)
        return F.linear(h, self.w.lm_head).float()
