"""Gated DeltaNet (linear attention) backend: per-request state slots, and the conv + gated delta rule of prefill
and decode over them.

State (one slot per request row, the same index as ``b_req_idx``; layouts in
``kernels/linear_attention/reference.py``): conv state ``[layers, slots, K - 1, C]`` in the model dtype and the
recurrent state ``[layers, slots, Hv, Dk, Dv]`` in ``--linear_att_ssm_data_type``. A prefill starts a request
from zero state, or, for a chunk that continues a request (``b_prefix_len > 0``: chunked prefill), from its slot's
states (the conv window of its last ``K - 1`` inputs, the recurrent state as the initial state); either way it
writes its final states into the slot. Decode reads and updates the slot in place, so a captured decode graph
indexes the state through the static ``b_req_idx`` buffer.

- CPU: the torch references.
- GPU prefill: fla-core's chunked gated delta rule (packed varlen; float32 models: the torch reference), or, when
  no request of the forward brings more than ``RECURRENT_MAX_TOKENS`` new tokens (a short prompt, the rest of a
  prompt after a prefix-cache hit), fla-core's fused recurrent kernel over the same packing; the conv in two Triton
  launches over the whole packed batch, reading and writing the slots' windows itself
  (``kernels/linear_attention/conv1d_prefill.py``).
- GPU decode: the Triton recurrent update and conv update (``kernels/linear_attention``).
"""

import itertools
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from lightllm.common.transfer import tensor_to_device
from lightllm.kernels.linear_attention.reference import (
    causal_conv1d_prefill_ref,
    causal_conv1d_update_ref,
    gated_delta_decode_ref,
    gated_delta_rule_varlen_ref,
    gdn_gates_ref,
)
from lightllm.kernels.linear_attention.verify_reference import causal_conv1d_verify_ref, gated_delta_verify_ref
from lightllm.layers import fla_tuning
from lightllm.layers.infer_state import InferState

SSM_DATA_TYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --linear_att_ssm_data_type
# A prefill whose requests bring at most this many new tokens each runs the gated delta rule token by token (one
# launch) instead of chunked: fla's chunked path costs about 1 ms of host work a layer (H100 profile, docs/engine.md),
# and up to one of its 64-token chunks it has no work to share across tokens
RECURRENT_MAX_TOKENS = 64
# Prefill graphs (Qwen3.5) of more rows than RECURRENT_MAX_TOKENS, up to this many, run fla's chunked kernels from
# chunk indices made on the device (:func:`static_chunk_indices`), so nothing of theirs depends on the lengths on
# the host. 512: a 128-token prompt's first token in 4.7 ms instead of 11.5 eager (H100, docs/engine.md "Larger
# Qwen3.5 buckets"); 0 leaves buckets past RECURRENT_MAX_TOKENS eager
CHUNKED_GRAPH_MAX_TOKENS = 512
FLA_CHUNK = 64  # fla-core's chunk size for the gated delta rule


@dataclass(frozen=True)
class LinearAttentionShape:
    """One layer's gated DeltaNet sizes on this rank."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class LinearAttentionState:
    """The state slots of every linear-attention layer, allocated once (zeros) at start-up."""

    def __init__(self, num_layers: int, num_slots: int, shape: LinearAttentionShape, conv_dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device) -> None:  # fmt: skip
        s = shape
        self.conv = torch.zeros(num_layers, num_slots, s.conv_kernel - 1, s.conv_channels, dtype=conv_dtype,
                                device=device)  # fmt: skip
        self.ssm = torch.zeros(num_layers, num_slots, s.value_heads, s.key_dim, s.value_dim, dtype=ssm_dtype,
                               device=device)  # fmt: skip
        # Each layer's views, made once: a layer's call indexes a tuple instead of dispatching a select
        self.conv_layers, self.ssm_layers = tuple(self.conv.unbind(0)), tuple(self.ssm.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


@dataclass
class LinearAttentionPlan:
    """What every layer of one forward shares: the state slots, and for prefill the packed sequence bounds (on
    the device for fla-core, on the host for the references)."""

    state_idx: torch.Tensor  # int32 [batch]
    cu_seqlens: Optional[torch.Tensor] = None  # int64 [batch + 1], prefill only
    cu_seqlens_cpu: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None  # int64 [tokens]: each token's index in its request (GPU prefill)
    continues: Optional[torch.Tensor] = None  # bool [batch]: starts from its slot's states (None: all from zero)
    max_q_len: int = 0  # prefill: the most new tokens of one request
    dst_idx: Optional[torch.Tensor] = None  # int32 [batch, T]: MTP verify, the slot of the state after each token
    # GPU: the conv's (decode: and the delta rule's) kernel plans, made at the first layer's call (from its tensors)
    # and run by every later layer, each writing one output buffer per forward
    conv_update: Any = None
    delta_decode: Any = None
    conv_prefill: Any = None
    seq_ids: Optional[torch.Tensor] = None  # int64 [tokens]: each token's request (GPU prefill)
    chunk_indices: Optional[torch.Tensor] = None  # int64 [chunks, 2]: a chunked prefill graph's (fla's layout)


class LinearAttentionBackend:
    def __init__(self, state: LinearAttentionState, device: torch.device):
        self.state = state
        self.on_gpu = device.type == "cuda"
        if self.on_gpu:  # before fla-core's first import (in the first prefill)
            fla_tuning.use_shipped_configs()

    def plan(self, infer_state: InferState) -> LinearAttentionPlan:
        """Once per forward, before the first layer."""
        slots = infer_state.b_req_idx if infer_state.state_idx is None else infer_state.state_idx
        if not infer_state.is_prefill:
            return LinearAttentionPlan(slots, dst_idx=infer_state.state_dst_idx)
        if infer_state.padded:
            return self._padded_plan(infer_state, slots)
        lens = infer_state.b_q_len.to(torch.int64)
        if infer_state.q_lens_host is not None:  # the bounds from the host: nothing here waits for the device
            cu_cpu = torch.tensor([0, *itertools.accumulate(infer_state.q_lens_host)], dtype=torch.int64)
            cu = tensor_to_device(cu_cpu, lens.device)
        else:
            cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
            cu_cpu = cu.cpu()
        seq_ids, offsets = _token_layout(cu, lens, int(cu_cpu[-1])) if self.on_gpu else (None, None)
        continues = infer_state.b_prefix_len > 0 if infer_state.max_prefix_len else None
        max_q_len = int((cu_cpu[1:] - cu_cpu[:-1]).max()) if len(cu_cpu) > 1 else 0
        return LinearAttentionPlan(slots, cu, cu_cpu, offsets, continues, max_q_len=max_q_len, seq_ids=seq_ids)

    def _padded_plan(self, infer_state: InferState, slots: torch.Tensor) -> LinearAttentionPlan:
        """A prefill graph's plan: one request of ``b_q_len`` tokens, then the padding rows up to ``max_q_len`` as
        a sequence of their own (``slots``: the request's state slot, then the padding's). Every bound is derived on
        the device, nothing waits for it and nothing depends on the lengths on the host, so a captured graph replays
        it for any ``b_q_len``. Past ``RECURRENT_MAX_TOKENS`` rows (fla's chunked kernels, which size their grids
        by the chunk count), an empty third sequence follows, which the chunk indices' spare row points at, so the
        count is the same for every ``b_q_len`` (:func:`static_chunk_indices`)."""
        tokens = infer_state.max_q_len
        chunked = tokens > RECURRENT_MAX_TOKENS
        sequences = 3 if chunked else 2
        if infer_state.b_q_len.shape != (1,) or slots.shape[0] < sequences:
            raise ValueError(f"linear attention: a padded prefill expected one request and {sequences} state slots, "
                             f"got {infer_state.b_q_len.shape[0]} requests and {slots.shape[0]} slots")  # fmt: skip
        if self.on_gpu and chunked and tokens > CHUNKED_GRAPH_MAX_TOKENS:
            raise ValueError(f"linear attention: a padded prefill expected at most RECURRENT_MAX_TOKENS "
                             f"({RECURRENT_MAX_TOKENS}) rows on a GPU, or CHUNKED_GRAPH_MAX_TOKENS "
                             f"({CHUNKED_GRAPH_MAX_TOKENS}), got {tokens}")  # fmt: skip
        own = infer_state.b_q_len.to(torch.int64)
        lens = torch.cat([own, tokens - own, own.new_zeros(sequences - 2)])
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        seq_ids, offsets = _token_layout(cu, lens, tokens) if self.on_gpu else (None, None)
        continues = None
        if infer_state.max_prefix_len:  # the padding always starts afresh
            fresh = torch.zeros(sequences - 1, dtype=torch.bool, device=cu.device)
            continues = torch.cat([infer_state.b_prefix_len > 0, fresh])
        plan = LinearAttentionPlan(slots[:sequences], cu, None if self.on_gpu else cu, offsets, continues,
                                   max_q_len=tokens, seq_ids=seq_ids)  # fmt: skip
        if chunked:
            plan.chunk_indices = static_chunk_indices(cu, FLA_CHUNK, -(-tokens // FLA_CHUNK) + 1)
        return plan

    def _initial(self, pool: torch.Tensor, plan: LinearAttentionPlan) -> torch.Tensor:
        """Each request's state from its slot of ``pool`` (one layer), zeros for a request that starts afresh
        (its slot may hold a finished request's states)."""
        states = pool[plan.state_idx.long()]
        keep = plan.continues.view(-1, *([1] * (states.dim() - 1)))
        return torch.where(keep, states, torch.zeros((), dtype=states.dtype, device=states.device))

    # ---- prefill: from zero state, or a continued request's slot; the final states go to its slot ------------

    def conv_prefill(self, layer: int, x: torch.Tensor, weight: torch.Tensor, plan: LinearAttentionPlan):
        """Depthwise causal conv + SiLU of the packed ``x`` ``[T, C]`` (``weight`` ``[C, K]``)."""
        pool = self.state.conv_layers[layer]
        if self.on_gpu:
            if plan.conv_prefill is None:
                from lightllm.kernels.linear_attention.conv1d_prefill import CausalConv1dPrefillPlan

                conv = self.state.conv
                check_same_device("conv", conv, x=x, weight=weight, state_idx=plan.state_idx,
                                  cu_seqlens=plan.cu_seqlens)  # fmt: skip
                plan.conv_prefill = CausalConv1dPrefillPlan(x.shape, x.dtype, conv.shape[1:], conv.dtype, weight.dtype,
                                                            plan.state_idx, plan.cu_seqlens, plan.seq_ids, plan.offsets,
                                                            plan.continues, reuse_outputs=True)  # fmt: skip
            return plan.conv_prefill.run(x, pool, weight)
        init = None if plan.continues is None else self._initial(pool, plan)
        out, states = causal_conv1d_prefill_ref(x, weight, plan.cu_seqlens_cpu, init)
        pool[plan.state_idx.long()] = states.to(pool.dtype)
        return out

    def delta_prefill(self, layer: int, q, k, v, a, b, A_log, dt_bias, plan: LinearAttentionPlan) -> torch.Tensor:
        """The gated delta rule over packed sequences: q/k ``[T, Hk, Dk]`` (not normalized), v ``[T, Hv, Dv]``,
        a/b ``[T, Hv]``. Returns ``[T, Hv, Dv]`` in v's dtype."""
        g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
        init = None if plan.continues is None else self._initial(self.state.ssm_layers[layer], plan).float()
        # fla-core 0.6.0's chunk kernels fail to compile for float32 inputs with Triton 3.6 on the H200 (chunk_o:
        # "PassManager::run failed"), so float32 models take the torch reference on the GPU too: slow, but exact
        if self.on_gpu and v.dtype != torch.float32:
            fla = _fla_recurrent if plan.max_q_len <= RECURRENT_MAX_TOKENS else _fla_chunk
            out, finals = fla(q, k, v, g, beta.to(v.dtype), plan, init)
        else:
            out, finals = gated_delta_rule_varlen_ref(q, k, v, g, beta, plan.cu_seqlens_cpu, initial_states=init)
        self.state.ssm_layers[layer][plan.state_idx.long()] = finals.to(self.state.ssm.dtype)
        return out.to(v.dtype)

    # ---- decode: one token per request, its slot updated in place -----------------------------------------

    def conv_decode(self, layer: int, x: torch.Tensor, weight: torch.Tensor, plan: LinearAttentionPlan):
        """On a GPU the output is the forward's one buffer: the next layer's call overwrites it."""
        if plan.dst_idx is not None:
            return self._conv_verify(layer, x, weight, plan)
        if self.on_gpu:
            if plan.conv_update is None:
                from lightllm.kernels.linear_attention.conv1d_update import CausalConv1dUpdatePlan

                conv = self.state.conv
                check_same_device("conv", conv, x=x, weight=weight, state_idx=plan.state_idx)
                plan.conv_update = CausalConv1dUpdatePlan(x.shape, x.dtype, conv.shape[1:], conv.dtype, weight.dtype,
                                                          plan.state_idx, reuse_outputs=True)  # fmt: skip
            return plan.conv_update.run(x, self.state.conv_layers[layer], weight)
        return causal_conv1d_update_ref(x, self.state.conv_layers[layer], weight, plan.state_idx)

    def delta_decode(self, layer: int, q, k, v, a, b, A_log, dt_bias, plan: LinearAttentionPlan) -> torch.Tensor:
        """On a GPU the output is the forward's one buffer: the next layer's call overwrites it."""
        if plan.dst_idx is not None:
            return self._delta_verify(layer, q, k, v, a, b, A_log, dt_bias, plan)
        if self.on_gpu:
            if plan.delta_decode is None:
                from lightllm.kernels.linear_attention.gated_delta_decode import GatedDeltaDecodePlan

                ssm = self.state.ssm
                check_same_device("ssm", ssm, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                  state_idx=plan.state_idx)  # fmt: skip
                plan.delta_decode = GatedDeltaDecodePlan(q.shape, v.shape, q.dtype, ssm.shape[1:], ssm.dtype,
                                                         plan.state_idx, gate_dtype=a.dtype,
                                                         reuse_outputs=True)  # fmt: skip
            return plan.delta_decode.run(q, k, v, a, b, A_log, dt_bias, self.state.ssm_layers[layer])
        return gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, self.state.ssm_layers[layer], plan.state_idx)

    # ---- MTP verify: T tokens per request from its current slot, the state after each token to its own slot ----

    def _conv_verify(self, layer: int, x: torch.Tensor, weight: torch.Tensor, plan: LinearAttentionPlan):
        batch, T = plan.dst_idx.shape
        xs = x.view(batch, T, x.shape[-1])
        if self.on_gpu:
            from lightllm.kernels.linear_attention.conv1d_verify import causal_conv1d_verify

            out = causal_conv1d_verify(xs, self.state.conv_layers[layer], weight, plan.state_idx, plan.dst_idx)
        else:
            out = causal_conv1d_verify_ref(xs, self.state.conv_layers[layer], weight, plan.state_idx, plan.dst_idx)
        return out.view(x.shape)

    def _delta_verify(self, layer: int, q, k, v, a, b, A_log, dt_bias, plan: LinearAttentionPlan) -> torch.Tensor:
        batch, T = plan.dst_idx.shape
        args = [t.view(batch, T, *t.shape[1:]) for t in (q, k, v, a, b)]
        if self.on_gpu:
            from lightllm.kernels.linear_attention.gated_delta_verify import gated_delta_verify

            out = gated_delta_verify(*args, A_log, dt_bias, self.state.ssm_layers[layer], plan.state_idx, plan.dst_idx)
        else:
            out = gated_delta_verify_ref(
                *args, A_log, dt_bias, self.state.ssm_layers[layer], plan.state_idx, plan.dst_idx
            )
        return out.view(v.shape)


def check_same_device(state_name: str, state: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Once per forward, what the kernels' public functions check per call: every input on the state's device."""
    for name, t in tensors.items():
        if t.device != state.device:
            raise ValueError(f"linear attention decode: {name} expected the {state_name} state's device "
                             f"{state.device}, got {t.device}")  # fmt: skip


def _fla_chunk(q, k, v, g, beta, plan: LinearAttentionPlan, initial_state=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """fla-core's chunked gated delta rule over the packed batch (batch dim 1, ``cu_seqlens``), q/k L2-normalized
    in the kernel, grouped value heads when Hv > Hk; each sequence from ``initial_state`` ``[N, Hv, Dk, Dv]``
    (float32; None: zeros). The plan's bounds are the same tensors for every layer, so fla's per-tensor cache
    derives its chunk indices once per forward."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # lazy: GPU only

    q, k, v, g, beta = (t.contiguous().unsqueeze(0) for t in (q, k, v, g, beta))  # q/k/v: views of the conv out
    out, finals = chunk_gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         cu_seqlens=plan.cu_seqlens, cu_seqlens_cpu=plan.cu_seqlens_cpu,
                                         chunk_indices=plan.chunk_indices)  # fmt: skip
    return out[0], finals


def _fla_recurrent(q, k, v, g, beta, plan: LinearAttentionPlan, initial_state=None) -> Tuple[torch.Tensor, ...]:
    """:func:`_fla_chunk`'s computation token by token: fla-core's fused recurrent gated delta rule, one launch over
    the same packing, same initial and final states (``g`` and ``beta`` by name: its fifth positional is ``gk``)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # lazy: GPU only

    q, k, v, g, beta = (t.contiguous().unsqueeze(0) for t in (q, k, v, g, beta))
    out, finals = fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=plan.cu_seqlens
    )  # fmt: skip
    return out[0], finals


def _token_layout(cu: torch.Tensor, lens: torch.Tensor, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each packed token's request and its index in it (int64 ``[tokens]``), on the device without waiting for it
    (``output_size``: the host knows the total)."""
    seq_ids = torch.repeat_interleave(torch.arange(lens.shape[0], device=cu.device), lens, output_size=tokens)
    return seq_ids, torch.arange(tokens, device=cu.device) - cu[seq_ids]


def static_chunk_indices(cu: torch.Tensor, chunk: int, rows: int) -> torch.Tensor:
    """fla's chunk indices (``[seq, chunk in seq]`` per ``chunk``-token chunk, in order) of the packing ``cu``, made
    on the device with a fixed ``rows`` (fla-core's ``prepare_chunk_indices_static``). fla marks rows past the real
    chunks with sequence -1, which its gated delta rule kernels do not skip; here they point at chunk 0 of the last
    sequence instead, which must be empty (every kernel masks all of its rows: it writes nothing)."""
    from fla.ops.utils.index import prepare_chunk_indices_static

    indices, _ = prepare_chunk_indices_static(cu, chunk, rows)
    seq, at = indices.unbind(1)
    spare = seq < 0
    return torch.stack([torch.where(spare, cu.shape[0] - 2, seq), torch.where(spare, 0, at)], 1)
