"""The MTP head of a tiny Qwen3.5 folder (``make_tiny_qwen3_5(..., mtp=...)``), in the real checkpoint's names.

transformers' ``Qwen3_5ForCausalLM`` has no MTP module (it drops ``mtp.*`` on load), so the head's tensors are
made here and added to the folder's safetensors file, with ``mtp_num_hidden_layers: 1`` in ``config.json``.

Heads (``mtp``):
- ``"random"`` (or True): random weights; its drafts almost never match the main model (acceptance ~0 %).
- ``"agree"``: a main model whose greedy next token is ``token + 1`` whatever the context (every layer near
  the identity: its output projections scaled by ``NEAR_IDENTITY``; ``lm_head`` row ``j`` = embedding row
  ``j - 1``; a plain final norm) and a head that makes the same choice for the token it is fed (``fc`` passes
  the normed embedding through, its layer near the identity), so every draft is accepted (~100 %).
  ``mtp_noise`` > 0 adds ``mtp_noise`` times a random map of the hidden state to the head's ``fc``, so fewer
  drafts agree (benchmarks pick it for a target acceptance).
"""

import json
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import load_file, save_file

MTP_HEADS = ("random", "agree")
NEAR_IDENTITY = 1e-3  # scale of every layer's output projections in an agreeing model
_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def check_mtp_head(mtp) -> str:
    """The head kind ``mtp`` names (True: "random"); ValueError for anything else."""
    head = "random" if mtp is True else mtp
    if head not in MTP_HEADS:
        raise ValueError(f"mtp expected False, True or one of {MTP_HEADS}, got {mtp!r}")
    return head


def make_agreeing(model, config) -> None:
    """Turn a freshly initialized ``Qwen3_5ForCausalLM`` into the agreeing main model (see the module doc)."""
    with torch.no_grad():
        embed = torch.randn(config.vocab_size, config.hidden_size)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(embed.roll(1, dims=0))  # row j = embedding j - 1: argmax after token t is t + 1
        model.model.norm.weight.zero_()  # zero-centred: a plain RMSNorm
        for name, param in model.named_parameters():
            if name.endswith(_OUTPUT_PROJECTIONS):
                param.mul_(NEAR_IDENTITY)


def mtp_tensors(config, head: str, noise: float, initializer_range: float) -> Dict[str, torch.Tensor]:
    """``mtp.*`` tensors (float32) for ``config`` (a transformers ``Qwen3_5TextConfig``), from the global RNG."""
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape):
        return torch.randn(*shape) * initializer_range

    def zero_centred(n):  # a plain norm for the agreeing head, perturbed around it for a random one
        return torch.zeros(n) if head == "agree" else 0.1 * torch.randn(n)

    layer = {
        "input_layernorm.weight": zero_centred(h),
        "post_attention_layernorm.weight": zero_centred(h),
        "self_attn.q_proj.weight": rand(2 * q_out, h),
        "self_attn.k_proj.weight": rand(kv_out, h),
        "self_attn.v_proj.weight": rand(kv_out, h),
        "self_attn.o_proj.weight": rand(h, q_out),
        "self_attn.q_norm.weight": zero_centred(d),
        "self_attn.k_norm.weight": zero_centred(d),
        "mlp.gate_proj.weight": rand(inter, h),
        "mlp.up_proj.weight": rand(inter, h),
        "mlp.down_proj.weight": rand(h, inter),
    }
    if head == "agree":
        fc = torch.cat([torch.eye(h), noise * torch.randn(h, h) / h**0.5], dim=1)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            layer[name] *= NEAR_IDENTITY
    else:
        fc = rand(h, 2 * h)
    tensors = {f"mtp.layers.0.{name}": t for name, t in layer.items()}
    tensors.update({"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": zero_centred(h),
                    "mtp.pre_fc_norm_hidden.weight": zero_centred(h), "mtp.norm.weight": zero_centred(h)})  # fmt: skip
    return tensors


def add_mtp_head(out: Path, tensors: Dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Append ``tensors`` to the folder's ``model.safetensors`` and record the head in ``config.json``."""
    path = out / "model.safetensors"
    weights = load_file(str(path))
    weights.update({name: t.to(dtype).contiguous() for name, t in tensors.items()})
    save_file(weights, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
