"""Tiny random-weight Hugging Face Qwen3 and Qwen3.5 folders: test fixtures and the server's built-in default model.

A folder holds what a real checkpoint holds: ``config.json``, ``model.safetensors``, ``generation_config.json``
and a working byte-level BPE tokenizer (with a chat template) trained offline on a small built-in corpus.
Everything is deterministic: the same arguments give byte-identical files.

    python -m lightllm.tools.make_tiny_model OUT_DIR [--layers 2 --hidden 64 ...]
    python -m lightllm.tools.make_tiny_model OUT_DIR --family qwen3.5   # a hybrid Qwen3.5 with its defaults
"""

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from filelock import FileLock, Timeout

from lightllm.common import envs
from lightllm.common.cli import OneLineParser
from lightllm.tools.tiny_mtp import add_mtp_head, check_mtp_head, make_agreeing, mtp_tensors

logger = logging.getLogger(__name__)


PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# make_tiny_qwen3's arguments the CLI sets, by flag: its errors name the flag
_FLAGS = {"vocab_size": "--vocab-size", "hidden_size": "--hidden", "intermediate_size": "--intermediate",
          "num_hidden_layers": "--layers", "num_attention_heads": "--heads", "num_key_value_heads": "--kv-heads",
          "head_dim": "--head-dim", "max_position_embeddings": "--max-position-embeddings"}  # fmt: skip
_CLI_DEFAULTS = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "max_position_embeddings": 4096}  # fmt: skip


def _check_qwen3_shape(sizes: dict, names: Optional[dict] = None) -> None:
    """ValueError for sizes (``make_tiny_qwen3``'s arguments) that lightllm's Qwen3 config reader refuses, so that
    every folder written here loads: positive sizes, heads a multiple of KV heads, a context of at least 2 tokens,
    an even head_dim (rotary).
    ``names``: what to call an argument in the message (the CLI's flags); default its own name."""
    names = names or {}
    _check_positive(sizes, names)
    _check_multiple(sizes, "num_attention_heads", "num_key_value_heads", names)
    _check_context(sizes, names)
    if sizes["head_dim"] % 2:
        raise ValueError(f"{names.get('head_dim', 'head_dim')} expected an even number (rotary embeddings), "
                         f"got {sizes['head_dim']}")  # fmt: skip


def _check_qwen3_5_shape(sizes: dict, layer_types, partial_rotary_factor: float) -> None:
    """ValueError for ``make_tiny_qwen3_5`` arguments that lightllm's Qwen3.5 config reader refuses, so that every
    folder written here loads: positive sizes, heads multiples of KV heads (attention and linear attention), known
    layer types with a full-attention one, an even rotary width in [2, head_dim]."""
    from lightllm.models.qwen3_5.config import LAYER_TYPES  # lazy: the built-in model (Qwen3) needs none of it

    _check_positive(sizes, {})
    _check_multiple(sizes, "num_attention_heads", "num_key_value_heads", {})
    _check_multiple(sizes, "linear_num_value_heads", "linear_num_key_heads", {})
    _check_context(sizes, {})
    if not layer_types or any(t not in LAYER_TYPES for t in layer_types) or "full_attention" not in layer_types:
        raise ValueError(f"layer_types expected a sequence of {LAYER_TYPES} with at least one 'full_attention' "
                         f"(the KV cache needs one), got {layer_types!r}")  # fmt: skip
    if sizes["linear_conv_kernel_dim"] < 2:
        raise ValueError(f"linear_conv_kernel_dim expected at least 2, got {sizes['linear_conv_kernel_dim']}")
    rotary_dim = int(sizes["head_dim"] * partial_rotary_factor)  # transformers' rounding, as the reader's
    if not 0 < partial_rotary_factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial_rotary_factor} x head_dim {sizes['head_dim']} expected an "
                         f"even number of rotary dims in [2, head_dim], got {rotary_dim}")  # fmt: skip


def _check_positive(sizes: dict, names: dict) -> None:
    for arg, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{names.get(arg, arg)} expected a positive integer, got {value!r}")


def _check_context(sizes: dict, names: dict) -> None:
    # the engine's bound on max_req_total_len: a request with fewer tokens than two would not fit
    if sizes["max_position_embeddings"] < 2:
        raise ValueError(f"{names.get('max_position_embeddings', 'max_position_embeddings')} expected at least 2 (one "
                         f"prompt token and one generated), got {sizes['max_position_embeddings']}")  # fmt: skip


def _check_multiple(sizes: dict, arg: str, of: str, names: dict) -> None:
    if sizes[arg] % sizes[of]:
        raise ValueError(f"{names.get(arg, arg)} expected a multiple of {names.get(of, of)} ({sizes[of]}), "
                         f"got {sizes[arg]}")  # fmt: skip


# Training text for the tokenizer: plain English, a little code and numbers, so common words get merged.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt, one token at a time,
and predicts the next token. The server keeps a cache of keys and values for every request, so that each
new token only needs one step of attention over the tokens that came before it.
Once upon a time there was a small model that lived in a folder on a disk. It did not know very much, but it
answered every question with great confidence. People asked it about the weather, the news, and the meaning
of life. It always replied with a string of words that looked like English from a distance.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Tiny. Where do you live?
I live in the cache. What do you do? I help the tests run fast, and I make sure the server can start.
The kernel autotuner measures each launch configuration on the device, keeps the fastest one, and writes it
to a file. The next time the server starts, it reads the file and skips the search. Decode attention is tuned
before each graph is captured, on inputs that look like real traffic.
In the beginning the system was quiet. Then requests arrived: first a few, then many. The scheduler grouped
them into batches, the model ran forward, and the sampler picked the next token for every sequence. When a
sequence produced the end of text token, or reached its length limit, it was finished and its memory was freed.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 8192 32768 3.14 2.718 1e-6.
Questions and answers: Why is the sky blue? Because air scatters blue light more than red light. Why do cats
sleep so much? Because they can. Which is larger, an elephant or a mouse? An elephant is much larger.
The rain in Spain stays mainly in the plain. She sells sea shells by the sea shore. Peter Piper picked a peck
of pickled peppers. All that glitters is not gold. To be, or not to be, that is the question. A journey of a
thousand miles begins with a single step. Knowledge is power. Time is money. Practice makes perfect.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May, June,
July, August, September, October, November, December. Red, orange, yellow, green, blue, indigo, violet.
The user said: please write a short story about a robot. The assistant said: once there was a robot who
wanted to learn to paint. It practiced every day, and after a long time its paintings were beautiful.
"""


def _build_tokenizer(vocab_size: int, model_max_length: int):
    """A byte-level BPE trained on ``_CORPUS`` with Qwen-style special tokens, as a PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def make_tiny_qwen3(
    out_dir: Union[str, os.PathLike],
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    initializer_range: float = 0.2,
    padded_vocab_size: int = 0,
    generation_config: Optional[dict] = None,
) -> Path:
    """Write a random-weight Qwen3 checkpoint with a working tokenizer into ``out_dir`` and return its path.

    ``vocab_size`` is the tokenizer's training target; the config gets the tokenizer's actual size (at most
    the target), or ``padded_vocab_size`` when larger (embedding rows no token uses, as real checkpoints
    pad theirs; benchmarks use it for a realistic lm_head). Weights come from transformers' own
    ``Qwen3ForCausalLM`` init under ``seed``, with a wider ``initializer_range`` than HF's 0.02 so logits are
    not flat, and RMSNorm weights perturbed around 1 so a loader that swaps two norms is caught. The caller's
    global RNG state is left untouched. ``generation_config``: keys added to ``generation_config.json`` (sampling
    defaults such as ``{"do_sample": True, "temperature": 0.6}``). Sizes lightllm's config reader refuses (not
    positive, heads not a multiple of KV heads, a context under 2 tokens, an odd head_dim) raise ValueError before
    anything is written.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"expected dtype in {sorted(_DTYPES)}, got {dtype!r}")
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                 num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                 num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                 max_position_embeddings=max_position_embeddings)  # fmt: skip
    _check_qwen3_shape(sizes)
    _check_padded_vocab(padded_vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(vocab_size, max_position_embeddings)
    config = Qwen3Config(
        vocab_size=max(len(tokenizer), padded_vocab_size),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return _save(model.to(_DTYPES[dtype]), tokenizer, out, generation_config)


def _check_padded_vocab(padded_vocab_size) -> None:
    if isinstance(padded_vocab_size, bool) or not isinstance(padded_vocab_size, int) or padded_vocab_size < 0:
        raise ValueError(f"padded_vocab_size expected 0 (the tokenizer's size) or a row count, got "
                         f"{padded_vocab_size!r}")  # fmt: skip


def _save(model, tokenizer, out: Path, generation_config: Optional[dict]) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if generation_config:
        path = out / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **generation_config}, indent=2))
    return out


def make_tiny_qwen3_5(
    out_dir: Union[str, os.PathLike],
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    layer_types: tuple = ("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    partial_rotary_factor: float = 0.25,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 8,
    linear_conv_kernel_dim: int = 4,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    initializer_range: float = 0.2,
    padded_vocab_size: int = 0,
    generation_config: Optional[dict] = None,
    mtp: Union[bool, str] = False,
    mtp_noise: float = 0.0,
) -> Path:
    """Write a random-weight Qwen3.5 text checkpoint (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``) with
    the tokenizer of :func:`make_tiny_qwen3` into ``out_dir``; return its path. ``padded_vocab_size`` as there.

    Hybrid: ``layer_types`` mixes gated DeltaNet and gated attention layers; grouped value heads (Hv > Hk) and
    Dk != Dv by default, mrope sections in the rope parameters as real checkpoints give them. Every parameter is
    perturbed away from transformers' init so each convention matters: zero-centred norm weights (``1 + w``)
    around 0, the gated norm's around 1, ``A_log`` and ``dt_bias`` random. The caller's RNG is left untouched.

    ``mtp``: also write an MTP head (``mtp.*``, ``tools/tiny_mtp.py``): True or ``"random"`` (drafts ~never
    accepted), ``"agree"`` (main model and head built so that drafts are ~always accepted; ``mtp_noise`` lowers
    that; needs untied embeddings). Arguments lightllm's config reader refuses raise ValueError before anything is
    written (``make_tiny_qwen3``'s rules, the same for linear-attention heads, a full-attention layer, an even
    rotary width).
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if dtype not in _DTYPES:
        raise ValueError(f"expected dtype in {sorted(_DTYPES)}, got {dtype!r}")
    sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                 num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                 linear_num_key_heads=linear_num_key_heads, linear_num_value_heads=linear_num_value_heads,
                 linear_key_head_dim=linear_key_head_dim, linear_value_head_dim=linear_value_head_dim,
                 linear_conv_kernel_dim=linear_conv_kernel_dim,
                 max_position_embeddings=max_position_embeddings)  # fmt: skip
    _check_qwen3_5_shape(sizes, layer_types, partial_rotary_factor)
    _check_padded_vocab(padded_vocab_size)
    head = check_mtp_head(mtp) if mtp is not False else None
    if head == "agree" and tie_word_embeddings:
        raise ValueError("mtp='agree' expected tie_word_embeddings=False: its lm_head is a shifted embedding")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size, max_position_embeddings)
    rotary_half = int(head_dim * partial_rotary_factor) // 2
    config = Qwen3_5TextConfig(
        vocab_size=max(len(tokenizer), padded_vocab_size),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor,
                         "mrope_interleaved": True, "mrope_section": [rotary_half - rotary_half // 2,
                                                                      rotary_half // 2, 0]},  # fmt: skip
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("linear_attn.norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))  # the gated norm scales by its plain weight
                elif name.endswith("norm.weight"):
                    param.copy_(0.1 * torch.randn_like(param))  # zero-centred: the norm scales by 1 + weight
                elif name.endswith(("A_log", "dt_bias")):
                    param.copy_(0.5 * torch.randn_like(param))
        if head == "agree":
            make_agreeing(model, config)
        extra = mtp_tensors(config, head, mtp_noise, initializer_range) if head else None
    _save(model.to(_DTYPES[dtype]), tokenizer, out, generation_config)
    if extra is not None:
        add_mtp_head(out, extra, _DTYPES[dtype])
    return out


def _is_complete(model_dir: Path) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((model_dir / name).is_file() for name in names)


# head_dim 64: the smallest the GPU kernels take, so the built-in model also serves on a GPU
BUILTIN_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# Qwen3-8B's widths, vocabulary and dtype, for benchmarks: pass num_hidden_layers as well.
QWEN3_8B_SHAPE = dict(padded_vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, dtype="bfloat16",
                      initializer_range=0.02)  # fmt: skip


# head_dim 64: the smallest the GPU attention kernels take; 64-wide linear-attention heads for the GPU kernels
QWEN3_5_GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                         linear_value_head_dim=64)  # fmt: skip


# Another process building the built-in model takes seconds; a lock held longer than this is stuck, not busy.
BUILD_LOCK_TIMEOUT_S = 600.0


def default_model_dir() -> Path:
    """The built-in tiny model (``~/.cache/lightllm/tiny-qwen3-d64`` or ``$LIGHTLLM_TINY_MODEL_DIR``).

    Built on first use in a temporary folder beside the target and renamed into place, so a reader never sees
    a half-written folder; when another process wins the race its folder is used. ``ValueError`` naming the
    variable when the folder cannot be created or written.
    """
    target = envs.get_tiny_model_dir()
    if _is_complete(target):
        return target
    must = f"{envs.TINY_MODEL_DIR}: {target} must be a folder that can be created and written"
    try:
        return _build_default(target)
    except Timeout:
        raise ValueError(f"{must} (its build lock {target.parent / _lock_name(target)} is held by another process "
                         f"after {BUILD_LOCK_TIMEOUT_S:g} s)") from None  # fmt: skip
    except OSError as e:
        raise ValueError(f"{must} ({type(e).__name__}: {e})") from None


def _lock_name(target: Path) -> str:
    return f".{target.name}.lock"


def _build_default(target: Path) -> Path:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{envs.TINY_MODEL_DIR}: {target} exists but is not a tiny model folder; remove it")

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / _lock_name(target)
    lock.touch()  # an unwritable folder fails here, at once; FileLock would retry it until its timeout
    # One builder at a time (tensor-parallel ranks, several servers): the others wait and use its folder.
    with FileLock(str(lock), timeout=BUILD_LOCK_TIMEOUT_S):
        if _is_complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            logger.info("building the built-in tiny Qwen3 model in %s", target)
            make_tiny_qwen3(tmp, **BUILTIN_SHAPE)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache folder is an ordinary one
            try:
                os.rename(tmp, target)  # atomic; replaces only a missing or empty folder
            except OSError:
                if not _is_complete(target):
                    raise
                logger.info("another process built %s first; using it", target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv=None) -> None:
    parser = OneLineParser(
        prog="python -m lightllm.tools.make_tiny_model",
        description="Write a tiny random-weight Qwen3 or Qwen3.5 Hugging Face folder.",
    )
    parser.add_argument("out_dir", help="folder to write (created if missing)")
    parser.add_argument("--family", choices=("qwen3", "qwen3.5"), default="qwen3",
                        help="qwen3.5: a hybrid Qwen3.5 with make_tiny_qwen3_5's defaults (only --seed and --dtype "
                        "apply)")  # fmt: skip
    # The size flags default to None so that one given with --family qwen3.5 is seen even at its Qwen3 default.
    parser.add_argument("--vocab-size", dest="vocab_size", type=int, help="tokenizer vocab size target (512)")
    parser.add_argument("--hidden", dest="hidden_size", type=int, help="hidden_size (64)")
    parser.add_argument("--intermediate", dest="intermediate_size", type=int, help="intermediate_size (128)")
    parser.add_argument("--layers", dest="num_hidden_layers", type=int, help="num_hidden_layers (2)")
    parser.add_argument("--heads", dest="num_attention_heads", type=int, help="num_attention_heads (4), a multiple of "
                        "--kv-heads")  # fmt: skip
    parser.add_argument("--kv-heads", dest="num_key_value_heads", type=int, help="num_key_value_heads (2)")
    parser.add_argument("--head-dim", dest="head_dim", type=int, help="head_dim (16), even (rotary embeddings)")
    parser.add_argument("--max-position-embeddings", type=int, help="max_position_embeddings (4096), at least 2")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    args = parser.parse_args(argv)
    sizes = {arg: getattr(args, arg) for arg in _FLAGS}
    if args.family == "qwen3.5":
        # its shape is make_tiny_qwen3_5's: a Qwen3 flag would be silently ignored
        ignored = [_FLAGS[arg] for arg, value in sizes.items() if value is not None]
        ignored += ["--tie-word-embeddings"] if args.tie_word_embeddings else []
        if ignored:
            parser.error(f"{', '.join(ignored)}: --family qwen3 only (--family qwen3.5 takes --seed and --dtype)")
    else:
        sizes = {arg: _CLI_DEFAULTS[arg] if value is None else value for arg, value in sizes.items()}
        try:
            _check_qwen3_shape(sizes, _FLAGS)
        except ValueError as e:
            parser.error(str(e))
    _make_out_dir(parser, args.out_dir)
    if args.family == "qwen3.5":
        out = make_tiny_qwen3_5(args.out_dir, seed=args.seed, dtype=args.dtype)
        print(f"wrote tiny Qwen3.5 model to {out}")
        return
    out = make_tiny_qwen3(args.out_dir, **sizes, tie_word_embeddings=args.tie_word_embeddings, seed=args.seed,
                          dtype=args.dtype)  # fmt: skip
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    print(f"wrote tiny Qwen3 model to {out} (vocab_size={vocab})")


def _make_out_dir(parser: argparse.ArgumentParser, out_dir: str) -> None:
    """Create ``out_dir`` before the build, so a path that cannot be a writable folder is one line, not a traceback.
    An empty name (an unset shell variable) is refused: it would be the current folder."""
    if not out_dir.strip():
        parser.error("out_dir expected a folder to create or write into, got ''")
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"out_dir {out_dir!r} expected a folder to create or write into ({type(e).__name__}: {e})")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        parser.error(f"out_dir {out_dir!r} expected a folder to create or write into (it is not writable)")


if __name__ == "__main__":
    main()
