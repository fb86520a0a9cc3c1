"""Qwen3.5 forward: gated DeltaNet layers and gated full-attention layers, each followed by a SwiGLU MLP.

Follows transformers' ``Qwen3_5ForCausalLM`` rounding steps: zero-centred RMSNorms scale by ``1 + weight`` in
float32 before the cast, the gated norm casts the normalized value, multiplies by its plain weight and by
``silu(z)`` in float32; gates of the delta rule in float32. The KV pool holds only the full-attention layers
(``kv_layer`` maps a model layer to its pool layer); the linear-attention layers keep per-request state slots,
allocated by :meth:`Qwen3_5Model.alloc_request_state`.
"""

from typing import Dict, Optional

import torch
import torch.nn.functional as F

from lightllm.layers.attention import AttentionBackend
from lightllm.layers.infer_state import InferState
from lightllm.layers.parallel import all_reduce_
from lightllm.layers.linear_attention import (
    LinearAttentionBackend,
    LinearAttentionPlan,
    LinearAttentionShape,
    LinearAttentionState,
)
from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig
from lightllm.models.qwen3_5.weights import LayerWeights, Qwen3_5Weights


def rmsnorm_1p(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: ``(norm(x) * (1 + w)).to(x.dtype)`` in float32; ``scale`` is ``1 + w`` (float32)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x)`` (norm cast to x's dtype first), then ``* silu(z)`` in float32, cast back."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(x.dtype)


class Qwen3_5Model:
    def __init__(self, config: Qwen3_5ModelConfig, weights: Qwen3_5Weights, device: torch.device, tp: int = 1):
        self.config = config
        self.w = weights
        self.device = device
        self.dtype = weights.embed.dtype
        # this rank's share of ``tp`` ranks (the weights' shard, tensor_parallel.py)
        self.heads, self.kv_heads = config.num_attention_heads // tp, config.num_key_value_heads // tp
        kinds = config.layer_types
        self.kv_layer: Dict[int, int] = {
            i: n for n, i in enumerate(i for i, t in enumerate(kinds) if t == "full_attention")
        }
        self.state_layer: Dict[int, int] = {
            i: n for n, i in enumerate(i for i, t in enumerate(kinds) if t != "full_attention")
        }
        self.linear_shape = LinearAttentionShape(config.linear_num_key_heads // tp, config.linear_num_value_heads // tp,
                                                 config.linear_key_head_dim, config.linear_value_head_dim,
                                                 config.linear_conv_kernel_dim)  # fmt: skip
        self.attn: Optional[AttentionBackend] = None  # set once the KV cache is sized
        self.linear: Optional[LinearAttentionBackend] = None  # set by alloc_request_state
        d = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(device) / d))
        freqs = torch.outer(torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.dtype)
        self._sin = emb.sin().to(self.dtype)

    # ---- start-up hooks the runner calls ------------------------------------------------------------------

    def set_attention(self, attn: AttentionBackend) -> None:
        """The backend that owns the KV pool (``config.num_kv_layers`` layers) this model writes and attends over."""
        self.attn = attn

    def alloc_request_state(self, num_slots: int, ssm_dtype: torch.dtype) -> int:
        """Allocate the linear-attention state slots (conv state in the model dtype, recurrent state in
        ``ssm_dtype``), one per request row; returns their bytes."""
        state = LinearAttentionState(len(self.state_layer), num_slots, self.linear_shape, self.dtype, ssm_dtype,
                                     self.device)  # fmt: skip
        self.linear = LinearAttentionBackend(state, self.device)
        return state.nbytes

    # ---- forward ------------------------------------------------------------------------------------------

    def plan_step(self, state: InferState) -> LinearAttentionPlan:
        """Everything one forward plans before its first layer: the attention plan (set on ``state``) and the
        linear-attention plan (returned)."""
        if state.is_prefill:
            self.attn.plan_prefill(state, self.heads, self.dtype)
        else:
            self.attn.plan_decode(state, self.heads, self.dtype)
        return self.linear.plan(state)

    def forward(self, input_ids: torch.Tensor, state: InferState) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]``: the last token of each request (prefill), every new token (decode)."""
        if self.attn is None or self.linear is None:
            raise RuntimeError("Qwen3_5Model.forward expected an attention backend and state slots: call "
                               "alloc_request_state(...) and set_attention(...) first")  # fmt: skip
        eps = self.config.rms_norm_eps
        plan = self.plan_step(state)
        h = F.embedding(input_ids, self.w.embed)
        cos = self._cos[state.positions][:, None, :]  # gathered once per step
        sin = self._sin[state.positions][:, None, :]
        for i, lw in enumerate(self.w.layers):
            x = rmsnorm_1p(h, lw.input_norm, eps)
            if lw.kind == "full_attention":
                h = h + self._full_attention(self.kv_layer[i], lw, x, cos, sin, state)
            else:
                h = h + self._linear_attention(self.state_layer[i], lw, x, plan, state.is_prefill)
            x = rmsnorm_1p(h, lw.post_norm, eps)
            h = h + all_reduce_(F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj))
        if state.is_prefill:
            h = h[(state.b_q_start + state.b_q_len - 1).long()]
        return F.linear(rmsnorm_1p(h, self.w.final_norm, eps), self.w.lm_head).float()

    def _full_attention(self, layer: int, lw: LayerWeights, x, cos, sin, state: InferState) -> torch.Tensor:
        """Gated attention: ``q_proj`` gives per head ``[query | gate]``; q/k norms, partial rotary, GQA over the
        KV pool, output ``* sigmoid(gate)``."""
        cfg, tokens, eps = self.config, x.shape[0], self.config.rms_norm_eps
        q, gate = F.linear(x, lw.q_proj).view(tokens, self.heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        k = F.linear(x, lw.k_proj).view(tokens, self.kv_heads, cfg.head_dim)
        v = F.linear(x, lw.v_proj).view(tokens, self.kv_heads, cfg.head_dim)
        q = self._rotary(rmsnorm_1p(q, lw.q_norm, eps), cos, sin)
        k = self._rotary(rmsnorm_1p(k, lw.k_norm, eps), cos, sin)
        self.attn.write_kv(layer, k, v, state.out_token_idx)
        o = self.attn.prefill(layer, q, k, v, state) if state.is_prefill else self.attn.decode(layer, q, state)
        o = o.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))
        return all_reduce_(F.linear(o, lw.o_proj))

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rotary_dim`` dims of each head (rotate-half layout); the rest pass through."""
        d = self.config.rotary_dim
        rot, rest = x[..., :d], x[..., d:]
        half = d // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1).contiguous()

    def _linear_attention(self, layer: int, lw: LayerWeights, x, plan: LinearAttentionPlan,
                          prefill: bool) -> torch.Tensor:  # fmt: skip
        """Gated DeltaNet: in_proj (qkv, z, b, a), causal conv + SiLU, the gated delta rule over the request's
        state slot, gated RMSNorm, out_proj."""
        s, tokens, lin = self.linear_shape, x.shape[0], self.linear
        mixed = F.linear(x, lw.in_proj_qkv)
        z = F.linear(x, lw.in_proj_z).view(tokens, s.value_heads, s.value_dim)
        b, a = F.linear(x, lw.in_proj_b), F.linear(x, lw.in_proj_a)
        conv = lin.conv_prefill if prefill else lin.conv_decode
        mixed = conv(layer, mixed, lw.conv1d, plan)
        kd = s.key_heads * s.key_dim
        q = mixed[:, :kd].view(tokens, s.key_heads, s.key_dim)
        k = mixed[:, kd : 2 * kd].view(tokens, s.key_heads, s.key_dim)
        v = mixed[:, 2 * kd :].view(tokens, s.value_heads, s.value_dim)
        rule = lin.delta_prefill if prefill else lin.delta_decode
        o = rule(layer, q, k, v, a, b, lw.A_log, lw.dt_bias, plan)
        o = gated_rmsnorm(o, z, lw.norm, self.config.rms_norm_eps)
        return all_reduce_(F.linear(o.reshape(tokens, -1), lw.out_proj))
