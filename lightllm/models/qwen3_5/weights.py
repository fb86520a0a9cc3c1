"""Qwen3.5 weights from a Hugging Face folder's ``*.safetensors`` files (text folders and the text part of
ConditionalGeneration folders).

Linears stay ``[out_features, in_features]`` (each also as an ``[in, out]`` view, ``qkv_t``, ``in_t`` ..., made at
load for ``torch.mm``). Projections of one input are fused at load into one weight each (one
GEMM): gated attention's q (with its gate), k and v into ``qkv_proj``; gated DeltaNet's qkv, z, b and a into
``in_proj``; the MLP's gate and up into ``gate_up_proj``. Each part is read (this rank's shard of it only) and
copied straight into its rows; the checkpoint names remain as views. The zero-centred RMSNorm weights (decoder,
final, q/k norms) are kept as ``1 + weight`` in float32, the scale transformers multiplies by; the gated norm's
weight is plain. The
vision tower (``model.visual.*``) is skipped with one log line; so is the MTP head (``mtp.*``) unless it is asked
for (``mtp=True``: ``--mtp_mode``), when it loads as :class:`MTPWeights`, from the model's folder or from another
one (``--mtp_draft_model_dir``) whose other tensors are skipped with one line.

The MTP head, in the real checkpoints' names (``mtp_num_hidden_layers`` = 1): ``mtp.fc`` ``[hidden, 2 * hidden]``
over ``[pre_fc_norm_embedding(embed(token)); pre_fc_norm_hidden(hidden)]``, one full-attention decoder layer
``mtp.layers.0.*`` (the main layers' names), ``mtp.norm``; the embedding and ``lm_head`` are the main model's.
Its norms are zero-centred like the main ones.
"""

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from lightllm.models.hf_config import ModelLoadError
from lightllm.models.qwen3.weights import (
    LM_HEAD,
    GateUpViews,
    checked_tensors,
    open_safetensors,
    safetensors_files,
    tied_lm_head,
    unknown_tensors_note,
)
from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig
from lightllm.models.qwen3_5.tensor_parallel import ShardSpec

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ZERO_CENTRED = ("input_norm", "post_norm", "q_norm", "k_norm")
_SKIPPED = {"model.visual.": "vision tower: text only", "mtp.": "MTP head: --mtp_mode is off"}
MTP_PREFIX = "mtp."
MTP_LAYER = "mtp"  # the MTP decoder layer's key among the loaded layers


# Checkpoint fields read into rows of one fused weight: field -> (fused weight, its place among the parts).
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
               "in_proj_a": ("in_proj", 3),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


@dataclass
class LayerWeights(GateUpViews):
    """One layer's weights (this rank's shard in tensor parallelism). The projections read from one input are
    fused into one weight each (one GEMM); the checkpoint's names remain as views of their rows."""

    kind: str  # "linear_attention" or "full_attention"
    input_norm: torch.Tensor  # [hidden], 1 + weight, float32
    post_norm: torch.Tensor  # [hidden], 1 + weight, float32
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up
    down_proj: torch.Tensor  # [hidden, intermediate]
    # full attention
    qkv_proj: Optional[torch.Tensor] = None  # [heads * 2 * head_dim + 2 * kv_heads * head_dim, hidden]: q, k, v
    o_proj: Optional[torch.Tensor] = None  # [hidden, heads * head_dim]
    q_norm: Optional[torch.Tensor] = None  # [head_dim], 1 + weight, float32
    k_norm: Optional[torch.Tensor] = None
    # gated DeltaNet
    in_proj: Optional[torch.Tensor] = None  # [C + Hv * Dv + 2 * Hv, hidden]: qkv (the conv input), z, b, a
    conv1d: Optional[torch.Tensor] = None  # [C, K] (HF's [C, 1, K] squeezed)
    A_log: Optional[torch.Tensor] = None  # [Hv]
    dt_bias: Optional[torch.Tensor] = None  # [Hv]
    norm: Optional[torch.Tensor] = None  # [Dv], the gated norm's plain weight
    out_proj: Optional[torch.Tensor] = None  # [hidden, Hv * Dv]

    def __post_init__(self):
        # The linears as [in, out] views, made once (those of the layer's kind; None for the other's): a GEMM is then
        # one ``torch.mm(x, w_t)``, the very call ``F.linear(x, w)`` makes, without its two extra dispatches.
        self.gate_up_t, self.down_t = self.gate_up_proj.t(), self.down_proj.t()
        self.qkv_t, self.o_t = _transposed(self.qkv_proj), _transposed(self.o_proj)
        self.in_t, self.out_t = _transposed(self.in_proj), _transposed(self.out_proj)

    @property
    def q_proj(self) -> Optional[torch.Tensor]:
        """``[heads * 2 * head_dim, hidden]``: per head ``[query | gate]`` rows."""
        return self._parts("qkv_proj")[0]

    @property
    def k_proj(self) -> Optional[torch.Tensor]:
        return self._parts("qkv_proj")[1]

    @property
    def v_proj(self) -> Optional[torch.Tensor]:
        return self._parts("qkv_proj")[2]

    @property
    def in_proj_qkv(self) -> Optional[torch.Tensor]:
        return self._parts("in_proj")[0]

    @property
    def in_proj_z(self) -> Optional[torch.Tensor]:
        return self._parts("in_proj")[1]

    @property
    def in_proj_b(self) -> Optional[torch.Tensor]:
        return self._parts("in_proj")[2]

    @property
    def in_proj_a(self) -> Optional[torch.Tensor]:
        return self._parts("in_proj")[3]

    def split_sizes(self, fused: str) -> Tuple[int, ...]:
        """Rows of each part of ``qkv_proj`` (q, k, v) or ``in_proj`` (qkv, z, b, a), from the layer's own shapes."""
        if fused == "qkv_proj":
            q_rows = 2 * self.o_proj.shape[1]
            kv_rows = (self.qkv_proj.shape[0] - q_rows) // 2
            return q_rows, kv_rows, kv_rows
        value_heads = self.A_log.shape[0]
        return self.conv1d.shape[0], self.out_proj.shape[1], value_heads, value_heads

    def _parts(self, fused: str) -> Tuple[Optional[torch.Tensor], ...]:
        weight = getattr(self, fused)
        if weight is None:
            return (None,) * 4
        return weight.split(self.split_sizes(fused))


@dataclass
class MTPWeights:
    """The MTP head (embedding and ``lm_head`` shared with the main model)."""

    fc: torch.Tensor  # [hidden, 2 * hidden]: columns of the normed embedding, then of the normed hidden state
    norm_embedding: torch.Tensor  # [hidden], 1 + weight, float32
    norm_hidden: torch.Tensor  # [hidden], 1 + weight, float32
    layer: LayerWeights  # one full-attention decoder layer
    final_norm: torch.Tensor  # [hidden], 1 + weight, float32

    def __post_init__(self):
        self.fc_t = self.fc.t()  # [2 * hidden, hidden]: one ``torch.mm`` per draft step, as the layers' linears


def _transposed(weight: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if weight is None else weight.t()


@dataclass
class Qwen3_5Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: List[LayerWeights]
    final_norm: torch.Tensor  # [hidden], 1 + weight, float32
    lm_head: torch.Tensor  # the same object as ``embed`` when tied (see ``tied_lm_head``)
    mtp: Optional[MTPWeights] = None  # loaded only when asked for


def _layer_names(c: Qwen3_5ModelConfig, i) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """``field -> (HF tensor name, shape)`` of layer ``i`` (``MTP_LAYER``: the MTP head's decoder layer)."""
    mtp = i == MTP_LAYER
    p, h = f"{MTP_PREFIX}layers.0." if mtp else f"{c.weight_prefix}layers.{i}.", c.hidden_size
    names = {
        "input_norm": ("input_layernorm.weight", (h,)),
        "post_norm": ("post_attention_layernorm.weight", (h,)),
        "gate_proj": ("mlp.gate_proj.weight", (c.intermediate_size, h)),
        "up_proj": ("mlp.up_proj.weight", (c.intermediate_size, h)),
        "down_proj": ("mlp.down_proj.weight", (h, c.intermediate_size)),
    }
    if mtp or c.layer_types[i] == "full_attention":
        q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        names.update({
            "q_proj": ("self_attn.q_proj.weight", (2 * q_out, h)),
            "k_proj": ("self_attn.k_proj.weight", (kv_out, h)),
            "v_proj": ("self_attn.v_proj.weight", (kv_out, h)),
            "o_proj": ("self_attn.o_proj.weight", (h, q_out)),
            "q_norm": ("self_attn.q_norm.weight", (c.head_dim,)),
            "k_norm": ("self_attn.k_norm.weight", (c.head_dim,)),
        })  # fmt: skip
    else:
        hv, vd = c.linear_num_value_heads, c.linear_value_dim
        names.update({
            "in_proj_qkv": ("linear_attn.in_proj_qkv.weight", (c.linear_conv_dim, h)),
            "in_proj_z": ("linear_attn.in_proj_z.weight", (vd, h)),
            "in_proj_b": ("linear_attn.in_proj_b.weight", (hv, h)),
            "in_proj_a": ("linear_attn.in_proj_a.weight", (hv, h)),
            "conv1d": ("linear_attn.conv1d.weight", (c.linear_conv_dim, 1, c.linear_conv_kernel_dim)),
            "A_log": ("linear_attn.A_log", (hv,)),
            "dt_bias": ("linear_attn.dt_bias", (hv,)),
            "norm": ("linear_attn.norm.weight", (c.linear_value_head_dim,)),
            "out_proj": ("linear_attn.out_proj.weight", (h, vd)),
        })  # fmt: skip
    return {field: (p + name, shape) for field, (name, shape) in names.items()}


def _mtp_names(c: Qwen3_5ModelConfig) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """``field -> (HF tensor name, shape)`` of the MTP head's own tensors (its layer: ``_layer_names``)."""
    h = c.hidden_size
    return {"fc": ("mtp.fc.weight", (h, 2 * h)), "norm_embedding": ("mtp.pre_fc_norm_embedding.weight", (h,)),
            "norm_hidden": ("mtp.pre_fc_norm_hidden.weight", (h,)),
            "final_norm": ("mtp.norm.weight", (h,))}  # fmt: skip


def _layers(c: Qwen3_5ModelConfig, mtp: bool) -> list:
    return list(range(c.num_hidden_layers)) + ([MTP_LAYER] if mtp else [])


def expected_shapes(c: Qwen3_5ModelConfig, mtp: bool = False) -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name the checkpoint holds, with its shape (``lm_head`` may be absent when tied; ``mtp.*``
    only with ``mtp``)."""
    shapes = {f"{c.weight_prefix}embed_tokens.weight": (c.vocab_size, c.hidden_size),
              f"{c.weight_prefix}norm.weight": (c.hidden_size,), LM_HEAD: (c.vocab_size, c.hidden_size)}  # fmt: skip
    for i in _layers(c, mtp):
        shapes.update(dict(_layer_names(c, i).values()))
    if mtp:
        shapes.update(dict(_mtp_names(c).values()))
    return shapes


def _fused_rows(c: Qwen3_5ModelConfig, shard: Optional[ShardSpec]) -> Dict[str, Tuple[str, int, int]]:
    """``field -> (fused weight, first row, end row)`` of each fused part on this rank (every layer of a kind
    alike): each part is sharded first (a rank keeps its heads of q, of k, of v...), then the parts follow
    each other in ``FUSED_PARTS`` order."""
    full = {field: shape[0] for i in range(c.num_hidden_layers) for field, (_, shape) in _layer_names(c, i).items()}
    rows, ends = {}, {}
    for field, (target, _) in sorted(FUSED_PARTS.items(), key=lambda item: item[1]):
        if field not in full:  # a model without layers of that kind
            continue
        part = shard(field) if shard is not None else None
        local = full[field] if part is None else sum(len(range(full[field])[s]) for s in part[1])
        first = ends.get(target, 0)
        ends[target] = first + local
        rows[field] = (target, first, ends[target])
    return rows


def load_qwen3_5_weights(
    model_dir: Union[str, Path],
    config: Qwen3_5ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[str, torch.device] = "cpu",
    shard: Optional[ShardSpec] = None,
    mtp: bool = False,
    mtp_dir: Optional[Union[str, Path]] = None,
) -> Qwen3_5Weights:
    """Read, check (shape, source dtype), cast and move every tensor the text model uses; ModelLoadError (one
    line) on a missing or misshapen tensor. Unused tensors are skipped: vision and MTP ones with one line each,
    any other with one warning. ``shard(field)`` gives the part of a layer tensor this tensor-parallel rank
    keeps; only that part is read. The parts of a fused weight (``FUSED_PARTS``) are copied straight into its
    rows as they are read, so no second copy of them is ever held. ``mtp``: the MTP head too (``MTPWeights``),
    from ``mtp_dir`` when given (``--mtp_draft_model_dir``: its other tensors are skipped with one line), else
    from ``model_dir``."""
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
    model_dir = Path(model_dir)
    head_dir = Path(mtp_dir) if mtp and mtp_dir is not None else model_dir
    for folder in (model_dir, head_dir):
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: model folder not found")
    apart = head_dir.resolve() != model_dir.resolve()
    config = _with_files_prefix(model_dir, config)
    read = _Reader(config, dtype, device, shard, mtp)
    main = expected_shapes(config, mtp and not apart)
    skipped = {**_SKIPPED, MTP_PREFIX: f"MTP head: read from {head_dir}"} if apart else _SKIPPED
    read.folder(model_dir, main, skipped, warn_unexpected=True)
    if apart:
        head = {name: shape for name, shape in expected_shapes(config, True).items() if name not in main}
        read.folder(head_dir, head, {"": "not mtp.*: only the MTP head is read from here"}, warn_unexpected=False)
    return _assemble(config, read.tensors, read.fused, mtp, model_dir)


def _with_files_prefix(model_dir: Path, c: Qwen3_5ModelConfig) -> Qwen3_5ModelConfig:
    """``c``, reading the weights under ``model.language_model.`` where a text folder's files have them there (a
    text model cut out of a ConditionalGeneration checkpoint): transformers strips ``language_model.`` from them."""
    multimodal_prefix = "model.language_model."
    if c.weight_prefix == multimodal_prefix:
        return c
    names = set()
    for file in safetensors_files(model_dir):
        with open_safetensors(file) as f:
            names.update(f.keys())
    if f"{c.weight_prefix}embed_tokens.weight" in names or f"{multimodal_prefix}embed_tokens.weight" not in names:
        return c
    return dataclasses.replace(c, weight_prefix=multimodal_prefix)


class _Reader:
    """Reads the checkpoint's tensors into ``tensors`` (by HF name) and ``fused`` (by layer and fused weight)."""

    def __init__(self, config: Qwen3_5ModelConfig, dtype: torch.dtype, device, shard: Optional[ShardSpec],
                 mtp: bool):  # fmt: skip
        self.config, self.dtype, self.device, self.shard, self.mtp = config, dtype, device, shard, mtp
        self.where = {
            name: (i, field) for i in _layers(config, True) for field, (name, _) in _layer_names(config, i).items()
        }
        self.fused_rows = _fused_rows(config, shard)
        self.tensors: Dict[str, torch.Tensor] = {}
        self.fused: Dict[Tuple[int, str], torch.Tensor] = {}

    def folder(self, folder: Path, shapes: Dict[str, Tuple[int, ...]], skipped_reasons: Dict[str, str],
               warn_unexpected: bool) -> None:  # fmt: skip
        """Every tensor of ``shapes`` from ``folder``; the others are counted per prefix of ``skipped_reasons``
        (one line each) or, past those, warned about (``warn_unexpected``) or ignored."""
        c, shard = self.config, self.shard
        skipped = {prefix: 0 for prefix in skipped_reasons}
        unexpected: List[str] = []

        def unknown(name: str) -> None:
            prefix = next((p for p in skipped_reasons if name.startswith(p)), None)
            if prefix is not None:
                skipped[prefix] += 1
            else:
                unexpected.append(name)

        def missing_hint(name: str) -> str:
            if self.mtp and name.startswith(MTP_PREFIX):
                return "; --mtp_mode needs the checkpoint's MTP head (mtp.* weights)"
            return unknown_tensors_note(unexpected)

        # A tied checkpoint may still hold lm_head.weight (``tied_lm_head`` decides which tensor projects).
        optional = (LM_HEAD,) if c.tie_word_embeddings else ()
        for f, name, view in checked_tensors(folder, shapes, unknown, missing_hint, optional):
            layer, field = self.where.get(name, (None, None))
            part = shard(field) if shard is not None and field is not None else None
            if field in FUSED_PARTS:
                self._into_fused(f, name, view, layer, field, part)
                continue
            if part is None:
                tensor = f.get_tensor(name)
            else:
                dim, slices = part
                tensor = torch.cat([view[s] if dim == 0 else view[:, s] for s in slices], dim=dim)
            self.tensors[name] = tensor.to(device=self.device, dtype=self.dtype)
        for prefix, count in skipped.items():
            if count:
                what = f"{prefix}* tensors" if prefix else "tensors"
                logger.info("%s: skipping %d %s (%s)", folder, count, what, skipped_reasons[prefix])
        if unexpected and warn_unexpected:
            more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
            logger.warning("%s: ignoring %d tensors Qwen3.5 does not use: %s%s", folder, len(unexpected),
                           ", ".join(sorted(unexpected)[:5]), more)  # fmt: skip

    def _into_fused(self, f, name: str, view, layer, field: str, part) -> None:
        target, first, end = self.fused_rows[field]
        if (layer, target) not in self.fused:
            rows = max(e for t, _, e in self.fused_rows.values() if t == target)
            self.fused[layer, target] = torch.empty(rows, self.config.hidden_size, dtype=self.dtype,
                                                    device=self.device)  # fmt: skip
        dest = self.fused[layer, target]
        if part is None:
            dest[first:end].copy_(f.get_tensor(name))
        else:  # row shards only: each slice into the next rows
            for s in part[1]:
                rows = view[s]
                dest[first : first + rows.shape[0]].copy_(rows)
                first += rows.shape[0]


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


def _assemble(c: Qwen3_5ModelConfig, tensors: Dict[str, torch.Tensor], fused: Dict[Tuple[int, str], torch.Tensor],
              mtp: bool, model_dir: Path) -> Qwen3_5Weights:  # fmt: skip
    layers = [_assemble_layer(c, i, tensors, fused) for i in range(c.num_hidden_layers)]
    embed = tensors[f"{c.weight_prefix}embed_tokens.weight"]
    lm_head = tensors.pop(LM_HEAD, None)
    if c.tie_word_embeddings:
        lm_head = tied_lm_head(embed, lm_head, model_dir, logger)
    head = None
    if mtp:
        own = {field: tensors[name] for field, (name, _) in _mtp_names(c).items()}
        layer = _assemble_layer(c, MTP_LAYER, tensors, fused)
        head = MTPWeights(fc=own["fc"], norm_embedding=_one_plus(own["norm_embedding"]),
                          norm_hidden=_one_plus(own["norm_hidden"]), layer=layer,
                          final_norm=_one_plus(own["final_norm"]))  # fmt: skip
    return Qwen3_5Weights(embed=embed, layers=layers, final_norm=_one_plus(tensors[f"{c.weight_prefix}norm.weight"]),
                          lm_head=lm_head, mtp=head)  # fmt: skip


def _assemble_layer(c: Qwen3_5ModelConfig, i, tensors: Dict[str, torch.Tensor],
                    fused: Dict[Tuple[int, str], torch.Tensor]) -> LayerWeights:  # fmt: skip
    fields = {field: tensors[name] for field, (name, _) in _layer_names(c, i).items() if field not in FUSED_PARTS}
    fields.update({target: weight for (layer, target), weight in fused.items() if layer == i})
    for field in _ZERO_CENTRED:
        if field in fields:
            fields[field] = _one_plus(fields[field])
    if "conv1d" in fields:
        fields["conv1d"] = fields["conv1d"][:, 0, :].contiguous()
    return LayerWeights(kind="full_attention" if i == MTP_LAYER else c.layer_types[i], **fields)
