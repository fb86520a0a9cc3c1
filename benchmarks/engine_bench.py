"""What the in-process engine benchmarks (``chunked_prefill_itl.py``, ``prefix_cache_ttft.py``,
``overlap_decode.py``) share: the random-weight model they run and the JSON they write."""

import json
import os

import torch


def random_model(
    root: str, tiny: bool, layers: int, max_len: int, tiny_tokens: int, model: str = "qwen3", mtp: bool = False
) -> tuple:
    """``(model_dir, engine arguments)``: the built-in tiny ``model`` on the CPU (``tiny``; positions for ``max_len``
    tokens, a ``tiny_tokens`` KV pool), else a random-weight model of ``layers`` layers in bf16: Qwen3-8B-shaped
    (``qwen3``) or Qwen3.5-27B-shaped (``qwen3.5``, ``decode_step.build_model``: 3 linear-attention layers to 1
    full). ``mtp``: Qwen3.5 with its MTP head."""
    from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5

    if model not in ("qwen3", "qwen3.5"):
        raise ValueError(f"random_model: model expected qwen3 or qwen3.5, got {model!r}")
    if mtp and model != "qwen3.5":
        raise ValueError(f"random_model: an MTP head expected model qwen3.5, got {model!r}")
    if tiny:
        make = make_tiny_qwen3 if model == "qwen3" else make_tiny_qwen3_5
        head = dict(mtp=True) if mtp else {}
        out = make(os.path.join(root, "tiny"), max_position_embeddings=max(4096, max_len), **head)
        return str(out), dict(data_type="fp32", device="cpu", max_total_token_num=tiny_tokens)
    from decode_step import build_model  # benchmarks/ is the script's folder

    return build_model(root, layers, model, mtp), dict(data_type="bf16")


def add_model_args(p) -> None:
    """The arguments of ``random_model``'s model: ``--model``, ``--mtp_step``, ``--layers``, ``--tiny``."""
    p.add_argument("--model", choices=("qwen3", "qwen3.5"), default="qwen3")
    p.add_argument("--mtp_step", type=int, default=0, help="Qwen3.5 with MTP, N drafts per step (0: off)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on the CPU (a check of the method)")


def mtp_options(p, args) -> dict:
    """The engine options ``--mtp_step`` asks for ({} when off); a model without an MTP head is a usage error."""
    if args.mtp_step and args.model != "qwen3.5":
        p.error(f"--mtp_step expected --model qwen3.5 (the model with an MTP head), got --model {args.model}")
    return dict(mtp_mode="eagle_with_att", mtp_step=args.mtp_step) if args.mtp_step else {}


def write_rows(path: str, args, rows: list) -> None:
    """``{"device", "args", "rows"}`` to ``path`` (its folder made if missing)."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": device, "args": vars(args), "rows": rows}, f, indent=1)
