"""Hugging Face ``architectures`` -> model family. The engine and the server ask here and never import a family,
so a new family is a folder under ``models/`` plus one entry below."""

from pathlib import Path
from typing import Dict, Tuple, Union

from lightllm.models.family import ModelConfig, ModelFamily
from lightllm.models.hf_config import ModelLoadError, read_config_file
from lightllm.models.qwen3.family import Qwen3Family
from lightllm.models.qwen3_5.family import Qwen3_5Family

_FAMILIES: Tuple[ModelFamily, ...] = (Qwen3Family(), Qwen3_5Family())
_BY_ARCHITECTURE: Dict[str, ModelFamily] = {a: f for f in _FAMILIES for a in f.architectures}
_BY_MODEL_TYPE: Dict[str, ModelFamily] = {
    t: f for f in _FAMILIES for t in f.model_types
}  # configs without architectures
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = tuple(_BY_ARCHITECTURE)


def family_for(architecture: str) -> ModelFamily:
    """The family serving ``architecture``; ModelLoadError naming it and the supported ones otherwise."""
    family = _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise ModelLoadError(f"architecture {architecture!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")  # fmt: skip
    return family


def model_family(model_dir: Union[str, Path]) -> ModelFamily:
    """The family of the folder's ``config.json`` ``architectures`` (its first supported name; without the field,
    its ``model_type``)."""
    path, raw = read_config_file(Path(model_dir))
    archs = raw.get("architectures")
    if archs is None and raw.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[raw["model_type"]]
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{path}: field 'architectures' expected a list of names such as "
                             f"{SUPPORTED_ARCHITECTURES[0]!r}, got {archs!r}")  # fmt: skip
    for a in archs:
        if a in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[a]
    raise ModelLoadError(f"{path}: field 'architectures' is {archs!r}, not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")  # fmt: skip


def read_model_config(model_dir: Union[str, Path]) -> Tuple[ModelFamily, ModelConfig]:
    """The folder's family and its checked config: every start-up check that needs no weights reads this."""
    family = model_family(model_dir)
    return family, family.read_config(Path(model_dir))
