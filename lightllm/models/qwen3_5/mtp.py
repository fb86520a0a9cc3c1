"""Qwen3.5's MTP head (multi-token prediction): the draft model of MTP speculative decoding.

For the token ``t`` that follows position ``i`` and the main model's final-normed hidden state ``h_i`` of
position ``i``, the head computes ``fc([pre_fc_norm_embedding(embed(t)); pre_fc_norm_hidden(h_i)])`` (that order),
one gated full-attention decoder layer at position ``i`` over the head's own KV (one more layer of the KV pool,
indexed by the main model's ``req_to_token`` table, so position ``i`` of both lives in the same token slot), its
final norm and the shared ``lm_head``: logits for the token after ``t``. Its output hidden state (after
``mtp.norm``, as vLLM chains it) is the ``h`` of the next draft step: one layer reused for every draft step
(LightLLM's ``eagle_with_att``).

Tensor parallelism: the layer is sharded as the main model's full-attention layers are (heads, its KV and
``gate_up_proj`` by rank; ``o_proj`` and ``down_proj`` row-parallel, their outputs all-reduced), so every rank holds
the same hidden state after it. ``fc`` is replicated: it is one ``[hidden, 2 * hidden]`` GEMM per draft step over a
handful of tokens, so splitting it would save half a small GEMM and add a collective (an all-gather of its output)
that costs as much at decode batch sizes. Embedding, norms and ``lm_head`` are the main model's (replicated).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from lightllm.layers.infer_state import InferState
from lightllm.layers.parallel import all_reduce_
from lightllm.models.qwen3.model import projections, unchanged
from lightllm.models.qwen3_5.weights import MTPWeights


class Qwen3_5MTP:
    def __init__(self, main, weights: MTPWeights):
        self.main = main  # the Qwen3_5Model: its attention backend, layer code and shared embedding / lm_head
        self.w = weights
        self.kv_layer = main.config.num_kv_layers  # the pool layer after the main model's
        self._reduce = all_reduce_ if main.tp > 1 else unchanged  # row-parallel o_proj / down_proj outputs

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: InferState,
                out_rows: Optional[torch.Tensor] = None) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """Run the head over ``input_ids [tokens]`` (the next tokens) and ``hidden [tokens, hidden]`` at
        ``state.positions``, writing its KV there. ``out_rows`` (int64 indices of tokens): return float32 logits
        ``[rows, vocab]`` and the output hidden states ``[rows, hidden]`` of those tokens; None: the KV writes are
        all that is wanted (the layer stops after its attention)."""
        m, w, lw = self.main, self.w, self.w.layer
        tokens = input_ids.shape[0]
        if state.is_prefill:
            m.attn.plan_prefill(state, m.heads, m.dtype)
        else:
            m.attn.plan_decode(state, m.heads, m.dtype)
        rows_out = tokens if out_rows is None else out_rows.shape[0]
        ops = m._plan_ops(tokens, rows_out, state)
        # fc's input [normed embedding | normed hidden]: each norm writes its half (no concatenation copy)
        width = hidden.shape[-1]
        fc_in = torch.empty(tokens, 2 * width, dtype=m.dtype, device=hidden.device)
        ops.norm(F.embedding(input_ids, m.w.embed), w.norm_embedding, out=fc_in[:, :width])
        ops.norm(hidden.to(m.dtype), w.norm_hidden, out=fc_in[:, width:])
        h = projections(m.use_kernels, tokens, m.dtype, fc=w.fc)["fc"](fc_in, w.fc, w.fc_t)
        x = ops.norm(h, lw.input_norm)
        out = m._full_attention(self.kv_layer, lw, x, ops, state)  # writes the head's KV (float: in the q/k kernel)
        if out_rows is None:
            return None
        x = ops.add_norm(h, self._reduce(out), lw.post_norm)
        mlp = self._reduce(
            ops.down(ops.silu_mul(ops.gate_up(x, lw.gate_up_proj, lw.gate_up_t)), lw.down_proj, lw.down_t)
        )
        if rows_out != tokens:
            h, mlp = h[out_rows], mlp[out_rows]
        normed = ops.final_add_norm(h, mlp, w.final_norm)
        return ops.logits(normed), normed
