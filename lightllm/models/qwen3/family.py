"""Qwen3 as a model family of the registry."""

from pathlib import Path

import torch

from lightllm.models.qwen3.config import ARCHITECTURES, MODEL_TYPE, Qwen3ModelConfig
from lightllm.models.qwen3.model import Qwen3Model
from lightllm.models.qwen3.tensor_parallel import check_divisible, local_heads, shard_spec
from lightllm.models.qwen3.weights import load_qwen3_weights


class Qwen3Family:
    name = "Qwen3"
    architectures = ARCHITECTURES
    model_types = (MODEL_TYPE,)

    def read_config(self, model_dir: Path) -> Qwen3ModelConfig:
        return Qwen3ModelConfig.from_model_dir(model_dir)

    def check_tp(self, config: Qwen3ModelConfig, tp: int) -> None:
        check_divisible(config, tp)

    def kv_heads(self, config: Qwen3ModelConfig, tp: int) -> int:
        return local_heads(config, tp)[1]

    def build(self, model_dir: Path, config: Qwen3ModelConfig, dtype: torch.dtype, device: torch.device,
              tp_rank: int, tp: int) -> Qwen3Model:  # fmt: skip
        weights = load_qwen3_weights(model_dir, config, dtype, device, shard=shard_spec(config, tp_rank, tp))
        return Qwen3Model(config, weights, device, tp)
