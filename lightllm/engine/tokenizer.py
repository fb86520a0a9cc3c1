"""The model folder's tokenizer, loaded and checked the same way for the server and the offline ``LLM``."""

import logging
from typing import Optional

logger = logging.getLogger(__name__)

_PROBE = "Hello world"  # any usable tokenizer encodes it to some tokens


def load_tokenizer(model_dir: str, mode: str = "fast", chat_template: Optional[str] = None):
    """The model folder's tokenizer: ``mode`` fast, slow, or auto (fast, else slow); ``chat_template`` replaces
    the folder's template. ``ValueError`` naming ``--tokenizer_mode`` when that kind cannot load, and naming
    ``--model_dir`` when the folder has no usable tokenizer (transformers then builds an empty one)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=mode != "slow")
    except Exception as e:  # noqa: BLE001 - auto falls back to slow; fast and slow name what failed
        if mode != "auto":
            raise ValueError(
                f"--tokenizer_mode {mode}: the {mode} tokenizer of {model_dir} could not load "
                f"({type(e).__name__}: {e}); --tokenizer_mode takes fast, slow or auto"
            ) from None
        logger.info("--tokenizer_mode auto: no fast tokenizer (%s); loading the slow one", e)
        return load_tokenizer(model_dir, "slow", chat_template)
    if mode == "slow" and tokenizer.is_fast:  # transformers gives the fast one where no slow class exists
        raise ValueError(f"--tokenizer_mode slow: {model_dir} has no slow tokenizer; use fast or auto")
    if not tokenizer.encode(_PROBE, add_special_tokens=False):  # no tokenizer files: an empty vocabulary
        raise ValueError(f"--model_dir {model_dir}: no usable tokenizer (tokenizer.json, or vocab.json + "
                         "merges.txt): it encodes text to no tokens")  # fmt: skip
    if chat_template is not None:
        tokenizer.chat_template = chat_template
        logger.info("chat template: from --chat_template")
    return tokenizer
