"""Reading a Hugging Face model folder's ``config.json``: through transformers' ``AutoConfig``, with every failure
turned into one ``ModelLoadError`` line that names the file and the field."""

import json
from pathlib import Path
from typing import Any, Collection, Dict, Optional, Tuple

_FROM_CONFIG = object()


class ModelLoadError(ValueError):
    """A model folder that cannot be served: the message is one line naming the file and the field or tensor."""


def read_json(path: Path) -> Dict[str, Any]:
    """Parse a JSON object from ``path``; a missing file, bad JSON or a non-object raises ModelLoadError."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config_file(model_dir: Path) -> Tuple[Path, Dict[str, Any]]:
    """``(path, fields)`` of ``model_dir/config.json`` as the file holds them. They say what the file really
    gives: ``AutoConfig`` fills a missing field with its class default (``hidden_size`` 4096, ``head_dim`` 128),
    which fits no other model."""
    if not model_dir.is_dir():
        what = "is a file, not a model folder" if model_dir.exists() else "model folder not found"
        raise ModelLoadError(f"{model_dir}: {what}")
    path = model_dir / "config.json"
    raw = read_json(path)
    check_unquantized(path, raw)
    return path, raw


def check_unquantized(path: Path, raw: Dict[str, Any]) -> None:
    """A quantized checkpoint (FP8, GPTQ, AWQ, bitsandbytes: ``quantization_config`` at the top or in
    ``text_config``) refused by name, before its tensors' dtypes or shapes fail the load with a message that does
    not say why."""
    text = raw.get("text_config")
    for field, where in (("quantization_config", raw), ("text_config.quantization_config", text)):
        quant = where.get("quantization_config") if isinstance(where, dict) else None
        if quant is not None:
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            named = f" (quant_method {method!r})" if method is not None else ""
            raise ModelLoadError(f"{path}: field {field!r}{named}: quantized checkpoints are not supported; only "
                                 "unquantized F16, BF16 or F32 weights load")  # fmt: skip


def auto_config(model_dir: Path) -> Any:
    """transformers' ``AutoConfig`` of the folder (offline); its errors, often several lines, become one."""
    from transformers import AutoConfig  # lazy: transformers takes seconds to import

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers' validators raise many types, each multi-line
        cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__) else e
        first = str(cause).strip().split("\n\n")[0]  # drop the upgrade advice after the first paragraph
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: transformers cannot read it: {' '.join(first.split())}"
        ) from None


def check_model_type(path: Path, hf: Any, expected: str, architecture: str) -> None:
    """``architecture`` reads only a config of ``model_type`` ``expected``: another (a Qwen3 config renamed
    Qwen3.5) gives transformers' config class of that type, without this architecture's fields."""
    model_type = getattr(hf, "model_type", None)
    if model_type != expected:
        raise ModelLoadError(f"{path}: field 'model_type' is {model_type!r}, expected {expected!r} for {architecture}")


class ConfigFields:
    """Typed, checked access to a config's fields; every error names the file and the field.

    Values come from transformers' config (``hf``); ``raw`` (the file's own fields) tells a missing field apart
    from transformers' default."""

    def __init__(self, path: Path, raw: Dict[str, Any], hf: Any = None):
        self.path = path
        self.raw = raw
        self.hf = hf

    def error(self, field: str, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: field '{field}' {msg}")

    def value(self, field: str) -> Any:
        if self.raw.get(field) is None:
            return None
        return getattr(self.hf, field) if self.hf is not None else self.raw[field]

    def positive_int(self, field: str, default: Optional[int] = None) -> int:
        """A positive int the file must give, or ``default`` when it doesn't (and a default is given)."""
        value = self.value(field)
        if value is None:
            if default is None:
                raise self.error(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(field, f"must be a positive integer, got {value!r}")
        return value

    def positive_float(self, field: str, value: Any = _FROM_CONFIG) -> float:
        """``field`` (or ``value`` when given, for nested fields) as a positive float."""
        value = getattr(self.hf, field) if value is _FROM_CONFIG else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise self.error(field, f"must be a positive number, got {value!r}")
        return float(value)

    def token_ids(self, field: str, value: Any) -> Tuple[int, ...]:
        ids = value if isinstance(value, list) else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise self.error(field, f"must be a token id or a list of token ids, got {value!r}")
        return tuple(ids)


def unsupported_rope(f: ConfigFields, params: Dict[str, Any], allowed: Collection[str]) -> Optional[ModelLoadError]:
    """The error for rope parameters (transformers' ``rope_parameters``) other than plain rope, ``rope_type`` (or its
    old spelling ``type``) 'default' with only the ``allowed`` keys; None when they are plain. It names the offending
    keys as the file spells them (:func:`rope_field`), so that the user sees what to change."""
    kind = params.get("rope_type", params.get("type", "default"))
    bad = ["rope_type"] if kind != "default" else []
    bad += [key for key in params if key not in allowed and key not in ("rope_type", "type")]
    if not bad:
        return None
    plain = f"only plain rope is supported: rope_type 'default' with {', '.join(sorted(set(allowed) - {'rope_type'}))}"
    # Keys transformers adds itself (original_max_position_embeddings for yarn) are named only if nothing else is.
    paths = list(dict.fromkeys(path for path in (_rope_path(f.raw, key) for key in bad) if path))
    if not paths:
        return f.error(f"rope_parameters.{bad[0]}", f"is {json.dumps(params[bad[0]])}; {plain}")
    prefix = getattr(f, "prefix", "")
    also = f" (and {', '.join(repr(prefix + '.'.join(p)) for p in paths[1:])})" if len(paths) > 1 else ""
    value = f.raw
    for part in paths[0]:
        value = value[part]
    return f.error(".".join(paths[0]), f"is {json.dumps(value)}{also}; {plain}")


def rope_field(raw: Dict[str, Any], key: str) -> Optional[str]:
    """Where the file sets transformers' ``rope_parameters[key]``, which folds top-level fields (``rope_theta``,
    ``partial_rotary_factor``) and ``rope_scaling`` (taken over ``rope_parameters``; ``type`` for ``rope_type``)
    into it: ``rope_scaling.<key>``, ``rope_parameters.<key>`` or the top-level ``key``; None if the file does not
    set it."""
    path = _rope_path(raw, key)
    return None if path is None else ".".join(path)


def _rope_path(raw: Dict[str, Any], key: str) -> Optional[Tuple[str, ...]]:
    """:func:`rope_field`'s place as the keys to follow (a key may itself hold a dot)."""
    outer = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    given = raw.get(outer) if isinstance(raw.get(outer), dict) else {}
    if key in given:
        return (outer, key)
    if key == "rope_type" and "type" in given:
        return (outer, "type")  # the old spelling
    return (key,) if key in raw else None


def checkpoint_dtype(model_dir: Path) -> Optional[str]:
    """The dtype config.json names (``torch_dtype``, or transformers 5's ``dtype``; a multimodal folder's
    ``text_config`` when the top level names none), as written (``"bfloat16"``), or None."""
    _, raw = read_config_file(Path(model_dir))
    for cfg in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        value = cfg.get("torch_dtype", cfg.get("dtype"))
        if isinstance(value, str):
            return value
    return None
