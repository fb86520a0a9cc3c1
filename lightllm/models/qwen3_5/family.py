"""Qwen3.5 as a model family of the registry: text folders and the text part of ConditionalGeneration folders."""

from pathlib import Path

import torch

from lightllm.models.qwen3_5.config import ARCHITECTURES, MODEL_TYPES, Qwen3_5ModelConfig
from lightllm.models.qwen3_5.model import Qwen3_5Model
from lightllm.models.qwen3_5.tensor_parallel import check_divisible, shard_spec
from lightllm.models.qwen3_5.weights import load_qwen3_5_weights


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

    def build(self, model_dir: Path, config: Qwen3_5ModelConfig, dtype: torch.dtype, device: torch.device,
              tp_rank: int, tp: int) -> Qwen3_5Model:  # fmt: skip
        weights = load_qwen3_5_weights(model_dir, config, dtype, device, shard=shard_spec(config, tp_rank, tp))
        return Qwen3_5Model(config, weights, device, tp)
