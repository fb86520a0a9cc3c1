"""Qwen3 model config: a Hugging Face folder's ``config.json`` read through transformers' ``AutoConfig``, checked
once and kept as this typed view.

Anything the Qwen3 forward does not implement (rope scaling, sliding window, attention biases, another
activation) is refused here with one line naming the file and the field, rather than producing wrong logits.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple, Union

from lightllm.models.hf_config import (
    ConfigFields,
    ModelLoadError,
    auto_config,
    check_model_type,
    read_config_file,
    read_json,
    rope_field,
    unsupported_rope,
)

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPE = "qwen3"


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

    @property
    def num_kv_layers(self) -> int:
        return self.num_hidden_layers  # every layer attends over the KV cache

    @classmethod
    def from_model_dir(cls, model_dir: Union[str, Path]) -> "Qwen3ModelConfig":
        """Read and check ``model_dir/config.json``; raise ModelLoadError on anything unsupported.

        ``eos_token_ids`` is config.json's ``eos_token_id`` (an int or a list) followed by any further ids from
        ``generation_config.json`` (instruct checkpoints list their chat end token there).
        """
        model_dir = Path(model_dir)
        path, raw = read_config_file(model_dir)
        archs = raw.get("architectures")
        if archs is None and raw.get("model_type") == MODEL_TYPE:
            archs = list(ARCHITECTURES)
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise ModelLoadError(f"{path}: field 'architectures' is {archs!r} (model_type {raw.get('model_type')!r}); "
                                 f"supported: {', '.join(ARCHITECTURES)}")  # fmt: skip
        f = ConfigFields(path, raw, auto_config(model_dir))
        hf = f.hf
        check_model_type(path, hf, MODEL_TYPE, ARCHITECTURES[0])

        hidden_size = f.positive_int("hidden_size")
        num_heads = f.positive_int("num_attention_heads")
        # Qwen3Config's defaults for these two (32 KV heads, head_dim 128) fit no small model; a file without them is
        # read as Qwen2-era modeling code read one: one KV head per head, hidden_size // heads (the weights' shapes
        # are checked, so a folder meant otherwise fails on q_proj's shape, never loads wrong).
        num_kv_heads = f.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise f.error("num_key_value_heads", f"({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        if raw.get("head_dim") is None and hidden_size % num_heads:
            raise f.error("head_dim", f"is missing and hidden_size ({hidden_size}) is not divisible by {num_heads}")
        head_dim = f.positive_int("head_dim", default=hidden_size // num_heads)
        if head_dim % 2:
            raise f.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
        vocab_size = f.positive_int("vocab_size")

        rope_theta = _rope_theta(f)
        for field in ("attention_bias", "use_sliding_window"):
            if getattr(hf, field, False) is True:
                raise f.error(field, "= True is not supported")
        act = hf.hidden_act
        if act != "silu":
            raise f.error("hidden_act", f"must be 'silu', got {act!r}")
        layer_types = hf.layer_types
        if layer_types is not None and (
            not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)
        ):
            raise f.error("layer_types", f"only 'full_attention' layers are supported, got {layer_types!r}")

        tie = hf.tie_word_embeddings
        if not isinstance(tie, bool):
            raise f.error("tie_word_embeddings", f"must be true or false, got {tie!r}")

        eos, bos = special_token_ids(f, model_dir, vocab_size)

        dtype = raw.get("torch_dtype", raw.get("dtype"))  # the file's name for it; transformers makes a torch.dtype
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
            rms_norm_eps=f.positive_float("rms_norm_eps"),
            rope_theta=rope_theta,
            max_position_embeddings=f.positive_int("max_position_embeddings", default=hf.max_position_embeddings),
            tie_word_embeddings=tie,
            eos_token_ids=eos,
            bos_token_id=bos,
            torch_dtype=dtype,
        )


def _rope_theta(f: ConfigFields) -> float:
    """The plain rope's theta. transformers folds the older top-level ``rope_theta`` / ``rope_scaling`` into
    ``rope_parameters``; anything but ``rope_type`` 'default' with ``rope_theta`` is refused, naming the field the
    file used."""
    params = f.hf.rope_parameters or {}
    if not isinstance(params, dict):
        raise f.error("rope_parameters", f"must be an object, got {params!r}")
    error = unsupported_rope(f, params, ("rope_type", "rope_theta"))
    if error is not None:
        raise error
    theta_field = rope_field(f.raw, "rope_theta") or "rope_parameters.rope_theta"
    return f.positive_float(theta_field, value=params.get("rope_theta", 10000.0))


def special_token_ids(
    f: ConfigFields, model_dir: Path, vocab: int, outer: Optional[ConfigFields] = None
) -> Tuple[Tuple[int, ...], Optional[int]]:
    """The end-of-sequence ids (the config's, then :func:`generation_eos`'s) and the begin id (or None), checked
    against ``vocab``. ``outer``: the top level of a config whose text model ``f`` is (a multimodal ``text_config``):
    an id set there wins over ``f``'s, as transformers' ``generate`` reads them (``GenerationConfig.from_model_config``
    takes the top level, then fills what it left unset from the text config)."""
    eos = _token_ids(f, outer, "eos_token_id", vocab)
    bos = _token_ids(f, outer, "bos_token_id", vocab, one=True)
    return eos + generation_eos(model_dir, exclude=eos, vocab=vocab), bos[0] if bos else None


def _token_ids(f: ConfigFields, outer: Optional[ConfigFields], field: str, vocab: int, one=False) -> Tuple[int, ...]:
    """``field``'s ids (at most one with ``one``) in ``outer`` (when given and set there), else in ``f``; () when
    neither has it."""
    src = outer if outer is not None and getattr(outer.hf, field, None) is not None else f
    value = getattr(src.hf, field, None)
    ids = () if value is None else src.token_ids(field, value)
    if one and len(ids) > 1:  # transformers checks this in a text config, not at a multimodal config's top level
        raise src.error(field, f"must be one token id, got {value!r}")
    if any(i >= vocab for i in ids):
        raise src.error(field, f"{list(ids)} out of range for vocab_size {vocab}")
    return ids


def generation_eos(model_dir: Path, exclude: Tuple[int, ...], vocab: int) -> Tuple[int, ...]:
    """``generation_config.json``'s ``eos_token_id`` ids not in ``exclude`` (Qwen instruct checkpoints list their
    chat end token there), in order, checked against config.json's ``vocab``; () without the file."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    f = ConfigFields(path, read_json(path))
    value = f.raw.get("eos_token_id")
    if value is None:
        return ()
    ids = f.token_ids("eos_token_id", value)
    if any(i >= vocab for i in ids):
        raise f.error("eos_token_id", f"{list(ids)} out of range for config.json's vocab_size {vocab}")
    return tuple(dict.fromkeys(i for i in ids if i not in exclude))
