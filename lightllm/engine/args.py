"""Engine options, named like the server flags, validated and normalized in one place."""

import logging
import os
import re
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Union, get_args, get_origin

import torch

from lightllm.common.kv_cache.req_to_token import MAX_TOKEN_INDEX
from lightllm.layers.attention import (
    DECODE_BACKEND_CHOICES,
    KV_TYPES,
    PREFILL_BACKEND_CHOICES,
    check_fa3_flags,
    pick_decode_backend,
    pick_prefill_backend,
)
from lightllm.layers.linear_attention import SSM_DATA_TYPES

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQ_TOTAL_LEN = 16384  # LightLLM's default when --max_req_total_len is not given, capped at the context
DEFAULT_KV_QUANT_GROUP_SIZE = 8
DEFAULT_PREFILL_GRAPH_MAX_TOKENS = 512  # prompts up to this skip the eager prefill's host cost; small graphs
# short batches get decode graphs of their own: at B=1 one graph up to 32K loses up to 11-19 % (decode_attention.md)
DEFAULT_GRAPH_LEN_BUCKETS = ()  # one bucket: a 4096 bucket closed no frozen-config loss on the H200
_PATH_FIELDS = ("model_dir", "mtp_draft_model_dir")  # a str or os.PathLike, made a str
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
DATA_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16, "float32": torch.float32}  # fmt: skip
DATA_TYPE_CHOICES = ("auto", *DATA_TYPES)  # auto: the checkpoint's own dtype (config.json), bf16 if it names none
MTP_MODES = ("vanilla_with_att", "eagle_with_att", "vanilla_no_att", "eagle_no_att")  # LightLLM's --mtp_mode values
MAX_MTP_STEP = 4


@dataclass
class EngineArgs:
    model_dir: Optional[str] = None  # None: the built-in tiny model
    data_type: str = "auto"  # resolved by fit_to_model from config.json's dtype
    running_max_req_size: int = 64
    max_req_total_len: Optional[int] = None  # None: DEFAULT_MAX_REQ_TOTAL_LEN, capped at the model's context
    batch_max_tokens: int = 4096
    chunked_prefill_size: int = 4096  # LightLLM's default; a longer prompt is prefilled in pieces of at most this
    disable_chunked_prefill: bool = False
    enable_mixed_chunk: bool = False  # a chunk step also carries the running requests' decode tokens (one forward)
    disable_dynamic_prompt_cache: bool = False  # the prefix cache (radix tree over finished requests' KV) is on
    disable_overlap_schedule: bool = False  # decode steps overlap: the next launches before the last is read
    graph_max_batch_size: int = 64
    graph_split_batch_size: int = 16
    graph_grow_step_size: int = 16
    graph_max_len_in_batch: int = 0  # 0: max_req_total_len (LightLLM's meaning and default)
    graph_len_buckets: Sequence[int] = DEFAULT_GRAPH_LEN_BUCKETS  # decode graphs per KV length bucket; () or 0: one
    disable_cudagraph: bool = False
    prefill_graph_max_tokens: int = DEFAULT_PREFILL_GRAPH_MAX_TOKENS  # one request's prefill up to this: a graph; 0 off
    llm_kv_type: str = "None"
    llm_kv_quant_group_size: int = DEFAULT_KV_QUANT_GROUP_SIZE
    llm_decode_att_backend: str = "triton"  # "auto" is resolved by fit_to_model, once the device and dtype are known
    llm_prefill_att_backend: str = "auto"  # resolved by fit_to_model, after the decode backend
    linear_att_ssm_data_type: str = "float32"  # linear-attention recurrent state (Qwen3.5); unused by Qwen3
    linear_att_cache_size: Optional[int] = None  # prefix cache state checkpoints (Qwen3.5); None: running_max_req_size
    mem_fraction: float = 0.9
    max_total_token_num: Optional[int] = None  # explicit KV pool size; default: from mem_fraction (GPU)
    device: Optional[str] = None  # default: cuda if available
    mtp_mode: Optional[str] = None  # MTP speculative decoding (LightLLM's modes); None: off
    mtp_step: int = 0  # draft tokens per step with --mtp_mode (1-4)
    mtp_draft_model_dir: Optional[str] = None  # the MTP head's folder; None: --model_dir (its mtp.* head)

    def normalize(self) -> "EngineArgs":
        """Validate every option (``ValueError`` naming the flag) and derive what depends on others."""
        self._check_types()
        if self.data_type not in DATA_TYPE_CHOICES:
            raise ValueError(f"--data_type expected one of {DATA_TYPE_CHOICES}, got {self.data_type!r}")
        for name in ("running_max_req_size", "max_req_total_len", "batch_max_tokens", "chunked_prefill_size",
                     "graph_max_batch_size",
                     "graph_split_batch_size", "graph_grow_step_size", "graph_max_len_in_batch",
                     "llm_kv_quant_group_size"):  # fmt: skip
            value = getattr(self, name)
            if (name == "max_req_total_len" and value is None) or (name == "graph_max_len_in_batch" and value == 0):
                continue  # resolved against the model's context by fit_to_model
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                off = " (--disable_chunked_prefill turns chunking off)" if name == "chunked_prefill_size" else ""
                raise ValueError(f"--{name} expected a positive integer, got {value!r}{off}")
        self.graph_len_buckets = _check_len_buckets(self.graph_len_buckets)
        value = self.prefill_graph_max_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"--prefill_graph_max_tokens expected a non-negative integer (0 turns prefill graphs "
                             f"off), got {value!r}")  # fmt: skip
        if self.llm_kv_type not in KV_TYPES:
            raise ValueError(f"--llm_kv_type expected one of {KV_TYPES}, got {self.llm_kv_type!r}")
        if self.llm_decode_att_backend not in DECODE_BACKEND_CHOICES:
            raise ValueError(f"--llm_decode_att_backend expected one of {DECODE_BACKEND_CHOICES}, "
                             f"got {self.llm_decode_att_backend!r}")  # fmt: skip
        if self.llm_prefill_att_backend not in PREFILL_BACKEND_CHOICES:
            raise ValueError(f"--llm_prefill_att_backend expected one of {PREFILL_BACKEND_CHOICES}, "
                             f"got {self.llm_prefill_att_backend!r}")  # fmt: skip
        if self.linear_att_ssm_data_type not in SSM_DATA_TYPES:
            raise ValueError(f"--linear_att_ssm_data_type expected one of {tuple(SSM_DATA_TYPES)}, "
                             f"got {self.linear_att_ssm_data_type!r}")  # fmt: skip
        if self.linear_att_cache_size is None:
            self.linear_att_cache_size = self.running_max_req_size
        value = self.linear_att_cache_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"--linear_att_cache_size expected a non-negative integer (0: no state checkpoints, the "
                             f"prefix cache then off for Qwen3.5), got {value!r}")  # fmt: skip
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"--mem_fraction expected a value in (0, 1], got {self.mem_fraction!r}")
        if self.max_total_token_num is not None and self.max_total_token_num <= 0:
            raise ValueError(f"--max_total_token_num expected a positive integer, got {self.max_total_token_num!r}")
        if self.max_total_token_num is not None and self.max_total_token_num > MAX_TOKEN_INDEX + 1:
            raise ValueError(f"--max_total_token_num expected at most {MAX_TOKEN_INDEX + 1} (the KV cache's token "
                             f"indices are int32), got {self.max_total_token_num}")  # fmt: skip
        if self.device is not None and not _DEVICE.fullmatch(self.device):
            raise ValueError(f"--device expected cpu, cuda or cuda:N, got {self.device!r}")
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda"):
            _check_gpu_visible(self.device)
        check_fa3_flags(self.attention_backends(), torch.device(self.device), self.llm_kv_type, None)
        self._check_mtp()
        if self.enable_mixed_chunk and (self.disable_chunked_prefill or self.mtp_mode is not None):
            other = "--disable_chunked_prefill" if self.disable_chunked_prefill else "--mtp_mode"
            raise ValueError(f"--enable_mixed_chunk expected chunked prefill without MTP (mixed steps carry one decode "
                             f"token per request), got it with {other}")  # fmt: skip
        if self.mtp_mode is not None and self.graph_len_buckets and self.graph_len_buckets[0] < self.spec_tokens:
            raise ValueError(f"--graph_len_buckets expected lengths of at least {self.spec_tokens} with --mtp_step "
                             f"{self.mtp_step} (a verify step's tokens), got {self.graph_len_buckets[0]}")  # fmt: skip
        if not self.disable_cudagraph and self.graph_max_batch_size > self.running_max_req_size:
            logger.info("graph_max_batch_size %d -> %d (running_max_req_size): larger graphs can never be used",
                        self.graph_max_batch_size, self.running_max_req_size)  # fmt: skip
            self.graph_max_batch_size = self.running_max_req_size
        return self

    def _check_types(self) -> None:
        """Each option's type, from its annotation (the offline API takes any value): a bool for a switch, an
        integer (not a bool) for a count, a number for a fraction, a string (a path too for a folder)."""
        for f in fields(self):
            value, kind = getattr(self, f.name), f.type
            optional = get_origin(kind) is Union and type(None) in get_args(kind)
            if optional:
                if value is None:
                    continue
                kind = next(a for a in get_args(kind) if a is not type(None))
            if f.name == "llm_kv_type" and value is None:  # the flag's "None" (no quantization) as Python's None
                self.llm_kv_type, ok = "None", True
            elif kind is bool:
                ok, allowed = isinstance(value, bool), "a bool (True or False)"
            elif kind is int:
                ok, allowed = isinstance(value, int) and not isinstance(value, bool), "an integer"
            elif kind is float:
                ok, allowed = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            elif kind is str and f.name in _PATH_FIELDS:  # a Path is taken, and kept as its str
                path = os.fspath(value) if isinstance(value, os.PathLike) else value
                # "" (an unset variable in a launcher's --model_dir "$MODEL") must not mean the built-in model
                ok, allowed = isinstance(path, str) and path.strip() != "", "a folder path (str or os.PathLike)"
                if ok:
                    setattr(self, f.name, path)
            elif kind is str:
                ok, allowed = isinstance(value, str), "a string"
            else:  # graph_len_buckets: _check_len_buckets
                continue
            if not ok:
                none = " or None" if optional else ""
                raise ValueError(f"--{f.name} expected {allowed}{none}, got {value!r} ({type(value).__name__})")

    def _check_mtp(self) -> None:
        if self.mtp_mode is None:
            if self.mtp_step != 0 or self.mtp_draft_model_dir is not None:
                given = f"--mtp_step {self.mtp_step}" if self.mtp_step != 0 else "--mtp_draft_model_dir"
                raise ValueError(f"{given} expected --mtp_mode (one of {MTP_MODES}) to turn MTP on")
            return
        if self.mtp_mode not in MTP_MODES:
            raise ValueError(f"--mtp_mode expected one of {MTP_MODES}, got {self.mtp_mode!r}")
        step = self.mtp_step
        if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_MTP_STEP:
            raise ValueError(f"--mtp_step expected an integer in [1, {MAX_MTP_STEP}] with --mtp_mode, got {step!r}")

    def attention_backends(self) -> dict:
        """{flag: backend} of the two attention backend flags."""
        return {"--llm_decode_att_backend": self.llm_decode_att_backend,
                "--llm_prefill_att_backend": self.llm_prefill_att_backend}  # fmt: skip

    @property
    def spec_tokens(self) -> int:
        """KV tokens one request takes per decode step: 1, or ``mtp_step + 1`` with MTP (verify)."""
        return self.mtp_step + 1 if self.mtp_mode is not None else 1

    def fit_to_model(self, context_len: int, head_dim: int, checkpoint_dtype: Optional[str] = None) -> "EngineArgs":
        """Check and derive what depends on the model (its context ``max_position_embeddings``, head_dim and the
        dtype its config.json names), before any weight is loaded. Idempotent: the server calls it at parse time,
        the runner again."""
        if self.data_type == "auto":
            self.data_type = checkpoint_dtype if checkpoint_dtype in DATA_TYPES else "bf16"
            why = (
                "the checkpoint's dtype"
                if checkpoint_dtype in DATA_TYPES
                else (f"config.json names {'no dtype' if checkpoint_dtype is None else repr(checkpoint_dtype)}")
            )
            logger.info("data_type auto -> %s (%s)", self.data_type, why)
        # the attention backends' "auto" once the dtype is known: FA3 runs 16-bit models only
        device, dtype = torch.device(self.device), self.torch_dtype
        self.llm_decode_att_backend = pick_decode_backend(self.llm_decode_att_backend, device, self.llm_kv_type, dtype)
        self.llm_prefill_att_backend = pick_prefill_backend(self.llm_prefill_att_backend, self.llm_decode_att_backend)
        check_fa3_flags(self.attention_backends(), device, self.llm_kv_type, dtype)
        if self.max_req_total_len is None:
            self.max_req_total_len = min(DEFAULT_MAX_REQ_TOTAL_LEN, context_len)
            if context_len < DEFAULT_MAX_REQ_TOTAL_LEN:
                logger.info("max_req_total_len %d -> %d: the model's context (max_position_embeddings)",
                            DEFAULT_MAX_REQ_TOTAL_LEN, context_len)  # fmt: skip
        elif self.max_req_total_len > context_len:
            raise ValueError(f"--max_req_total_len {self.max_req_total_len} expected at most the model's context, "
                             f"max_position_embeddings {context_len}")  # fmt: skip
        if self.max_req_total_len < 2:  # a prompt has a token and an answer another: no request would fit
            raise ValueError(f"--max_req_total_len expected at least 2 (one prompt token and one generated), got "
                             f"{self.max_req_total_len} (max_position_embeddings {context_len})")  # fmt: skip
        self.graph_max_len_in_batch = min(self.graph_max_len_in_batch or self.max_req_total_len, self.max_req_total_len)
        longest = self.graph_max_len_in_batch
        dropped = [b for b in self.graph_len_buckets if b >= longest]
        if dropped and not self.disable_cudagraph:
            logger.info("graph_len_buckets: %s dropped, not below --graph_max_len_in_batch %d (its own bucket)",
                        ", ".join(map(str, dropped)), longest)  # fmt: skip
        self.graph_len_buckets = tuple(b for b in self.graph_len_buckets if b < longest)
        row = self.max_req_total_len + self.spec_tokens - 1  # a verify step writes its drafts past the context
        if self.max_total_token_num is not None and self.max_total_token_num - 1 < row:
            drafts = f" + --mtp_step {self.mtp_step}" if self.mtp_mode is not None else ""
            raise ValueError(f"--max_total_token_num {self.max_total_token_num} expected at least {row + 1}: one "
                             f"--max_req_total_len ({self.max_req_total_len}){drafts} request plus the padding "
                             "token")  # fmt: skip
        group = self.llm_kv_quant_group_size
        if self.llm_kv_type == "None":
            if group != DEFAULT_KV_QUANT_GROUP_SIZE:
                logger.warning("--llm_kv_quant_group_size %d is unused with --llm_kv_type None", group)
        else:
            span = head_dim // 2  # decode reads each row as two halves (INT4 packs them): a group lies in one
            if span % group:
                raise ValueError(f"--llm_kv_quant_group_size {group} expected a divisor of the model's head_dim / 2 "
                                 f"= {span} (--llm_kv_type {self.llm_kv_type})")  # fmt: skip
        return self

    @property
    def prefill_step_tokens(self) -> int:
        """Most prompt tokens one prefill step carries: ``batch_max_tokens``, and with chunked prefill also at most
        ``chunked_prefill_size`` (a longer prompt is split). Without chunking a longer prompt still runs, alone."""
        if self.disable_chunked_prefill:
            return self.batch_max_tokens
        return min(self.batch_max_tokens, self.chunked_prefill_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.data_type == "auto":
            raise RuntimeError("data_type 'auto' is resolved by fit_to_model(...) from the model's config first")
        return DATA_TYPES[self.data_type]

    def graph_batch_sizes(self) -> List[int]:
        """1..graph_split_batch_size, then steps of graph_grow_step_size, up to the cap (ascending)."""
        cap = self.graph_max_batch_size
        sizes = list(range(1, min(self.graph_split_batch_size, cap) + 1))
        nxt = sizes[-1] + self.graph_grow_step_size
        while nxt <= cap:
            sizes.append(nxt)
            nxt += self.graph_grow_step_size
        if sizes[-1] != cap:
            sizes.append(cap)
        return sizes

    def graph_lens(self) -> List[int]:
        """The KV length buckets decode graphs are captured for (ascending): ``graph_len_buckets`` below
        ``graph_max_len_in_batch``, then ``graph_max_len_in_batch`` itself. After :meth:`fit_to_model`."""
        return [*self.graph_len_buckets, self.graph_max_len_in_batch]

    def summary(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def _check_len_buckets(value) -> tuple:
    """``--graph_len_buckets`` as a sorted tuple of distinct positive ints; empty, or a lone 0, is one bucket."""
    allowed = "distinct positive integers (KV lengths), or none / a lone 0 for one bucket per batch size"
    values = [value] if isinstance(value, int) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ValueError(f"--graph_len_buckets expected {allowed}, got {value!r}")
    values = list(values)
    if values == [0]:
        return ()
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad or len(set(values)) != len(values):
        why = f"{bad[0]!r} in {values}" if bad else f"duplicates in {values}"
        raise ValueError(f"--graph_len_buckets expected {allowed}, got {why}")
    return tuple(sorted(values))


def _check_gpu_visible(device: str) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise ValueError(f"--device {device} expected a visible CUDA GPU, but {count} are visible"
                         + ("; use --device cpu" if count == 0 else ""))  # fmt: skip
