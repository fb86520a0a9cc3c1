"""Qwen3.5 forward: gated DeltaNet layers and gated full-attention layers, each followed by a SwiGLU MLP.

Follows transformers' ``Qwen3_5ForCausalLM`` rounding steps: zero-centred RMSNorms scale by ``1 + weight`` in
float32 before the cast, the gated norm casts the normalized value, multiplies by its plain weight and by
``silu(z)`` in float32; gates of the delta rule in float32. The KV pool holds only the full-attention layers
(``kv_layer`` maps a model layer to its pool layer); the linear-attention layers keep per-request state slots,
allocated by :meth:`Qwen3_5Model.alloc_request_state`.

Per layer, on a GPU: four GEMMs (the fused input projection: ``qkv_proj`` or ``in_proj``; o_proj or out_proj;
the fused gate/up; down; each one ``torch.mm`` on the weight's ``[in, out]`` view made at load, or at most 16 tokens
the tuned small-M linear whose untuned default is that same call: ``Qwen3Model``'s), the mixer's own
launches (gated attention: one q/k norm + partial rotary kernel that also writes the new K/V into a float KV cache
(a quantized cache: a KV write kernel after it), attention, one output-gate kernel; gated DeltaNet: the conv, the
delta rule, one gated-norm kernel), two residual add + norm kernels (post-mixer, and the next layer's input norm or
the final norm) and one SiLU(gate) * up kernel. Every kernel is planned once per forward
(:meth:`Qwen3_5Model.plan_step`); on the CPU each is its torch reference (the same rounding steps).
``benchmarks/layer_launches.py --model qwen3.5`` counts each kind's launches.
"""

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.kernels.activation import SiluMulPlan, silu_mul_ref
from lightllm.kernels.gates import SigmoidGatePlan, sigmoid_gate_mul_ref
from lightllm.kernels.norm.add_rmsnorm import AddRMSNormPlan, add_rmsnorm_ref
from lightllm.kernels.norm.gated_rmsnorm import GatedRMSNormPlan, gated_rmsnorm_ref
from lightllm.kernels.norm.qk_norm_rope import QKNormRopePlan, qk_norm_rope_ref
from lightllm.kernels.norm.rmsnorm import RMSNormPlan, rmsnorm_ref
from lightllm.layers.attention import AttentionBackend
from lightllm.layers.infer_state import InferState
from lightllm.layers.logits import plan_logits
from lightllm.layers.parallel import all_reduce_
from lightllm.layers import linear_attention
from lightllm.layers.linear_attention import (
    LinearAttentionBackend,
    LinearAttentionPlan,
    LinearAttentionShape,
    LinearAttentionState,
)
from lightllm.models.qwen3.model import plan_attention, projections, rope_tables, then_write_kv, unchanged
from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig
from lightllm.models.qwen3_5.weights import LayerWeights, Qwen3_5Weights


class LayerOps(NamedTuple):
    """What the layers of one forward run besides attention and the delta rule, planned before the first layer."""

    norm: Callable  # (x, weight, out=None) -> y: the first layer's input norm (zero-centred: weight is 1 + w,
    # float32); ``out`` may be a column block of a wider 2-D buffer (the MTP head's fc input)
    add_norm: Callable  # (residual, x, weight) -> y: residual += x, y = norm(residual); [tokens, hidden]
    final_add_norm: Callable  # add_norm over the output rows (one per request in prefill)
    qk_norm_rope_kv: Callable  # (qkv, q_weight, k_weight, layer) -> (q, k): q/k heads normed, partial rotary; the
    # tokens' k and v written to the pool layer's KV cache
    attn_gate: Callable  # (o, gate) -> o * sigmoid(gate): [tokens, heads, head_dim]
    gated_norm: Callable  # (o, z, weight) -> weight * norm(o) * silu(z): [tokens, value_heads, value_dim]
    silu_mul: Callable  # (gate_up) -> silu(gate) * up
    qkv: Callable  # (x, w, w_t) -> x @ w^T (w [out, in], w_t its [in, out] view): full attention's fused q/k/v
    o: Callable  # full attention's o_proj, as qkv
    in_proj: Callable  # gated DeltaNet's fused input projection, as qkv
    out_proj: Callable  # gated DeltaNet's out_proj, as qkv
    gate_up: Callable  # the fused gate/up projection, as qkv
    down: Callable  # down_proj, as qkv
    logits: Callable  # (h) -> float32 logits [output rows, vocab]


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
        self.intermediate = config.intermediate_size // tp
        self.tp = tp
        self.use_kernels = device.type == "cuda"  # the Triton kernels, else their torch references
        self.attn: Optional[AttentionBackend] = None  # set once the KV cache is sized
        self.linear: Optional[LinearAttentionBackend] = None  # set by alloc_request_state
        self._checkpoint_base, self._checkpoints = 0, 0  # prefix-cache state checkpoints (alloc_request_state)
        self.mtp = None  # the MTP head (mtp.py), built by the family when --mtp_mode asks for it
        self._cos, self._sin = rope_tables(config.rotary_dim, config.rope_theta, config.max_position_embeddings,
                                           device, self.dtype)  # fmt: skip
        self._projection_weights = projection_weights(weights)

    # ---- start-up hooks the runner calls ------------------------------------------------------------------

    def set_attention(self, attn: AttentionBackend) -> None:
        """The backend that owns the KV pool (``config.num_kv_layers`` layers) this model writes and attends over."""
        self.attn = attn

    def alloc_request_state(self, num_slots: int, ssm_dtype: torch.dtype, checkpoints: int = 0,
                            slots_per_request: int = 1) -> int:  # fmt: skip
        """Allocate the linear-attention state slots (conv state in the model dtype, recurrent state in
        ``ssm_dtype``), ``slots_per_request`` per request row (MTP: one per verified token, ``InferState.state_idx``
        says which is current), then ``checkpoints`` for the prefix cache; returns their bytes."""
        self._checkpoint_base, self._checkpoints = num_slots * slots_per_request, checkpoints
        state = LinearAttentionState(len(self.state_layer), self._checkpoint_base + checkpoints, self.linear_shape,
                                     self.dtype, ssm_dtype, self.device)  # fmt: skip
        self.linear = LinearAttentionBackend(state, self.device)
        return state.nbytes

    def save_state(self, row: int, checkpoint: int) -> None:
        self._copy_state(row, self._checkpoint_row(checkpoint))

    def load_state(self, checkpoint: int, row: int) -> None:
        self._copy_state(self._checkpoint_row(checkpoint), row)

    def _checkpoint_row(self, checkpoint: int) -> int:
        if not 0 <= checkpoint < self._checkpoints:
            raise ValueError(f"Qwen3.5: checkpoint expected in [0, {self._checkpoints}), got {checkpoint}")
        return self._checkpoint_base + checkpoint

    def _copy_state(self, src: int, dst: int) -> None:
        """Every linear layer's conv window and recurrent state of row ``src`` into row ``dst`` (two copies)."""
        state = self.linear.state
        state.conv[:, dst].copy_(state.conv[:, src])
        state.ssm[:, dst].copy_(state.ssm[:, src])

    def prefix_cache_blocker(self) -> Optional[str]:
        if self._checkpoints:
            return None
        return "linear-attention state: the prefix cache keeps it in checkpoints, and --linear_att_cache_size is 0"

    def prefill_graph_blocker(self) -> Optional[str]:
        # the padding rows run as a sequence of their own (InferState.padded, layers/linear_attention.py), on a GPU
        # through fla's kernels with every bound on the device; the float32 model's torch reference reads them on
        # the host
        if not self.prefill_graph_max_tokens():
            return ("linear attention: RECURRENT_MAX_TOKENS and CHUNKED_GRAPH_MAX_TOKENS are 0 (no kernel of its "
                    "prefill runs from bounds on the device)")  # fmt: skip
        if self.use_kernels and self.dtype == torch.float32:
            return "float32 linear attention: its prefill runs the torch reference, which reads lengths on the host"
        return None

    def prefill_graph_max_tokens(self) -> Optional[int]:
        return max(linear_attention.RECURRENT_MAX_TOKENS, linear_attention.CHUNKED_GRAPH_MAX_TOKENS)

    # ---- forward ------------------------------------------------------------------------------------------

    def _plan_ops(self, tokens: int, rows_out: int, state: InferState) -> LayerOps:
        """The layer ops of one forward, planned from its shapes before any layer runs. With kernels each is a
        plan run by every layer (checks and the tuned config once per forward); else the torch references."""
        c, eps, dtype, f32 = self.config, self.config.rms_norm_eps, self.dtype, torch.float32
        heads, kv_heads, s, positions = self.heads, self.kv_heads, self.linear_shape, state.positions
        if not self.use_kernels:
            cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]  # once per step

            def norm(x, weight, out=None):
                y = rmsnorm_ref(x, weight, eps)
                return y if out is None else out.copy_(y)

            def add_norm(residual, x, weight):
                return add_rmsnorm_ref(residual, x, weight, eps)

            def qk_norm_rope(qkv, qw, kw):
                return qk_norm_rope_ref(qkv, qw, kw, cos, sin, heads, kv_heads, eps, gated=True)

            return LayerOps(norm=norm, add_norm=add_norm,
                            final_add_norm=add_norm,
                            qk_norm_rope_kv=then_write_kv(qk_norm_rope, self, state.out_token_idx),
                            attn_gate=sigmoid_gate_mul_ref,
                            gated_norm=lambda o, z, weight: gated_rmsnorm_ref(o, z, weight, eps),
                            silu_mul=silu_mul_ref, **projections(False, tokens, dtype, **self._projection_weights),
                            logits=plan_logits(rows_out, self.w.lm_head, use_kernels=False))  # fmt: skip
        # Each layer consumes an op's outputs before the next layer's run: one output buffer per op and forward.
        hidden, reuse = (tokens, c.hidden_size), dict(reuse_outputs=True)
        add_norm = AddRMSNormPlan(hidden, dtype, eps, weight_dtype=f32, **reuse).run
        final = add_norm if rows_out == tokens else AddRMSNormPlan((rows_out, c.hidden_size), dtype, eps,
                                                                   weight_dtype=f32).run  # fmt: skip
        # A float cache is written by the q/k norm + rotary launch itself; a quantized one by its own kernel after it
        kv_layers = self.attn.kv_layers
        kv_write = {} if kv_layers is None else dict(kv_layers=kv_layers, token_idx=state.out_token_idx)
        qk = QKNormRopePlan(tokens, heads, kv_heads, c.head_dim, dtype, self._cos, self._sin, positions, eps,
                            gated=True, weight_dtype=f32, **reuse, **kv_write)  # fmt: skip
        return LayerOps(
            norm=RMSNormPlan(hidden, dtype, eps, weight_dtype=f32).run,
            add_norm=add_norm,
            final_add_norm=final,
            qk_norm_rope_kv=qk.run if kv_write else then_write_kv(qk.run, self, state.out_token_idx),
            attn_gate=SigmoidGatePlan(tokens, heads, c.head_dim, dtype, **reuse).run,
            gated_norm=GatedRMSNormPlan(tokens, s.value_heads, s.value_dim, dtype, eps, **reuse).run,
            silu_mul=SiluMulPlan(tokens, self.intermediate, dtype, **reuse).run,
            **projections(True, tokens, dtype, **self._projection_weights),
            logits=plan_logits(rows_out, self.w.lm_head, use_kernels=True),
        )

    def plan_step(self, tokens: int, state: InferState) -> Tuple[LayerOps, LinearAttentionPlan]:
        """Everything one forward plans before its first layer: the attention plan (set on ``state``), the layer
        ops (see :meth:`_plan_ops`) and the linear-attention plan."""
        rows_out = plan_attention(self.attn, state, self.heads, self.dtype, tokens)
        return self._plan_ops(tokens, rows_out, state), self.linear.plan(state)

    def forward(self, input_ids: torch.Tensor, state: InferState, keep_hidden: bool = False):
        """Float32 logits ``[rows, vocab]``: the last token of each request (prefill), every new token (decode).
        ``keep_hidden`` (MTP): also the final-normed hidden state of every token ``[tokens, hidden]``, what the MTP
        head reads, as ``(logits, hidden)``."""
        if self.attn is None or self.linear is None:
            raise RuntimeError("Qwen3_5Model.forward expected an attention backend and state slots: call "
                               "alloc_request_state(...) and set_attention(...) first")  # fmt: skip
        tokens, layers = input_ids.shape[0], self.w.layers
        ops, plan = self.plan_step(tokens, state)
        reduce = all_reduce_ if self.tp > 1 else unchanged  # one rank: no all-reduce, nor its world-size query
        h = F.embedding(input_ids, self.w.embed)  # the residual stream, updated in place by add_norm
        x = ops.norm(h, layers[0].input_norm)
        for i, lw in enumerate(layers):
            if lw.kind == "full_attention":
                out = self._full_attention(self.kv_layer[i], lw, x, ops, state)
            else:
                out = self._linear_attention(self.state_layer[i], lw, x, ops, plan, state.is_prefill)
            x = ops.add_norm(h, reduce(out), lw.post_norm)
            mlp = reduce(ops.down(ops.silu_mul(ops.gate_up(x, lw.gate_up_proj, lw.gate_up_t)), lw.down_proj, lw.down_t))
            if i + 1 < len(layers):
                x = ops.add_norm(h, mlp, layers[i + 1].input_norm)
        if keep_hidden:
            hidden = ops.add_norm(h, mlp, self.w.final_norm)
            rows = hidden[(state.b_q_start + state.b_q_len - 1).long()] if state.is_prefill else hidden
            return ops.logits(rows), hidden
        if state.is_prefill:  # only each request's last token goes on
            last = (state.b_q_start + state.b_q_len - 1).long()
            h, mlp = h[last], mlp[last]
        return ops.logits(ops.final_add_norm(h, mlp, self.w.final_norm))

    def _full_attention(self, layer: int, lw: LayerWeights, x, ops: LayerOps, state: InferState) -> torch.Tensor:
        """Gated attention: one GEMM gives q (per head ``[query | gate]``), k and v; q/k norms and partial rotary
        (writing the tokens' K/V into pool layer ``layer``), GQA over the KV pool, the output ``* sigmoid(gate)`` (the
        gate read in place), o_proj."""
        d, tokens, heads = self.config.head_dim, x.shape[0], self.heads
        qkv = ops.qkv(x, lw.qkv_proj, lw.qkv_t)
        q, k = ops.qk_norm_rope_kv(qkv, lw.q_norm, lw.k_norm, layer)
        gate = qkv[:, : heads * 2 * d].view(tokens, heads, 2 * d)[..., d:]
        if state.is_prefill:
            v = qkv[:, (2 * heads + self.kv_heads) * d :].view(tokens, self.kv_heads, d)
            o = self.attn.prefill(layer, q, k, v, state)
        else:
            o = self.attn.decode(layer, q, state)
        o = ops.attn_gate(o.reshape(tokens, heads, d), gate)
        return ops.o(o.reshape(tokens, -1), lw.o_proj, lw.o_t)

    def _linear_attention(self, layer: int, lw: LayerWeights, x, ops: LayerOps, plan: LinearAttentionPlan,
                          prefill: bool) -> torch.Tensor:  # fmt: skip
        """Gated DeltaNet: one GEMM gives the conv input (q, k, v), z, b and a; causal conv + SiLU, the gated
        delta rule over the request's state slot, the gated RMSNorm (z read in place), out_proj."""
        s, tokens, lin = self.linear_shape, x.shape[0], self.linear
        channels, vd, hv = s.conv_channels, s.value_heads * s.value_dim, s.value_heads
        proj = ops.in_proj(x, lw.in_proj, lw.in_t)
        z = proj[:, channels : channels + vd].view(tokens, hv, s.value_dim)
        b, a = proj[:, channels + vd : channels + vd + hv], proj[:, channels + vd + hv :]
        conv = lin.conv_prefill if prefill else lin.conv_decode
        mixed = conv(layer, proj[:, :channels], lw.conv1d, plan)
        kd = s.key_heads * s.key_dim
        q = mixed[:, :kd].view(tokens, s.key_heads, s.key_dim)
        k = mixed[:, kd : 2 * kd].view(tokens, s.key_heads, s.key_dim)
        v = mixed[:, 2 * kd :].view(tokens, s.value_heads, s.value_dim)
        rule = lin.delta_prefill if prefill else lin.delta_decode
        o = rule(layer, q, k, v, a, b, lw.A_log, lw.dt_bias, plan)
        return ops.out_proj(ops.gated_norm(o, z, lw.norm).reshape(tokens, -1), lw.out_proj, lw.out_t)


def projection_weights(weights: Qwen3_5Weights) -> Dict[str, Optional[torch.Tensor]]:
    """One weight of each projection by LayerOps field (every layer's has its shape): the first layer that holds it,
    the MTP head's layer included (a full-attention layer); None where no layer does."""
    layers = list(weights.layers) + ([weights.mtp.layer] if weights.mtp is not None else [])
    fields = dict(qkv="qkv_proj", o="o_proj", in_proj="in_proj", out_proj="out_proj", gate_up="gate_up_proj",
                  down="down_proj")  # fmt: skip
    return {field: next((getattr(lw, a) for lw in layers if getattr(lw, a) is not None), None)
            for field, a in fields.items()}  # fmt: skip
