"""What the engine and the server start-up may ask of a model family, whatever the architecture."""

from pathlib import Path
from typing import Any, Optional, Protocol, Tuple

import torch

from lightllm.layers.attention import AttentionBackend
from lightllm.layers.infer_state import InferState


class ModelConfig(Protocol):
    """The fields of a family's config that code outside ``models/`` reads."""

    vocab_size: int
    num_hidden_layers: int
    num_kv_layers: int  # layers with a KV cache (the pool's layer count): every layer of a dense model
    head_dim: int
    max_position_embeddings: int  # the model's context
    eos_token_ids: Tuple[int, ...]


class Model(Protocol):
    kv_heads: int  # this rank's KV heads: the KV pool is sized by them

    def set_attention(self, attn: AttentionBackend) -> None: ...

    def alloc_request_state(self, num_slots: int, ssm_dtype: torch.dtype, checkpoints: int = 0,
                            slots_per_request: int = 1) -> int:  # fmt: skip
        """Allocate per-request state kept beside the KV cache (linear-attention state; ``slots_per_request`` state
        rows per request row, request ``r``'s from row ``r * slots_per_request`` on, and ``checkpoints`` more for the
        prefix cache) before the KV cache is sized; its bytes, 0 for a model without any."""

    def save_state(self, row: int, checkpoint: int) -> None:
        """Copy state row ``row`` into prefix-cache checkpoint ``checkpoint`` (on the device's stream: the row may
        run again right after). Only for a model with state."""

    def load_state(self, checkpoint: int, row: int) -> None:
        """Copy checkpoint ``checkpoint`` into state row ``row``, which its request's prefill then continues."""

    def prefix_cache_blocker(self) -> Optional[str]:
        """Why a request can't start from another's cached KV prefix, as the state beside the KV that the prefix
        cache does not keep (logged after "the model's"), or None when it can (the KV cache is all the state a
        request has, or the state has checkpoints)."""

    def prefill_graph_blocker(self) -> Optional[str]:
        """Why a prefill padded with tokens after the request's own can't be replayed from a CUDA graph, as the
        state those tokens would change (logged after "the model's"), or None when padding rows change nothing
        but their own outputs and a scratch KV slot (then a prefill graph serves one request's new tokens)."""

    def prefill_graph_max_tokens(self) -> Optional[int]:
        """The most new tokens one of this model's prefill graphs serves, or None (no bound of its own beyond
        ``--prefill_graph_max_tokens``)."""

    def forward(self, input_ids: torch.Tensor, state: InferState) -> torch.Tensor: ...


class ModelFamily(Protocol):
    """One model family (``models/<family>/``): reads its config, checks a TP degree, loads and builds."""

    name: str
    architectures: Tuple[str, ...]  # Hugging Face ``architectures`` names it serves
    model_types: Tuple[str, ...]  # config.json's ``model_type`` values, for configs that give no ``architectures``

    def read_config(self, model_dir: Path) -> ModelConfig:
        """Read and check ``config.json``; ModelLoadError (one line) on anything the family does not implement."""

    def check_tp(self, config: Any, tp: int) -> None:
        """ValueError naming ``--tp`` and the model field it does not divide."""

    def kv_heads(self, config: Any, tp: int) -> int:
        """KV heads one rank holds."""

    def build(self, model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device, tp_rank: int,
              tp: int, mtp: bool = False, mtp_dir: Optional[Path] = None) -> Model:  # fmt: skip
        """Load this rank's shard of the weights and build the forward module (``mtp``: with its MTP head as
        ``model.mtp``, read from ``mtp_dir`` when given, else from ``model_dir``; only a family with
        ``mtp_support`` is asked)."""

    # Optional: ``mtp_support(model_dir, config, mode) -> Optional[str]``, why ``--mtp_mode mode`` can't run (None:
    # it can), and ``mtp_draft_support(draft_dir, config) -> Optional[str]``, why another folder can't give the head.
    # A family without them serves no MTP.
