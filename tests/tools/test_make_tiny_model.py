import json
import os
import re
import shutil

import pytest
import torch
from filelock import FileLock
from transformers import AutoTokenizer, Qwen3ForCausalLM

from lightllm.tools import make_tiny_model
from lightllm.layers.attention import GPU_HEAD_DIMS
from lightllm.common.envs import TINY_MODEL_DIR
from lightllm.common.proc import HANG_TIMEOUT_S
from lightllm.tools.make_tiny_model import default_model_dir, make_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model")


def test_folder_holds_config_weights_and_tokenizer(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)


@pytest.mark.parametrize(
    "text",
    ["Hello, world! How are you today?", "  two  spaces\tand a tab\n\nnew lines", "ünïcödé 漢字 🙂", "x" * 50],
    ids=["english", "whitespace", "unicode", "repeated"],
)
def test_tokenizer_round_trips(tiny_dir, text):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens_match_config(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert tokenizer.pad_token_id is not None
    assert len(tokenizer.encode("the model")) < len("the model")  # BPE learned merges
    # A special token in text encodes to its single id and decodes back.
    ids = tokenizer.encode("<|im_start|>user")
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == "<|im_start|>user"


def test_chat_template(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text[: -len("<|im_start|>assistant\n")]


def test_transformers_loads_it_and_logits_are_not_flat(tiny_dir):
    model = Qwen3ForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert logits.shape == (len(tokenizer),)
    assert logits.std() > 0.5


def test_same_arguments_give_identical_files(tmp_path):
    a = make_tiny_qwen3(tmp_path / "a", num_hidden_layers=1, seed=3)
    b = make_tiny_qwen3(tmp_path / "b", num_hidden_layers=1, seed=3)
    c = make_tiny_qwen3(tmp_path / "c", num_hidden_layers=1, seed=4)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_global_rng_is_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    make_tiny_qwen3(tmp_path / "m", num_hidden_layers=1)
    assert torch.equal(torch.rand(4), expected)


def test_dtype_and_tied_embeddings(tmp_path):
    out = make_tiny_qwen3(tmp_path / "m", num_hidden_layers=1, dtype="bfloat16", tie_word_embeddings=True)
    model = Qwen3ForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_qwen3(tmp_path / "bad", dtype="int8")


def test_cli(tmp_path):
    make_tiny_model.main([str(tmp_path / "cli"), "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1"])
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (1, 32, 1)


def test_default_model_dir_builds_once(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "tiny"
    monkeypatch.setenv(TINY_MODEL_DIR, str(target))
    assert default_model_dir() == target
    config = json.loads((target / "config.json").read_text())
    assert config["head_dim"] in GPU_HEAD_DIMS  # the built-in model serves on a GPU too
    weights = target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt the default model")

    monkeypatch.setattr(make_tiny_model, "make_tiny_qwen3", fail)
    assert default_model_dir() == target
    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == ["tiny"]  # no temp folder


def test_default_model_dir_uses_the_winner_of_a_race(tmp_path, monkeypatch, tiny_dir):
    target = tmp_path / "tiny"
    monkeypatch.setenv(TINY_MODEL_DIR, str(target))
    real = make_tiny_model.make_tiny_qwen3

    def build_while_another_process_finishes_first(out_dir, **kwargs):
        shutil.copytree(tiny_dir, target)
        (target / "winner").write_text("")
        return real(out_dir, num_hidden_layers=1)

    monkeypatch.setattr(make_tiny_model, "make_tiny_qwen3", build_while_another_process_finishes_first)
    assert default_model_dir() == target
    assert (target / "winner").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []


def test_default_model_dir_refuses_a_foreign_folder(tmp_path, monkeypatch):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    monkeypatch.setenv(TINY_MODEL_DIR, str(target))
    with pytest.raises(ValueError, match=TINY_MODEL_DIR):
        default_model_dir()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_default_model_dir_in_an_unwritable_place_names_the_variable_at_once(monkeypatch):
    monkeypatch.setenv(TINY_MODEL_DIR, "/proc/nope")  # /proc takes no new files, not even root's
    # a hang on the lock would end in its timeout's message, not the file error's
    monkeypatch.setattr(make_tiny_model, "BUILD_LOCK_TIMEOUT_S", HANG_TIMEOUT_S)
    with pytest.raises(ValueError, match=f"^{TINY_MODEL_DIR}: /proc/nope must be a folder that can be created and "
                       "written \\(FileNotFoundError: "):  # fmt: skip
        default_model_dir()


def test_default_model_dir_lock_held_too_long_names_the_variable(tmp_path, monkeypatch):
    target = tmp_path / "tiny"
    monkeypatch.setenv(TINY_MODEL_DIR, str(target))
    monkeypatch.setattr(make_tiny_model, "BUILD_LOCK_TIMEOUT_S", 0.2)
    with FileLock(str(tmp_path / ".tiny.lock")):  # a stuck builder
        with pytest.raises(ValueError, match=f"{TINY_MODEL_DIR}: {target} must be a folder .* held by another "
                           "process after 0.2 s"):  # fmt: skip
            default_model_dir()


def _resolve_default(queue):
    queue.put(str(default_model_dir()))


def test_default_model_dir_concurrent_processes_build_once(tmp_path, monkeypatch):
    """Tensor-parallel ranks or several servers starting together: one builds, the others wait for it."""
    import multiprocessing as mp

    target = tmp_path / "tiny"
    monkeypatch.setenv(TINY_MODEL_DIR, str(target))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_resolve_default, args=(queue,)) for _ in range(3)]
    try:
        for p in procs:
            p.start()
        results = [queue.get(timeout=HANG_TIMEOUT_S) for _ in procs]
        for p in procs:
            p.join(timeout=HANG_TIMEOUT_S)
            assert p.exitcode == 0
    finally:  # on a failure too: none may outlive the test
        for p in procs:
            if p.pid is not None:  # started
                p.kill()
                p.join()
    assert results == [str(target)] * 3 and make_tiny_model._is_complete(target)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_tiny_qwen3_5_is_hybrid_deterministic_and_perturbed(tmp_path):
    from safetensors.torch import load_file

    a = make_tiny_model.make_tiny_qwen3_5(tmp_path / "a", seed=3)
    b = make_tiny_model.make_tiny_qwen3_5(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert set(config["layer_types"]) == {"linear_attention", "full_attention"}
    assert config["linear_num_value_heads"] > config["linear_num_key_heads"]
    assert (a / "tokenizer.json").read_bytes() == (make_tiny_qwen3(tmp_path / "q3") / "tokenizer.json").read_bytes()
    w = load_file(a / "model.safetensors")
    assert w["model.layers.1.input_layernorm.weight"].abs().min() > 0  # transformers' init: zeros
    assert not torch.equal(w["model.layers.0.linear_attn.dt_bias"], torch.ones(4))  # init: ones
    assert not torch.equal(w["model.layers.0.linear_attn.norm.weight"], torch.ones(8))
    make_tiny_model.main([str(tmp_path / "cli"), "--family", "qwen3.5", "--seed", "3"])
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--head-dim", "0"], "--head-dim expected a positive integer, got 0"),
        (["--intermediate", "-5"], "--intermediate expected a positive integer, got -5"),
        (["--hidden", "0"], "--hidden expected a positive integer, got 0"),
        (["--layers", "0"], "--layers expected a positive integer, got 0"),
        (["--vocab-size", "-5"], "--vocab-size expected a positive integer, got -5"),
        (["--max-position-embeddings", "0"], "--max-position-embeddings expected a positive integer, got 0"),
        (["--max-position-embeddings", "1"], "--max-position-embeddings expected at least 2 (one prompt token"),
        (["--heads", "3"], "--heads expected a multiple of --kv-heads (2), got 3"),
        (["--head-dim", "3"], "--head-dim expected an even number (rotary embeddings), got 3"),
        (["--family", "qwen3.5", "--heads", "8", "--tie-word-embeddings"], "--heads, --tie-word-embeddings: --family "
         "qwen3 only (--family qwen3.5 takes --seed and --dtype)"),  # fmt: skip
        (["--family", "qwen3.5", "--layers", "2"], "--layers: --family qwen3 only"),  # even at the Qwen3 default
    ],
    ids=["head-dim-0", "intermediate-neg", "hidden-0", "layers-0", "vocab-neg", "context-0", "context-1",
         "heads-not-multiple", "head-dim-odd", "qwen3.5-ignores", "qwen3.5-ignores-a-default"],  # fmt: skip
)
def test_cli_refuses_a_shape_the_engine_would_not_load(tmp_path, capsys, flags, error):
    with pytest.raises(SystemExit) as exit_info:
        make_tiny_model.main([str(tmp_path / "m"), *flags])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line: no usage block above it
    assert line.startswith("python -m lightllm.tools.make_tiny_model: error: ") and f"error: {error}" in line
    assert not (tmp_path / "m").exists()  # refused before anything is written


def test_cli_out_dir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # '' would be the current folder
    file = tmp_path / "file"
    file.write_text("")
    cases = [(str(file), "(FileExistsError: "), (str(file / "m"), "(NotADirectoryError: "), ("", "got ''")]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/nope", "(FileNotFoundError: "))  # /proc takes no new folders, not even root's
    for out_dir, why in cases:
        with pytest.raises(SystemExit):
            make_tiny_model.main([out_dir])
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.splitlines()[-1].startswith(
            "python -m lightllm.tools.make_tiny_model: error: out_dir "
        ), err
        assert why in err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize(
    "build, kwargs, error",
    [
        (make_tiny_qwen3, dict(num_attention_heads=3), "num_attention_heads expected a multiple of "
         "num_key_value_heads (2), got 3"),  # fmt: skip
        (make_tiny_qwen3, dict(head_dim=0), "head_dim expected a positive integer, got 0"),
        (make_tiny_qwen3, dict(padded_vocab_size=-1), "padded_vocab_size expected 0"),
        (make_tiny_model.make_tiny_qwen3_5, dict(intermediate_size=-5), "intermediate_size expected a positive"),
        (make_tiny_model.make_tiny_qwen3_5, dict(linear_num_value_heads=3), "linear_num_value_heads expected a "
         "multiple of linear_num_key_heads (2), got 3"),  # fmt: skip
        (make_tiny_model.make_tiny_qwen3_5, dict(layer_types=("linear_attention",)), "at least one 'full_attention'"),
        (make_tiny_model.make_tiny_qwen3_5, dict(head_dim=6), "partial_rotary_factor 0.25 x head_dim 6 expected an "
         "even number of rotary dims in [2, head_dim], got 1"),  # fmt: skip
        (make_tiny_model.make_tiny_qwen3_5, dict(max_position_embeddings=1, mtp=True), "max_position_embeddings "
         "expected at least 2"),  # fmt: skip
        (make_tiny_model.make_tiny_qwen3_5, dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim expected at least "
         "2, got 1"),  # fmt: skip
    ],
    ids=["q3-heads", "q3-head-dim", "q3-padded-vocab", "q35-intermediate", "q35-linear-heads", "q35-no-full",
         "q35-rotary", "q35-mtp-context", "q35-conv-width"],  # fmt: skip
)
def test_builders_refuse_what_the_engine_would_not_load(tmp_path, build, kwargs, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        build(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_the_smallest_accepted_shapes_load(tmp_path):
    """The checks refuse only what the config readers refuse: their boundary cases are written and read back."""
    from lightllm.models.qwen3.config import Qwen3ModelConfig
    from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig

    make_tiny_model.main([str(tmp_path / "q3"), "--vocab-size", "1", "--hidden", "8", "--intermediate", "1",
                          "--layers", "1", "--heads", "6", "--kv-heads", "3", "--head-dim", "2",
                          "--max-position-embeddings", "2"])  # fmt: skip
    assert Qwen3ModelConfig.from_model_dir(tmp_path / "q3").num_attention_heads == 6
    make_tiny_model.make_tiny_qwen3_5(tmp_path / "q35", vocab_size=1, hidden_size=8, intermediate_size=1,
                                      layer_types=("full_attention",), num_attention_heads=3, num_key_value_heads=3,
                                      head_dim=8, linear_num_key_heads=1, linear_num_value_heads=1,
                                      linear_key_head_dim=1, linear_value_head_dim=1, linear_conv_kernel_dim=2,
                                      max_position_embeddings=2)  # fmt: skip
    assert Qwen3_5ModelConfig.from_model_dir(tmp_path / "q35").rotary_dim == 2
