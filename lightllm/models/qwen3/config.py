"""Qwen3 model config, read from a Hugging Face folder's ``config.json`` and checked once.

Anything the Qwen3 forward does not implement (rope scaling, sliding window, attention biases, another
activation) is refused here with one line naming the file and the field, rather than producing wrong logits.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from lightllm.models.hf_config import ModelLoadError, read_json

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPE = "qwen3"
_FROM_DATA = object()


class _Fields:
    """Typed access to config.json fields; every error names the file and the field."""

    def __init__(self, path: Path, data: Dict[str, Any]):
        self.path = path
        self.data = data

    def error(self, field: str, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: field '{field}' {msg}")

    def positive_int(self, field: str, default: Optional[int] = None) -> int:
        value = self.data.get(field)
        if value is None:
            if default is None:
                raise self.error(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(field, f"must be a positive integer, got {value!r}")
        return value

    def positive_float(self, field: str, default: float, value: Any = _FROM_DATA) -> float:
        """``data[field]`` (or ``value`` when given, for nested fields) as a positive float; null -> default."""
        if value is _FROM_DATA:
            value = self.data.get(field)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise self.error(field, f"must be a positive number, got {value!r}")
        return float(value)

    def token_ids(self, field: str, value: Any) -> Tuple[int, ...]:
        ids = value if isinstance(value, list) else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise self.error(field, f"must be a token id or a list of token ids, got {value!r}")
        return tuple(ids)


@dataclass(frozen=True)
class Qwen3ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: Tuple[int, ...]
    bos_token_id: Optional[int]
    torch_dtype: Optional[str]

    @classmethod
    def from_model_dir(cls, model_dir: Union[str, Path]) -> "Qwen3ModelConfig":
        """Read and check ``model_dir/config.json``; raise ModelLoadError on anything unsupported.

        ``eos_token_ids`` is config.json's ``eos_token_id`` (an int or a list) followed by any further ids from
        ``generation_config.json`` (instruct checkpoints list their chat end token there).
        """
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"{model_dir}: model folder not found")
        path = model_dir / "config.json"
        f = _Fields(path, read_json(path))
        d = f.data

        archs = d.get("architectures")
        if archs is None and d.get("model_type") == MODEL_TYPE:
            archs = list(ARCHITECTURES)
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise f.error(
                "architectures",
                f"is {archs!r} (model_type {d.get('model_type')!r}); supported: {', '.join(ARCHITECTURES)}",
            )

        hidden_size = f.positive_int("hidden_size")
        num_heads = f.positive_int("num_attention_heads")
        num_kv_heads = f.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise f.error("num_key_value_heads", f"({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        if d.get("head_dim") is None and hidden_size % num_heads:
            raise f.error("head_dim", f"is missing and hidden_size ({hidden_size}) is not divisible by {num_heads}")
        head_dim = f.positive_int("head_dim", default=hidden_size // num_heads)
        if head_dim % 2:
            raise f.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
        vocab_size = f.positive_int("vocab_size")

        rope_theta = _rope_theta(f)
        for field, unsupported in (("attention_bias", True), ("use_sliding_window", True)):
            if d.get(field) is unsupported:
                raise f.error(field, f"= {unsupported} is not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise f.error("hidden_act", f"must be 'silu', got {act!r}")
        layer_types = d.get("layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)
        ):
            raise f.error("layer_types", f"only 'full_attention' layers are supported, got {layer_types!r}")

        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise f.error("tie_word_embeddings", f"must be true or false, got {tie!r}")

        eos = f.token_ids("eos_token_id", d["eos_token_id"]) if d.get("eos_token_id") is not None else ()
        eos += _generation_eos(model_dir, exclude=eos)
        bos = d.get("bos_token_id")
        if bos is not None:
            (bos,) = f.token_ids("bos_token_id", bos)
        for field, ids in (("eos_token_id", eos), ("bos_token_id", () if bos is None else (bos,))):
            if any(i >= vocab_size for i in ids):
                raise f.error(field, f"{list(ids)} out of range for vocab_size {vocab_size}")

        dtype = d.get("torch_dtype", d.get("dtype"))
        if dtype is not None and not isinstance(dtype, str):
            raise f.error("torch_dtype", f"must be a string, got {dtype!r}")

        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=f.positive_int("intermediate_size"),
            num_hidden_layers=f.positive_int("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.positive_float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=f.positive_int("max_position_embeddings", default=32768),
            tie_word_embeddings=tie,
            eos_token_ids=eos,
            bos_token_id=bos,
            torch_dtype=dtype,
        )


def _rope_theta(f: _Fields) -> float:
    """``rope_theta`` from the top level (older configs) or ``rope_parameters`` (transformers >= 5)."""
    scaling = f.data.get("rope_scaling")
    if scaling is not None:
        raise f.error("rope_scaling", f"is not supported (must be null), found {json.dumps(scaling)}")
    params = f.data.get("rope_parameters")
    if params is None:
        return f.positive_float("rope_theta", 10000.0)
    if not isinstance(params, dict):
        raise f.error("rope_parameters", f"must be an object, got {params!r}")
    extra = sorted(set(params) - {"rope_type", "rope_theta"})
    if params.get("rope_type", "default") != "default" or extra:
        raise f.error(
            "rope_parameters", f"only plain rope (rope_type 'default') is supported, found {json.dumps(params)}"
        )
    theta = params.get("rope_theta", f.data.get("rope_theta"))
    return f.positive_float("rope_parameters.rope_theta", 10000.0, value=theta)


def _generation_eos(model_dir: Path, exclude: Tuple[int, ...]) -> Tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    f = _Fields(path, read_json(path))
    value = f.data.get("eos_token_id")
    if value is None:
        return ()
    ids = f.token_ids("eos_token_id", value)
    return tuple(dict.fromkeys(i for i in ids if i not in exclude))
