"""What the in-process engine benchmarks (``chunked_prefill_itl.py``, ``prefix_cache_ttft.py``) share: the
random-weight Qwen3 model they run and the JSON they write."""

import json
import os

import torch


def random_qwen3(root: str, tiny: bool, layers: int, max_len: int, tiny_tokens: int) -> tuple:
    """``(model_dir, engine arguments)``: the built-in tiny model on the CPU (``tiny``; positions for ``max_len``
    tokens, a ``tiny_tokens`` KV pool), else a Qwen3-8B-shaped model of ``layers`` layers in bf16."""
    from lightllm.tools.make_tiny_model import QWEN3_8B_SHAPE, make_tiny_qwen3

    if tiny:
        model = make_tiny_qwen3(os.path.join(root, "tiny"), max_position_embeddings=max(4096, max_len))
        return str(model), dict(data_type="fp32", device="cpu", max_total_token_num=tiny_tokens)
    model = make_tiny_qwen3(os.path.join(root, "qwen3-8b-shaped"), num_hidden_layers=layers, **QWEN3_8B_SHAPE)
    return str(model), dict(data_type="bf16")


def write_rows(path: str, args, rows: list) -> None:
    """``{"device", "args", "rows"}`` to ``path`` (its folder made if missing)."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": device, "args": vars(args), "rows": rows}, f, indent=1)
