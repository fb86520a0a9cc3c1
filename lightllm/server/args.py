"""Command line of ``python -m lightllm.server.api_server``: LightLLM's flag names, each validated."""

import argparse
import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from lightllm.common import envs
from lightllm.engine.args import DATA_TYPE_CHOICES, MTP_MODES, EngineArgs
from lightllm.engine.mtp_runner import check_mtp
from lightllm.layers.attention import DECODE_BACKEND_CHOICES, KV_TYPES, PREFILL_BACKEND_CHOICES, check_head_dim
from lightllm.layers.linear_attention import SSM_DATA_TYPES
from lightllm.models.hf_config import ModelLoadError, checkpoint_dtype
from lightllm.models.registry import model_family
from lightllm.server.reasoning import REASONING_PARSERS
from lightllm.server.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

_HELP = {
    "model_dir": "Hugging Face model folder (default: the built-in tiny model, generated on first use)",
    "data_type": "weights and activations dtype; auto (default): the checkpoint's own (config.json), bf16 if it "
    "names none",
    "running_max_req_size": "most requests decoding at once",
    "max_req_total_len": "most tokens of one request (prompt + output); default 16384, capped at the model's "
    "max_position_embeddings",
    "batch_max_tokens": "most prompt tokens in one prefill batch",
    "chunked_prefill_size": "prefill a longer prompt in chunks of at most this many tokens, a decode step of the "
    "running requests between chunks (LightLLM's default 4096)",
    "disable_chunked_prefill": "prefill every prompt in one piece (a prompt over --batch_max_tokens runs alone)",
    "enable_mixed_chunk": "a chunk's prefill step also carries the running requests' decode tokens, one forward "
    "instead of a chunk step and a decode step (needs chunked prefill; not with --mtp_mode); default off",
    "disable_dynamic_prompt_cache": "turn off the prefix cache (a radix tree keeping finished requests' KV for "
    "later prompts that start the same way)",
    "disable_overlap_schedule": "read each decode step's tokens before the next step is launched (default: the "
    "next decode step is launched from the tokens still on the GPU, so the host's work for a step runs while the "
    "GPU computes the next)",
    "graph_max_batch_size": "largest decode CUDA graph (capped at running_max_req_size)",
    "graph_split_batch_size": "decode graphs for every batch size up to this",
    "graph_grow_step_size": "then one graph every this many",
    "graph_max_len_in_batch": "longest request a decode graph serves; longer batches decode eagerly; 0: "
    "max_req_total_len (default)",
    "graph_len_buckets": "KV lengths below --graph_max_len_in_batch that get decode graphs of their own (each tuned "
    "and sized for its bucket; a batch replays the smallest bucket holding its longest request); default: none "
    "(one bucket, graph_max_len_in_batch)",
    "disable_cudagraph": "decode and prefill eagerly (no graphs, no decode-attention tuning scope)",
    "prefill_graph_max_tokens": "a prefill step of one request with at most this many new tokens replays a CUDA "
    "graph (padded to the next of 16, 32, 64, ... up to this; Qwen3.5: at most 512); 0: prefill eagerly",
    "llm_kv_type": "KV cache type",
    "llm_kv_quant_group_size": "INT8/INT4 KV quantization group size along head_dim",
    "llm_decode_att_backend": "decode attention kernels; auto: fa3 on a Hopper GPU with an FA3 provider installed "
    "that runs the model's dtype and an unquantized KV cache, else triton",
    "llm_prefill_att_backend": "prefill attention kernels: triton (Triton context attention) or fa3 (FlashAttention-3 "
    "over the KV pool; a build without paged KV gives each request a fixed row, which turns the prefix cache off); "
    "auto: fa3 with --llm_decode_att_backend fa3 and a provider without paged KV (the same provider and KV "
    "layout), else triton",
    "linear_att_ssm_data_type": "dtype of the linear-attention recurrent state (Qwen3.5); float32 or bfloat16",
    "linear_att_cache_size": "linear-attention state checkpoints the prefix cache keeps (Qwen3.5; each one request's "
    "state, counted before the KV cache is sized): a finished request leaves one after its tokens, and a cached "
    "prefix is reused up to the deepest checkpoint on it; default running_max_req_size; 0: none (the prefix cache is "
    "then off for Qwen3.5)",
    "mem_fraction": "fraction of GPU memory the server may use, KV cache sized after a profiling forward "
    "(CPU: fraction of available RAM for the KV cache)",
    "max_total_token_num": "KV cache size in tokens (overrides mem_fraction)",
    "device": "cuda, cuda:N or cpu (default: cuda when available)",
    "mtp_mode": "MTP speculative decoding (default off); Qwen3.5's in-checkpoint MTP layer, reused for every draft "
    "step, is eagle_with_att",
    "mtp_step": "draft tokens per decode step with --mtp_mode, 1-4",
    "mtp_draft_model_dir": "folder of the MTP head: its mtp.* weights and a config.json matching --model_dir's "
    "(default: --model_dir, which must then hold mtp.* weights)",
}
_OPTIONAL_TYPES = {
    "model_dir": str,
    "max_req_total_len": int,
    "max_total_token_num": int,
    "device": str,
    "mtp_draft_model_dir": str,
    "linear_att_cache_size": int,
}  # fields defaulting to None
_CHOICES = {
    "data_type": list(DATA_TYPE_CHOICES),
    "llm_kv_type": list(KV_TYPES),
    "llm_decode_att_backend": list(DECODE_BACKEND_CHOICES),
    "llm_prefill_att_backend": list(PREFILL_BACKEND_CHOICES),
    "linear_att_ssm_data_type": list(SSM_DATA_TYPES),
    "mtp_mode": list(MTP_MODES),
}


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 1
    health_step_timeout_s: float = 60.0
    tp_step_timeout_s: float = 300.0
    shutdown_drain_s: float = 30.0
    request_read_timeout_s: float = 30.0
    max_request_body_bytes: int = 4 << 20  # a body over this gets a 413 before it is parsed
    model_name: Optional[str] = None  # None: the model folder's name (lightllm-tiny-qwen3 for the built-in one)
    tokenizer_mode: str = "fast"
    trust_remote_code: bool = False
    eos_id: Tuple[int, ...] = ()  # extra ids that end a request, beside the model's own
    chat_template: Optional[str] = None  # the template's text once parsed (the flag takes a file or the text)
    nccl_port: Optional[int] = None  # None: a free port
    reasoning_parser: Optional[str] = None  # None: reasoning stays in the chat answer's content
    tool_call_parser: Optional[str] = None  # None: tool calls stay in the chat answer's content
    linear_att_hash_page_size: Optional[int] = None  # LightLLM's; accepted and logged as unused


TOKENIZER_MODES = ("fast", "slow", "auto")


_SERVER_HELP = {
    "tp": "tensor-parallel GPUs",
    "health_step_timeout_s": (
        "/health answers 503 while one engine step has run longer than this, or no step has run for this long"
    ),
    "tp_step_timeout_s": "with --tp > 1: a step some rank has not finished after this ends the server, naming it",
    "shutdown_drain_s": "on SIGTERM/SIGINT, wait this long for in-flight requests, then abort the rest",
    "request_read_timeout_s": "close a connection that has not sent a whole request within this",
    "max_request_body_bytes": "largest HTTP request body; a larger one gets a 413 before it is parsed",
}
_REASONING_HELP = (
    "split <think>...</think> off chat answers into reasoning_content (qwen3: when the answer or the prompt opens "
    "it; the others: the answer starts inside it)"
)
_TOOL_CALL_HELP = "turn Qwen's <tool_call>{json}</tool_call> in chat answers to requests with tools into tool_calls"
_SERVER_FLAGS = {  # the ServerArgs fields whose flag is not a plain typed value
    "model_name": dict(help="the model id clients send and see (default: the model folder's name)"),
    "tokenizer_mode": dict(choices=TOKENIZER_MODES, help="fast, slow, or auto (fast, else slow)"),
    "reasoning_parser": dict(choices=list(REASONING_PARSERS), help=_REASONING_HELP),
    "tool_call_parser": dict(choices=list(TOOL_CALL_PARSERS), help=_TOOL_CALL_HELP),
    "trust_remote_code": dict(
        action="store_true", help="accepted for LightLLM compatibility; Qwen3 and Qwen3.5 run no remote code"
    ),
    "eos_id": dict(type=int, nargs="+", help="token ids that end a request, besides the model's own EOS"),
    "chat_template": dict(help="a Jinja chat template, as a file path or inline, replacing the tokenizer's"),
    "nccl_port": dict(type=int, help="with --tp > 1: the port of the ranks' rendezvous (default: a free one)"),
    "linear_att_hash_page_size": dict(
        type=int,
        help="accepted for LightLLM compatibility; Qwen3.5's prefix cache checkpoints its linear-attention "
        "state after each prefill chunk, each prompt and at shared-prefix branches, not every N tokens",
    ),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own would print the whole usage)
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lightllm.server.api_server", description="lightllm HTTP server")
    p.add_argument("--host", default=ServerArgs.host)
    p.add_argument("--port", type=int, default=ServerArgs.port)
    for f in dataclasses.fields(ServerArgs):
        if f.name in _SERVER_FLAGS:
            p.add_argument(f"--{f.name}", default=f.default, **_SERVER_FLAGS[f.name])
        elif f.name not in ("host", "port"):
            p.add_argument(f"--{f.name}", type=type(f.default), default=f.default, help=_SERVER_HELP[f.name])
    for f in dataclasses.fields(EngineArgs):
        flag, default = f"--{f.name}", f.default
        if f.type in (bool, "bool"):
            p.add_argument(flag, action="store_true", help=_HELP.get(f.name))
        elif f.name in _CHOICES:
            p.add_argument(flag, default=default, choices=_CHOICES[f.name], help=_HELP.get(f.name))
        elif f.name == "graph_len_buckets":  # a list: the flag alone gives [] (one bucket)
            p.add_argument(flag, type=int, nargs="*", default=list(default), help=_HELP[f.name])
        else:
            kind = _OPTIONAL_TYPES.get(f.name) or type(default)
            p.add_argument(flag, type=kind, default=default, help=_HELP.get(f.name))
    return p


def parse_args(argv: Optional[List[str]] = None) -> Tuple[ServerArgs, EngineArgs]:
    """Parsed and validated flags and env vars; a bad one exits with one ``error: ...`` line."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    server = ServerArgs(**{f.name: ns.pop(f.name) for f in dataclasses.fields(ServerArgs)})
    try:
        if not 0 < server.port < 65536:
            raise ValueError(f"--port expected a value in [1, 65535], got {server.port}")
        if server.tp < 1:
            raise ValueError(f"--tp expected a positive integer, got {server.tp}")
        for name in ("health_step_timeout_s", "tp_step_timeout_s", "request_read_timeout_s", "shutdown_drain_s"):
            value, zero_ok = getattr(server, name), name == "shutdown_drain_s"  # a drain of 0 aborts at once
            if not (0 <= value if zero_ok else 0 < value) or not math.isfinite(value):
                raise ValueError(f"--{name} expected a finite number of seconds {'>=' if zero_ok else '>'} 0, "
                                 f"got {value!r}")  # fmt: skip
        if server.max_request_body_bytes < 1:
            raise ValueError(
                f"--max_request_body_bytes expected a positive integer, got {server.max_request_body_bytes}"
            )
        if server.linear_att_hash_page_size is not None and server.linear_att_hash_page_size < 1:
            raise ValueError(f"--linear_att_hash_page_size expected a positive integer, got "
                             f"{server.linear_att_hash_page_size}")  # fmt: skip
        if server.nccl_port is not None and not 0 < server.nccl_port < 65536:
            raise ValueError(f"--nccl_port expected a value in [1, 65535], got {server.nccl_port}")
        if server.tp > 1 and server.nccl_port == server.port:  # rank 0 would listen there before HTTP does
            raise ValueError(f"--nccl_port expected a port other than --port, got {server.nccl_port} for both")
        if server.model_name is not None and not server.model_name.strip():
            raise ValueError("--model_name expected a non-empty name")
        server.eos_id = tuple(server.eos_id)
        server.chat_template = _read_chat_template(server.chat_template)
        engine = EngineArgs(**ns).normalize()
        envs.validate_all()
        if engine.device.startswith("cuda") and server.tp > torch.cuda.device_count():
            raise ValueError(f"--tp {server.tp} expected at most the {torch.cuda.device_count()} visible GPUs")
        _fit_to_model(engine, server)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    _note_unused(server)
    logger.info("args: host=%s port=%d tp=%d %s", server.host, server.port, server.tp, engine.summary())
    return server, engine


def _read_chat_template(value: Optional[str]) -> Optional[str]:
    """The template text of ``--chat_template`` (a file path, or the template itself), checked to compile."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:  # permission denied, /proc/self/mem, not UTF-8
            raise ValueError(f"--chat_template {value!r}: cannot read: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat_template expected a Jinja template file or an inline template, got {value!r}: "
                         "no such file")  # fmt: skip
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat_template {value!r}: invalid Jinja at line {e.lineno}: {e.message}") from None
    return text


def _note_unused(server: ServerArgs) -> None:
    if server.trust_remote_code:
        logger.info("--trust_remote_code: unused, the supported architectures (Qwen3, Qwen3.5) run no remote code")
    if server.nccl_port is not None and server.tp == 1:
        logger.info("--nccl_port %d: unused with --tp 1", server.nccl_port)
    if server.linear_att_hash_page_size is not None:
        logger.info("--linear_att_hash_page_size %d: unused, Qwen3.5's prefix cache checkpoints its linear-attention "
                    "state after each prefill chunk, each prompt and at shared-prefix branches (docs/engine.md)",
                    server.linear_att_hash_page_size)  # fmt: skip


def _fit_to_model(engine: EngineArgs, server: ServerArgs) -> None:
    """The checks that need the model's config.json (read here, before any weight loads)."""
    from lightllm.tools.make_tiny_model import default_model_dir

    model_dir = engine.model_dir or str(default_model_dir())
    try:
        family = model_family(model_dir)  # the folder, its config.json and an architecture served here
    except ModelLoadError as e:
        raise ValueError(f"--model_dir expected a Hugging Face model folder of a supported architecture: {e}") from None
    try:
        config = family.read_config(Path(model_dir))
    except ModelLoadError as e:  # a supported architecture's config.json or generation_config.json
        raise ValueError(f"--model_dir {model_dir}: {e}") from None
    engine.fit_to_model(config.max_position_embeddings, config.head_dim, checkpoint_dtype(model_dir))
    check_head_dim(config.head_dim, torch.device(engine.device))
    family.check_tp(config, server.tp)
    check_mtp(engine, family, config, model_dir)
    bad = [i for i in server.eos_id if not 0 <= i < config.vocab_size]
    if bad:
        raise ValueError(f"--eos_id expected token ids in [0, {config.vocab_size}) (the model's vocab_size), "
                         f"got {bad}")  # fmt: skip
