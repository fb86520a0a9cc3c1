"""Qwen3.5 model config: the text part of a Hugging Face folder's ``config.json``, read through transformers'
``AutoConfig`` and checked once.

Two folder kinds hold a Qwen3.5 text model: ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``, fields at the top)
and ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``, the text fields nested in ``text_config``, the
weights under ``model.language_model.``). Rope: transformers' Qwen3.5 builds its mrope tables from three copies
of the text positions, so for text-only prompts every section rotates by the same position and the rope is the
plain 1-D one over the first ``rotary_dim`` dims; ``mrope_section`` / ``mrope_interleaved`` are accepted.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from lightllm.models.hf_config import (
    ConfigFields,
    ModelLoadError,
    auto_config,
    check_model_type,
    read_config_file,
    rope_field,
    unsupported_rope,
)
from lightllm.models.qwen3.config import special_token_ids

TEXT_ARCHITECTURE = "Qwen3_5ForCausalLM"
MULTIMODAL_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
ARCHITECTURES = (TEXT_ARCHITECTURE, MULTIMODAL_ARCHITECTURE)
MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
LAYER_TYPES = ("linear_attention", "full_attention")
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


class _TextFields(ConfigFields):
    """Field errors of a nested ``text_config`` name it: ``field 'text_config.head_dim'``."""

    def __init__(self, path: Path, raw: Dict[str, Any], hf: Any, prefix: str):
        super().__init__(path, raw, hf)
        self.prefix = prefix

    def error(self, field: str, msg: str) -> ModelLoadError:
        return super().error(self.prefix + field, msg)


@dataclass(frozen=True)
class Qwen3_5ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: Tuple[str, ...]
    # gated (full) attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # the first ``rotary_dim`` dims of each head rotate (partial_rotary_factor * head_dim)
    rope_theta: float
    # gated DeltaNet (linear attention)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: Tuple[int, ...]
    bos_token_id: Optional[int]
    weight_prefix: str  # "model." (text folders) or "model.language_model." (ConditionalGeneration folders)
    multimodal: bool  # a ConditionalGeneration folder: its vision tower is skipped
    mtp_num_hidden_layers: int = 0  # decoder layers of the MTP head (``mtp.*`` weights); real checkpoints: 1

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones (the KV pool holds only these)."""
        return self.layer_types.count("full_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k (key heads) and v (value heads), concatenated."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_model_dir(cls, model_dir: Union[str, Path]) -> "Qwen3_5ModelConfig":
        """Read and check ``model_dir/config.json``; ModelLoadError (one line) on anything unsupported."""
        model_dir = Path(model_dir)
        path, raw = read_config_file(model_dir)
        archs = raw.get("architectures")
        if archs is None and raw.get("model_type") in MODEL_TYPES:
            archs = [ARCHITECTURES[MODEL_TYPES.index(raw["model_type"])]]
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise ModelLoadError(f"{path}: field 'architectures' is {archs!r} (model_type {raw.get('model_type')!r}); "
                                 f"supported: {', '.join(ARCHITECTURES)}")  # fmt: skip
        multimodal = MULTIMODAL_ARCHITECTURE in archs and TEXT_ARCHITECTURE not in archs
        hf = auto_config(model_dir)
        arch = MULTIMODAL_ARCHITECTURE if multimodal else TEXT_ARCHITECTURE
        check_model_type(path, hf, MODEL_TYPES[ARCHITECTURES.index(arch)], arch)
        if multimodal:
            text_raw = raw.get("text_config")
            if not isinstance(text_raw, dict):
                raise ModelLoadError(f"{path}: field 'text_config' must be an object for {MULTIMODAL_ARCHITECTURE}, "
                                     f"got {text_raw!r}")  # fmt: skip
            f = _TextFields(path, text_raw, hf.text_config, "text_config.")
        else:
            f = _TextFields(path, raw, getattr(hf, "text_config", hf), "")
        return _read(f, model_dir, multimodal, ConfigFields(path, raw, hf))


def _read(f: _TextFields, model_dir: Path, multimodal: bool, top: ConfigFields) -> Qwen3_5ModelConfig:
    hf = f.hf
    hidden = f.positive_int("hidden_size")
    heads = f.positive_int("num_attention_heads")
    kv_heads = f.positive_int("num_key_value_heads")
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = f.positive_int("head_dim", default=hf.head_dim)
    k_heads = f.positive_int("linear_num_key_heads", default=hf.linear_num_key_heads)
    v_heads = f.positive_int("linear_num_value_heads", default=hf.linear_num_value_heads)
    if v_heads % k_heads:
        raise f.error("linear_num_value_heads", f"({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})")
    layers = f.positive_int("num_hidden_layers")
    layer_types = hf.layer_types
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise f.error("layer_types", f"must list {layers} layer types (num_hidden_layers), got {layer_types!r}")
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise f.error("layer_types", f"has {', '.join(map(repr, bad))}; supported: {', '.join(LAYER_TYPES)}")
    if "full_attention" not in layer_types:
        raise f.error("layer_types", "has no 'full_attention' layer; the KV cache needs at least one")
    theta, rotary_dim = _rope(f, head_dim)
    if getattr(hf, "attention_bias", False) is True:
        raise f.error("attention_bias", "= True is not supported")
    if hf.hidden_act != "silu":
        raise f.error("hidden_act", f"must be 'silu', got {hf.hidden_act!r}")

    # A ConditionalGeneration model ties (or not) through the top-level field, as transformers reads it.
    tie = (top.hf if multimodal else hf).tie_word_embeddings
    if not isinstance(tie, bool):
        raise (top if multimodal else f).error("tie_word_embeddings", f"must be true or false, got {tie!r}")
    vocab = f.positive_int("vocab_size")
    eos, bos = special_token_ids(f, model_dir, vocab, outer=top if multimodal else None)
    return Qwen3_5ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.positive_int("intermediate_size"),
        num_hidden_layers=layers,
        layer_types=tuple(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=f.positive_int("linear_key_head_dim", default=hf.linear_key_head_dim),
        linear_value_head_dim=f.positive_int("linear_value_head_dim", default=hf.linear_value_head_dim),
        linear_conv_kernel_dim=_conv_kernel_dim(f, hf),
        rms_norm_eps=f.positive_float("rms_norm_eps"),
        max_position_embeddings=f.positive_int("max_position_embeddings", default=hf.max_position_embeddings),
        tie_word_embeddings=tie,
        eos_token_ids=eos,
        bos_token_id=bos,
        weight_prefix="model.language_model." if multimodal else "model.",
        multimodal=multimodal,
        mtp_num_hidden_layers=_mtp_layers(f),
    )


def _mtp_layers(f: _TextFields) -> int:
    """``mtp_num_hidden_layers`` (absent: 0), a non-negative integer."""
    value = f.raw.get("mtp_num_hidden_layers", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise f.error("mtp_num_hidden_layers", f"must be a non-negative integer, got {value!r}")
    return value


def _conv_kernel_dim(f: _TextFields, hf) -> int:
    """The linear attention's causal conv1d width: at least 2 (its state holds the ``K - 1`` tokens before the
    current one; no Qwen3.5 has fewer, and the kernels are not written for an empty state)."""
    width = f.positive_int("linear_conv_kernel_dim", default=hf.linear_conv_kernel_dim)
    if width < 2:
        raise f.error("linear_conv_kernel_dim", f"must be at least 2, got {width}")
    return width


def _rope(f: _TextFields, head_dim: int) -> Tuple[float, int]:
    """``(rope_theta, rotary_dim)``: plain rope (``rope_type`` 'default') over ``int(head_dim *
    partial_rotary_factor)`` dims; anything else is refused naming the field the file used."""
    params = f.hf.rope_parameters or {}
    if not isinstance(params, dict):
        raise f.error("rope_parameters", f"must be an object, got {params!r}")
    error = unsupported_rope(f, params, _ROPE_KEYS)
    if error is not None:
        raise error
    theta_field = rope_field(f.raw, "rope_theta") or "rope_parameters.rope_theta"
    theta = f.positive_float(theta_field, value=params.get("rope_theta", 10000.0))
    factor_field = rope_field(f.raw, "partial_rotary_factor") or "rope_parameters.partial_rotary_factor"
    factor = f.positive_float(factor_field, value=params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)  # transformers' rounding
    if factor > 1 or rotary_dim < 2 or rotary_dim % 2:
        raise f.error(factor_field, f"{factor} x head_dim {head_dim} must give an even number of rotary dims in "
                      f"[2, head_dim], got {rotary_dim}")  # fmt: skip
    return theta, rotary_dim
