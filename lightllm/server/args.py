"""Command line of ``python -m lightllm.server.api_server``: LightLLM's flag names, each validated."""

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from lightllm.common import envs
from lightllm.engine.args import DATA_TYPES, EngineArgs
from lightllm.engine.attention import DECODE_BACKENDS, KV_TYPES

logger = logging.getLogger(__name__)

_HELP = {
    "model_dir": "Hugging Face model folder (default: the built-in tiny model, generated on first use)",
    "data_type": "weights and activations dtype",
    "running_max_req_size": "most requests decoding at once",
    "max_req_total_len": "most tokens of one request (prompt + output)",
    "batch_max_tokens": "most prompt tokens in one prefill batch",
    "graph_max_batch_size": "largest decode CUDA graph (capped at running_max_req_size)",
    "graph_split_batch_size": "decode graphs for every batch size up to this",
    "graph_grow_step_size": "then one graph every this many",
    "graph_max_len_in_batch": "longest request a decode graph serves; longer batches decode eagerly",
    "disable_cudagraph": "decode eagerly (no graphs, no decode-attention tuning scope)",
    "llm_kv_type": "KV cache type",
    "llm_kv_quant_group_size": "INT8/INT4 KV quantization group size along head_dim",
    "llm_decode_att_backend": "decode attention kernels",
    "mem_fraction": "fraction of free GPU memory for the KV cache",
    "max_total_token_num": "KV cache size in tokens (overrides mem_fraction)",
    "device": "cuda or cpu (default: cuda when available)",
}
_OPTIONAL_TYPES = {"model_dir": str, "max_total_token_num": int, "device": str}  # fields defaulting to None
_CHOICES = {
    "data_type": sorted(DATA_TYPES),
    "llm_kv_type": list(KV_TYPES),
    "llm_decode_att_backend": list(DECODE_BACKENDS),
}


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    tp: int = 1
    max_request_body_bytes: int = 4 << 20  # a body over this gets a 413 before it is parsed


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own would print the whole usage)
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lightllm.server.api_server", description="lightllm HTTP server")
    p.add_argument("--host", default=ServerArgs.host)
    p.add_argument("--port", type=int, default=ServerArgs.port)
    p.add_argument("--tp", type=int, default=ServerArgs.tp, help="tensor-parallel GPUs")
    p.add_argument("--max_request_body_bytes", type=int, default=ServerArgs.max_request_body_bytes,
                   help="largest HTTP request body; a larger one gets a 413 before it is parsed")  # fmt: skip
    for f in dataclasses.fields(EngineArgs):
        flag, default = f"--{f.name}", f.default
        if f.type in (bool, "bool"):
            p.add_argument(flag, action="store_true", help=_HELP.get(f.name))
        elif f.name in _CHOICES:
            p.add_argument(flag, default=default, choices=_CHOICES[f.name], help=_HELP.get(f.name))
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
        if server.max_request_body_bytes < 1:
            raise ValueError(
                f"--max_request_body_bytes expected a positive integer, got {server.max_request_body_bytes}"
            )
        engine = EngineArgs(**ns).normalize()
        envs.validate_all()
        if engine.device.startswith("cuda") and server.tp > torch.cuda.device_count():
            raise ValueError(f"--tp {server.tp} expected at most the {torch.cuda.device_count()} visible GPUs")
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    logger.info("args: host=%s port=%d tp=%d %s", server.host, server.port, server.tp, engine.summary())
    return server, engine
