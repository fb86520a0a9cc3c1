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

``split_mtp_head`` moves a folder's head into a folder of its own (``--mtp_draft_model_dir``).
"""

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

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


def split_mtp_head(model_dir: Path, main_dir: Path, head_dir: Path, shards: int = 2,
                   extra: Optional[Dict[str, torch.Tensor]] = None) -> None:  # fmt: skip
    """Split a folder with an MTP head into ``main_dir`` (everything but the ``mtp.*`` tensors) and ``head_dir``
    (``config.json`` and the ``mtp.*`` tensors in ``shards`` safetensors files with an index, plus ``extra``
    tensors a head folder may carry and the loader ignores): a ``--mtp_draft_model_dir`` layout."""
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    head = {name: t for name, t in weights.items() if name.startswith("mtp.")}
    for folder in (main_dir, head_dir):
        Path(folder).mkdir(parents=True, exist_ok=True)
    for file in Path(model_dir).iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, Path(main_dir) / file.name)
    shutil.copy(Path(model_dir) / "config.json", Path(head_dir) / "config.json")
    save_file({n: t for n, t in weights.items() if n not in head}, str(Path(main_dir) / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    tensors = {**head, **(extra or {})}
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(Path(head_dir) / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (Path(head_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
