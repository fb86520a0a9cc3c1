"""Qwen3.5 as a model family of the registry: text folders and the text part of ConditionalGeneration folders."""

from pathlib import Path

import torch

from lightllm.models.qwen3_5.config import ARCHITECTURES, MODEL_TYPES, Qwen3_5ModelConfig
from lightllm.models.qwen3_5.model import Qwen3_5Model
from lightllm.models.qwen3_5.weights import load_qwen3_5_weights


class Qwen3_5Family:
    name = "Qwen3.5"
    architectures = ARCHITECTURES
    model_types = MODEL_TYPES

    def read_config(self, model_dir: Path) -> Qwen3_5ModelConfig:
        return Qwen3_5ModelConfig.from_model_dir(model_dir)

    def check_tp(self, config: Qwen3_5ModelConfig, tp: int) -> None:
        if tp != 1:
            raise ValueError(f"--tp {tp}: Qwen3.5 runs on one rank only for now (tensor parallelism of its linear "
                             "attention is not implemented); use --tp 1")  # fmt: skip

    def kv_heads(self, config: Qwen3_5ModelConfig, tp: int) -> int:
        return config.num_key_value_heads // tp

    def build(self, model_dir: Path, config: Qwen3_5ModelConfig, dtype: torch.dtype, device: torch.device,
              tp_rank: int, tp: int) -> Qwen3_5Model:  # fmt: skip
        self.check_tp(config, tp)
        return Qwen3_5Model(config, load_qwen3_5_weights(model_dir, config, dtype, device), device)
