"""Qwen3 weights from a Hugging Face folder's ``*.safetensors`` files, in HF layout.

Linears stay ``[out_features, in_features]`` (use them with ``F.linear``; a layer's also as ``[in, out]`` views,
``qkv_t`` ..., for ``torch.mm``). q/k/v and gate/up are fused at load
into one weight each (``qkv_proj`` = [q; k; v] rows, ``gate_up_proj`` = [gate; up] rows; one GEMM each), and
the per-projection names remain as views of them. Tensors are read one at a time with ``safe_open``, checked
against the shape the config implies, cast and moved (a fused part straight into its rows of the fused weight),
so at most one extra tensor is alive beside the result.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Dict, Iterator, List, Optional, Tuple, Union

import torch
from safetensors import safe_open

from lightllm.models.hf_config import ModelLoadError, read_json
from lightllm.models.qwen3.config import Qwen3ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Checkpoint dtypes we can cast from; anything else (fp8, int8, packed int4) needs scales we don't read.
_SOURCE_DTYPES = ("F16", "BF16", "F32")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LM_HEAD = "lm_head.weight"


# Checkpoint fields read into rows of one fused weight: field -> (fused weight, its place among the parts).
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


class GateUpViews:
    """The checkpoint's ``gate_proj``/``up_proj`` as views of the fused ``gate_up_proj`` (gate rows, then up)."""

    gate_up_proj: torch.Tensor

    @property
    def gate_proj(self) -> torch.Tensor:
        return self.gate_up_proj.chunk(2)[0]

    @property
    def up_proj(self) -> torch.Tensor:
        return self.gate_up_proj.chunk(2)[1]


@dataclass
class LayerWeights(GateUpViews):
    """One layer's weights (this rank's shard in tensor parallelism; ``heads``/``kv_heads``/``intermediate`` below
    are this rank's)."""

    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: q rows, then k, then v
    o_proj: torch.Tensor  # [hidden, heads * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up
    down_proj: torch.Tensor  # [hidden, intermediate]

    def __post_init__(self):
        # The four linears as [in, out] views, made once: a layer's GEMM is then one ``torch.mm(x, w_t)``, the very
        # call ``F.linear(x, w)`` makes (a transpose view, then mm) without its two extra dispatches per call.
        self.qkv_t, self.o_t = self.qkv_proj.t(), self.o_proj.t()
        self.gate_up_t, self.down_t = self.gate_up_proj.t(), self.down_proj.t()

    @property
    def q_proj(self) -> torch.Tensor:
        return self._qkv_parts()[0]

    @property
    def k_proj(self) -> torch.Tensor:
        return self._qkv_parts()[1]

    @property
    def v_proj(self) -> torch.Tensor:
        return self._qkv_parts()[2]

    def _qkv_parts(self) -> Tuple[torch.Tensor, ...]:
        q_rows = self.o_proj.shape[1]
        kv_rows = (self.qkv_proj.shape[0] - q_rows) // 2
        return self.qkv_proj.split((q_rows, kv_rows, kv_rows))


@dataclass
class Qwen3Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: List[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same object as ``embed`` when tied (see ``tied_lm_head``)


def _layer_names(i: int) -> Dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "input_norm": p + "input_layernorm.weight",
        "q_proj": p + "self_attn.q_proj.weight",
        "k_proj": p + "self_attn.k_proj.weight",
        "v_proj": p + "self_attn.v_proj.weight",
        "o_proj": p + "self_attn.o_proj.weight",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "gate_proj": p + "mlp.gate_proj.weight",
        "up_proj": p + "mlp.up_proj.weight",
        "down_proj": p + "mlp.down_proj.weight",
    }


def expected_shapes(config: Qwen3ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name a Qwen3 checkpoint holds, with its shape (``lm_head`` may be absent when tied)."""
    c = config
    h, q_out, kv_out = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,), LM_HEAD: (c.vocab_size, h)}
    layer_shapes = {
        "input_norm": (h,),
        "q_proj": (q_out, h),
        "k_proj": (kv_out, h),
        "v_proj": (kv_out, h),
        "o_proj": (h, q_out),
        "q_norm": (c.head_dim,),
        "k_norm": (c.head_dim,),
        "post_norm": (h,),
        "gate_proj": (c.intermediate_size, h),
        "up_proj": (c.intermediate_size, h),
        "down_proj": (h, c.intermediate_size),
    }
    for i in range(c.num_hidden_layers):
        for field, name in _layer_names(i).items():
            shapes[name] = layer_shapes[field]
    return shapes


def tied_lm_head(embed: torch.Tensor, stored: Optional[torch.Tensor], where: Path, log: logging.Logger) -> torch.Tensor:
    """The output projection of a model with ``tie_word_embeddings``: ``embed`` itself (one tensor, no copy),
    unless the checkpoint's own ``lm_head.weight`` (``stored``) differs from it. Then the config is wrong about the
    checkpoint and, as transformers does, the stored head is used, with one warning."""
    if stored is None or torch.equal(stored, embed):
        return embed
    log.warning("%s: config.json says tie_word_embeddings but the checkpoint's %s differs from the embedding; using "
                "%s, as transformers does (set tie_word_embeddings to false to silence this)", where, LM_HEAD,
                LM_HEAD)  # fmt: skip
    return stored


def checked_tensors(
    model_dir: Path, shapes: Dict[str, Tuple[int, ...]], unknown: Callable[[str], None],
    missing_hint: Callable[[str], str] = lambda name: "", optional: Collection[str] = (),
) -> Iterator[tuple]:  # fmt: skip
    """``(handle, name, slice view)`` of each tensor named in ``shapes`` across the checkpoint's files, checked
    first: in one file only, of its expected shape and a supported source dtype. Names not in ``shapes`` go to
    ``unknown``. At the end, ModelLoadError for the first missing name not in ``optional``, ``missing_hint(name)``
    appended."""
    seen = set()
    for file in safetensors_files(model_dir):
        with open_safetensors(file) as f:
            for name in f.keys():
                if name not in shapes:
                    unknown(name)
                    continue
                if name in seen:
                    raise ModelLoadError(f"{file}: tensor {name} is also in another safetensors file")
                seen.add(name)
                view = f.get_slice(name)
                found, source_dtype = tuple(view.get_shape()), view.get_dtype()
                if found != shapes[name]:
                    raise ModelLoadError(
                        f"{file}: tensor {name} has shape {list(found)}, expected {list(shapes[name])}"
                    )
                if source_dtype not in _SOURCE_DTYPES:
                    raise ModelLoadError(
                        f"{file}: tensor {name} has dtype {source_dtype}; only F16, BF16 and F32 are supported"
                    )
                yield f, name, view
    missing = [name for name in shapes if name not in seen and name not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{model_dir}: tensor {missing[0]} is missing from the safetensors files{more}"
                             f"{missing_hint(missing[0])}")  # fmt: skip


def open_safetensors(file: Path):
    """``safe_open`` of ``file`` (a context manager); a bad header is ModelLoadError naming the file."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ModelLoadError(f"{file}: cannot read safetensors file: {e}") from None


def unknown_tensors_note(unknown: List[str], shown: int = 3) -> str:
    """For a missing-tensor error: the tensors the files have that the model does not use, where a misnamed one
    (``qproj`` for ``q_proj``) shows; "" when there are none."""
    if not unknown:
        return ""
    more = f" (and {len(unknown) - shown} more)" if len(unknown) > shown else ""
    return f"; the files have unknown tensors: {', '.join(sorted(unknown)[:shown])}{more}"


def safetensors_files(model_dir: Path) -> List[Path]:
    """The checkpoint's files: those named by ``model.safetensors.index.json`` if present, else every
    ``*.safetensors`` in the folder, sorted."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: field 'weight_map' is missing or empty")
        for tensor, name in weight_map.items():
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ModelLoadError(f"{index}: field 'weight_map' entry {tensor!r} is {name!r}, expected the file "
                                     "name of a shard in the model folder")  # fmt: skip
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (model_dir / name).is_file():
                raise ModelLoadError(f"{index}: shard {name!r} is listed but not found in {model_dir}")
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        found = (
            f" (found PyTorch weights {', '.join(bins[:3])}{', ...' if len(bins) > 3 else ''}, which are not "
            "read: convert them to safetensors, e.g. with transformers' save_pretrained)"
            if bins
            else ""
        )
        raise ModelLoadError(f"{model_dir}: no *.safetensors files found{found}")
    return files


# A layer field's tensor-parallel part: (dim, slice) of the full tensor, or None for all of it.
ShardSpec = Callable[[str], Optional[Tuple[int, slice]]]


class _FusedLayout:
    """Where each checkpoint part lands in its fused weight, for this rank's shard: rows ``[first, last)``."""

    def __init__(self, config: Qwen3ModelConfig, shard: Optional[ShardSpec]):
        c = config
        full = {"q_proj": c.num_attention_heads * c.head_dim, "k_proj": c.num_key_value_heads * c.head_dim,
                "v_proj": c.num_key_value_heads * c.head_dim, "gate_proj": c.intermediate_size,
                "up_proj": c.intermediate_size}  # fmt: skip
        local = {}
        for field, rows in full.items():
            part = shard(field) if shard is not None else None
            local[field] = rows if part is None else len(range(rows)[part[1]])
        self._rows, ends = {}, {}
        for field, (target, _) in sorted(FUSED_PARTS.items(), key=lambda item: item[1]):
            first = ends.get(target, 0)
            ends[target] = first + local[field]
            self._rows[field] = (target, first, ends[target])
        self._shapes = {target: (rows, c.hidden_size) for target, rows in ends.items()}

    def rows(self, field: str) -> Tuple[str, int, int]:
        return self._rows[field]

    def shape(self, target: str) -> Tuple[int, int]:
        return self._shapes[target]


def load_qwen3_weights(
    model_dir: Union[str, Path],
    config: Qwen3ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[str, torch.device] = "cpu",
    shard: Optional[ShardSpec] = None,
) -> Qwen3Weights:
    """Read every Qwen3 tensor of ``model_dir``, check its shape against ``config``, cast to ``dtype``
    (float16, bfloat16 or float32) and move it to ``device``.

    ``shard(field)`` (a layer field such as ``"q_proj"``) gives the part of that tensor this process keeps.
    Tensors are read one at a time and only that part reaches ``device``, so a tensor-parallel rank never
    holds the full checkpoint. q/k/v parts are then concatenated into ``qkv_proj`` and gate/up into
    ``gate_up_proj`` (each part copied into its rows as it is read).

    Raises ModelLoadError (one line) for no safetensors files, a missing tensor, a shape mismatch, an unsupported
    checkpoint or target dtype. Tensors the model does not use (attention biases, for instance) are skipped
    with one warning.
    """
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use torch.float16, torch.bfloat16 or torch.float32")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model folder not found")
    shapes = expected_shapes(config)
    where = {name: (i, field) for i in range(config.num_hidden_layers) for field, name in _layer_names(i).items()}
    fused = _FusedLayout(config, shard)
    tensors: Dict[str, torch.Tensor] = {}
    fused_weights: Dict[Tuple[int, str], torch.Tensor] = {}
    unexpected: List[str] = []

    def unknown(name: str) -> None:
        if not name.endswith(_IGNORED_SUFFIXES):  # old rotary buffers: skipped without a warning
            unexpected.append(name)

    def hint(name: str) -> str:
        return unknown_tensors_note(unexpected)

    # A tied checkpoint may still hold lm_head.weight (``tied_lm_head`` decides which tensor projects).
    optional = (LM_HEAD,) if config.tie_word_embeddings else ()
    for f, name, view in checked_tensors(model_dir, shapes, unknown, hint, optional):
        layer, field = where.get(name, (None, None))
        part = shard(field) if shard is not None and field is not None else None
        if part is None:
            tensor = f.get_tensor(name)
        else:
            dim, rows = part
            tensor = (view[rows] if dim == 0 else view[:, rows]).contiguous()  # a column slice is strided
        if field in FUSED_PARTS:
            # Straight into its rows of the fused weight: the part is freed here, never held beside it.
            target, first, last = fused.rows(field)
            if (layer, target) not in fused_weights:
                fused_weights[layer, target] = torch.empty(fused.shape(target), dtype=dtype, device=device)
            fused_weights[layer, target][first:last].copy_(tensor)
        else:
            tensors[name] = tensor.to(device=device, dtype=dtype)
        del tensor

    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        logger.warning(
            "%s: ignoring %d tensors Qwen3 does not use: %s%s",
            model_dir,
            len(unexpected),
            ", ".join(sorted(unexpected)[:5]),
            more,
        )

    embed = tensors["model.embed_tokens.weight"]
    layers = []
    for i in range(config.num_hidden_layers):
        own = {field: tensors[name] for field, name in _layer_names(i).items() if field not in FUSED_PARTS}
        layers.append(
            LayerWeights(**own, qkv_proj=fused_weights[i, "qkv_proj"], gate_up_proj=fused_weights[i, "gate_up_proj"])
        )
    lm_head = tensors.pop(LM_HEAD, None)
    if config.tie_word_embeddings:
        lm_head = tied_lm_head(embed, lm_head, model_dir, logger)
    return Qwen3Weights(embed=embed, layers=layers, final_norm=tensors["model.norm.weight"], lm_head=lm_head)
