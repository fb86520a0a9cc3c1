"""Reading a Hugging Face model folder's ``config.json``; every failure is one ``ModelLoadError`` line that names the
file and the field."""

import json
from pathlib import Path
from typing import Any, Dict, Tuple


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
    """``(path, fields)`` of ``model_dir/config.json`` as the file holds them."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model folder not found")
    path = model_dir / "config.json"
    return path, read_json(path)
