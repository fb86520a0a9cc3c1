"""Sampling defaults of the OpenAI routes from the model folder's ``generation_config.json``: what a request
gets for ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` when it leaves them out."""

import json
import logging
import math
from pathlib import Path
from typing import Dict, Union

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# Checked like a request's fields (bodies.py).
_RANGES = {
    "temperature": ("a number in [0, 100]", lambda v: _number(v) and 0 <= v <= 100),
    "top_p": ("a number in (0, 1]", lambda v: _number(v) and 0 < v <= 1),
    "top_k": ("an integer >= -1 (-1 and 0: off)", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1),
    "min_p": ("a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
    "repetition_penalty": ("a number > 0", lambda v: _number(v) and v > 0),
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_sampling_defaults(model_dir: Union[str, Path]) -> Dict[str, Union[int, float]]:
    """The sampling fields the file sets (none without a file). ``do_sample: false`` means greedy: temperature 0.

    Read as plain JSON, not through ``GenerationConfig.from_pretrained``: that fills in transformers' own
    defaults (top_k 50) for keys the file leaves out, and a key the file leaves out is no default here.
    ``ValueError`` naming the file, key and value for one outside what a request may send."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        logger.info("sampling defaults: no %s; OpenAI routes default to temperature 1, top_p 1, top_k 0, min_p 0", FILE)
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: expected a JSON object ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    defaults = {}
    for key, (allowed, ok) in _RANGES.items():
        value = config.get(key)
        if value is None:
            continue
        if not ok(value):
            raise ValueError(f"{path}: {key} expected {allowed}, got {value!r}")
        defaults[key] = max(value, 0) if key == "top_k" else value  # top_k -1 (vLLM's "off") is this server's 0
    if config.get("do_sample") is False:  # greedy: top_p, top_k and min_p change nothing; a penalty still does
        defaults = {"temperature": 0.0, **{k: v for k, v in defaults.items() if k == "repetition_penalty"}}
    logger.info("sampling defaults of the OpenAI routes from %s: %s", path, defaults or "none set")
    return defaults
