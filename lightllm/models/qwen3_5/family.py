"""Qwen3.5 as a model family of the registry: text folders and the text part of ConditionalGeneration folders."""

from pathlib import Path
from typing import Optional

import torch

from lightllm.models.hf_config import ModelLoadError
from lightllm.models.qwen3_5.config import ARCHITECTURES, MODEL_TYPES, Qwen3_5ModelConfig
from lightllm.models.qwen3.weights import open_safetensors, safetensors_files
from lightllm.models.qwen3_5.model import Qwen3_5Model
from lightllm.models.qwen3_5.mtp import Qwen3_5MTP
from lightllm.models.qwen3_5.tensor_parallel import check_divisible, shard_spec
from lightllm.models.qwen3_5.weights import MTP_PREFIX, load_qwen3_5_weights

MTP_MODES = ("eagle_with_att",)  # Qwen3.5's one in-checkpoint MTP layer, reused for every draft step
# What the head takes from the main model's config (layer shapes, rotary, norms, the shared embedding / lm_head):
# a separate head folder's config.json must agree on each.
MTP_SHARED_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "rotary_dim", "rope_theta", "rms_norm_eps")  # fmt: skip


class Qwen3_5Family:
    name = "Qwen3.5"
    architectures = ARCHITECTURES
    model_types = MODEL_TYPES

    def read_config(self, model_dir: Path) -> Qwen3_5ModelConfig:
        return Qwen3_5ModelConfig.from_model_dir(model_dir)

    def check_tp(self, config: Qwen3_5ModelConfig, tp: int) -> None:
        check_divisible(config, tp)

    def kv_heads(self, config: Qwen3_5ModelConfig, tp: int) -> int:
        return config.num_key_value_heads // tp

    def mtp_support(self, model_dir: Path, config: Qwen3_5ModelConfig, mode: str) -> Optional[str]:
        """Why ``--mtp_mode mode`` can't run with the head in ``model_dir`` (the model's folder or
        ``--mtp_draft_model_dir``), or None when it can."""
        if mode not in MTP_MODES:
            return (f"the checkpoint's single MTP layer, reused for every draft step, is --mtp_mode "
                    f"{MTP_MODES[0]}; {mode} is not served")  # fmt: skip
        if config.mtp_num_hidden_layers not in (0, 1):
            return f"mtp_num_hidden_layers is {config.mtp_num_hidden_layers}; only 1 is supported"
        if not has_mtp_weights(model_dir):
            return "its safetensors files hold no MTP head (mtp.* weights)"
        return None

    def mtp_draft_support(self, draft_dir: Path, config: Qwen3_5ModelConfig) -> Optional[str]:
        """Why ``draft_dir`` (``--mtp_draft_model_dir``, another folder) can't give the MTP head of the model whose
        config is ``config``, or None when it can: its config.json must agree on every field the head's shapes and
        math take from the main model's config."""
        try:
            draft = self.read_config(draft_dir)
        except ModelLoadError as e:
            return f"expected a Qwen3.5 folder with a config.json: {e}"
        for name in MTP_SHARED_FIELDS:
            if getattr(draft, name) != getattr(config, name):
                return (f"its config.json {name} is {getattr(draft, name)}, --model_dir's is {getattr(config, name)}; "
                        "the MTP head must match the main model")  # fmt: skip
        if draft.mtp_num_hidden_layers not in (0, 1):
            return f"mtp_num_hidden_layers is {draft.mtp_num_hidden_layers}; only 1 is supported"
        return None  # its mtp.* weights: mtp_support

    def build(self, model_dir: Path, config: Qwen3_5ModelConfig, dtype: torch.dtype, device: torch.device,
              tp_rank: int, tp: int, mtp: bool = False, mtp_dir: Optional[Path] = None) -> Qwen3_5Model:  # fmt: skip
        weights = load_qwen3_5_weights(model_dir, config, dtype, device, shard=shard_spec(config, tp_rank, tp),
                                       mtp=mtp, mtp_dir=mtp_dir)  # fmt: skip
        model = Qwen3_5Model(config, weights, device, tp)
        if mtp:
            model.mtp = Qwen3_5MTP(model, weights.mtp)
        return model


def has_mtp_weights(model_dir: Path) -> bool:
    """Whether the folder's safetensors files name any ``mtp.*`` tensor (headers only); ModelLoadError naming a file
    that is not one."""
    for file in safetensors_files(Path(model_dir)):
        with open_safetensors(file) as f:
            if any(name.startswith(MTP_PREFIX) for name in f.keys()):
                return True
    return False
