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

    def _step_norm(self, eps: float):
        """The RMSNorm of one forward: on a GPU one plan per input shape (hidden states, q heads, k heads), made
        by its first call and run by every layer; elsewhere the torch reference."""
        if self.device.type != "cuda":
            return lambda x, weight: rmsnorm_ref(x, weight, eps)
        plans = {}

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            plan = plans.get(x.shape)
            if plan is None:
                plan = plans[x.shape] = RMSNormPlan(x, weight, eps)
            return plan.run(x, weight)

        return norm

    @staticmethod
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def set_attention(self, attn: AttentionBackend) -> None:
        """The backend that owns the KV pool this model writes and attends over."""
        self.attn = attn

    def forward(self, input_ids: torch.Tensor, state: InferState) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]``: the last token of each request (prefill), every new token (decode)."""
        attn = self.attn
        if attn is None:
            raise RuntimeError("Qwen3Model.forward expected an attention backend: call set_attention(...) first")
        cfg, eps = self.config, self.config.rms_norm_eps
        norm = self._step_norm(eps)
        tokens = input_ids.shape[0]
        h = F.embedding(input_ids, self.w.embed)
        cos = self._cos[state.positions][:, None, :]  # gathered once per step, not per layer and tensor
        sin = self._sin[state.positions][:, None, :]
        for i, lw in enumerate(self.w.layers):
            x = norm(h, lw.input_norm)
            q = F.linear(x, lw.q_proj).view(tokens, self.heads, cfg.head_dim)
            k = F.linear(x, lw.k_proj).view(tokens, self.kv_heads, cfg.head_dim)
            v = F.linear(x, lw.v_proj).view(tokens, self.kv_heads, cfg.head_dim)
            q = self._rotary(norm(q.contiguous(), lw.q_norm), cos, sin)
            k = self._rotary(norm(k.contiguous(), lw.k_norm), cos, sin)
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
        h = norm(h.contiguous(), self.w.final_norm)
        return F.linear(h, self.w.lm_head).float()
