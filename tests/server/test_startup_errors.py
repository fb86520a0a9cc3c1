"""Bad start-up input stops the server with one ``error:`` line (exit 2) before any weight loads (a malformed
checkpoint: as it loads); a model with a short context caps the default --max_req_total_len instead of crashing in
the warm-up."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from server_helpers import REPO

from lightllm import LLM, SamplingParams
from lightllm.common import proc as procs
from lightllm.common.net import free_port
from lightllm.engine.model_runner import ModelRunner
from lightllm.server.args import parse_args
from lightllm.server.prompts import load_tokenizer
from lightllm.engine.engine import Engine
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m")))  # head_dim 16, max_position_embeddings 4096


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("short"), max_position_embeddings=64))


def run_server(tmp_path, args, **env_vars):
    """``python -m lightllm.server.api_server *args`` to its end: (exit code, stdout + stderr). A server that
    wrongly gets as far as loading weights is stopped there (its output says so), not left to serve."""
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_TINY_MODEL_DIR": str(tmp_path / "tiny"), "HF_HUB_OFFLINE": "1",
           **env_vars}  # fmt: skip
    cmd = [sys.executable, "-m", "lightllm.server.api_server", *args]
    lines = []
    with procs.running(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        hung = threading.Timer(procs.HANG_TIMEOUT_S, proc.kill)  # a server that hangs silently ends the read: a failure
        hung.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if "KV cache:" in line:  # the runner's first line after loading: too late for a start-up error
                    return None, "".join(lines)
            code = proc.wait(timeout=procs.HANG_TIMEOUT_S)
        finally:
            hung.cancel()
    return code, "".join(lines)


def check_inputs(monkeypatch, capsys, args, **env_vars):
    """What the server checks before it loads anything (flags, env vars, port, generation config, tokenizer), run in
    this process: (exit code, stderr). Any other exception than the one-line exit fails the test with its traceback.
    ``run_server`` proves on a few cases that the server process runs these checks first and ends as they do."""
    from lightllm.server.api_server import _checked_inputs

    for name, value in env_vars.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # checks past the flags bind the port: a free one, not the default 8000
        _checked_inputs(args if "--port" in args else [*args, "--port", str(free_port())])
    return e.value.code, capsys.readouterr().err


def assert_one_error_line(code, out, *expected):
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, out[-3000:]
    assert "Traceback" not in out
    assert "KV cache:" not in out, "weights were loaded before the error"  # the runner's first line after loading
    for text in expected:
        assert text in errors[0]


CASES = {
    "absurd max_req_total_len": (["--max_req_total_len", "99999999999"], ["99999999999", "4096"]),
    "cache smaller than a request": (["--max_total_token_num", "10"], ["--max_total_token_num 10", "4097"]),
    "cache past int32": (["--max_total_token_num", "100000000000"], ["--max_total_token_num", "at most 2147483648"]),
    "int8kv group 0": (["--llm_kv_type", "int8kv", "--llm_kv_quant_group_size", "0"], ["--llm_kv_quant_group_size"]),
    "int8kv group 7": (["--llm_kv_type", "int8kv", "--llm_kv_quant_group_size", "7"], ["7", "head_dim / 2 = 8"]),
    "int4kv group 16": (["--llm_kv_type", "int4kv", "--llm_kv_quant_group_size", "16"], ["16", "head_dim / 2 = 8"]),
    "group 0, default KV": (["--llm_kv_quant_group_size", "0"], ["--llm_kv_quant_group_size", "got 0"]),
    "negative drain": (["--shutdown_drain_s", "-1"], ["--shutdown_drain_s", "-1"]),
    "unknown reasoning parser": (["--reasoning_parser", "qwen2"], ["--reasoning_parser", "'qwen2'", "qwen3"]),
    "chunked_prefill_size 0": (["--chunked_prefill_size", "0"], ["--chunked_prefill_size", "positive integer, got 0"]),
    "nccl_port is port": (["--tp", "2", "--port", "18", "--nccl_port", "18"], ["--nccl_port", "other than --port"]),
}


@pytest.mark.parametrize("args, expected", list(CASES.values()), ids=list(CASES))
def test_bad_flag_is_one_line(monkeypatch, capsys, model, args, expected):
    assert_one_error_line(*check_inputs(monkeypatch, capsys, ["--model_dir", model, "--device", "cpu", *args]),
                          *expected)  # fmt: skip


def test_a_bad_flag_stops_the_server_process_before_loading(tmp_path, model):
    args, expected = CASES["absurd max_req_total_len"]
    assert_one_error_line(*run_server(tmp_path, ["--model_dir", model, "--device", "cpu", *args]), *expected)


@pytest.mark.parametrize("args, expected", [
    (["--device", "bogus", "--model_dir", "/nonexistent"], ["--device", "'bogus'", "cpu, cuda or cuda:N"]),
    (["--model_dir", "/nonexistent"], ["--model_dir", "/nonexistent: model folder not found"]),
    (["--model_dir", "/etc"], ["--model_dir", "/etc/config.json: file not found"]),
], ids=["device", "missing folder", "folder without config.json"])  # fmt: skip
def test_bad_device_or_model_dir(monkeypatch, capsys, args, expected):
    argv = ["--device", "cpu", *args] if "--device" not in args else args
    assert_one_error_line(*check_inputs(monkeypatch, capsys, argv), *expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_names_device(monkeypatch, capsys, model):
    assert_one_error_line(*check_inputs(monkeypatch, capsys, ["--model_dir", model, "--device", "cuda"]),
                          "--device cuda", "0")  # fmt: skip


def test_port_in_use_is_reported_before_loading(tmp_path, model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = run_server(tmp_path, ["--model_dir", model, "--device", "cpu", "--port", str(port)])
    assert_one_error_line(code, out, f"--port {port}", "in use")


def test_a_bad_generation_config_is_one_line_before_loading(tmp_path):
    model = make_tiny_qwen3(tmp_path / "m", generation_config={"do_sample": True, "top_p": 0})
    code, out = run_server(tmp_path, ["--model_dir", str(model), "--device", "cpu"])
    assert_one_error_line(code, out, "generation_config.json: top_p expected a number in (0, 1], got 0")


def test_a_corrupt_safetensors_file_under_mtp_is_one_line(tmp_path, capsys):
    """The MTP check reads the safetensors headers (of --model_dir or --mtp_draft_model_dir): a corrupt file is
    one line naming it, not safetensors' traceback."""
    model = make_tiny_qwen3_5(tmp_path / "m", mtp=True)
    bad = shutil.copytree(model, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    capsys.readouterr()  # the writer's progress bar
    draft = ["--model_dir", str(model), "--mtp_draft_model_dir", str(bad)]
    # the head's own folder is named by the flag that gave it
    for argv, prefix in ((["--model_dir", str(bad)], ""), (draft, f"--mtp_draft_model_dir {bad}: ")):
        with pytest.raises(SystemExit) as e:
            parse_args([*argv, "--device", "cpu", "--mtp_mode", "eagle_with_att", "--mtp_step", "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"error: {prefix}{bad / 'model.safetensors'}: cannot read safetensors file: "), err


def test_a_bad_config_of_a_supported_architecture_names_the_folder_not_the_architecture(tmp_path, model, capsys):
    """Only a folder whose architecture is not served is told it needs "a supported architecture"."""
    bad_json = shutil.copytree(model, tmp_path / "bad_json")
    (bad_json / "generation_config.json").write_text("{")
    mtp = make_tiny_qwen3_5(tmp_path / "mtp")
    config = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": -1}))
    capsys.readouterr()  # the writer's progress bar
    for model_dir, expected in [
        (bad_json, f"{bad_json / 'generation_config.json'}: invalid JSON: "),
        (mtp, f"{mtp / 'config.json'}: field 'mtp_num_hidden_layers' must be a non-negative integer, got -1"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args(["--model_dir", str(model_dir), "--device", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"error: --model_dir {model_dir}: {expected}"), err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("name, value, expected", [
    ("LIGHTLLM_TINY_MODEL_DIR", "/proc/nope", "LIGHTLLM_TINY_MODEL_DIR: /proc/nope must be a folder that can be "
     "created and written"),
    ("LIGHTLLM_TINY_MODEL_DIR", "~lightllm-no-such-user/x", "LIGHTLLM_TINY_MODEL_DIR='~lightllm-no-such-user/x' must "
     "be a folder that can be created and written"),
    ("LIGHTLLM_AUTOTUNE_CONFIG_DIR", "~lightllm-no-such-user/x", "LIGHTLLM_AUTOTUNE_CONFIG_DIR="),
], ids=["unwritable tiny model dir", "unknown user's tiny model dir", "unknown user's autotune dir"])  # fmt: skip
def test_a_bad_path_variable_is_one_line(monkeypatch, capsys, name, value, expected):
    assert_one_error_line(*check_inputs(monkeypatch, capsys, ["--device", "cpu"], **{name: value}), expected)


def _without_tokenizer(model, dest):
    """A copy of ``model`` without its tokenizer files: transformers then builds an empty tokenizer."""
    shutil.copytree(model, dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).unlink()
    return str(dest)


def test_a_folder_without_a_tokenizer_is_one_line(monkeypatch, capsys, tmp_path, model):
    folder = _without_tokenizer(model, tmp_path / "no_tokenizer")
    code, out = check_inputs(monkeypatch, capsys, ["--model_dir", folder, "--device", "cpu"])
    assert_one_error_line(code, out, f"--model_dir {folder}: no usable tokenizer (tokenizer.json, or vocab.json + "
                          "merges.txt): it encodes text to no tokens")  # fmt: skip


def test_llm_refuses_a_folder_without_a_tokenizer(tmp_path, model):
    folder = _without_tokenizer(model, tmp_path / "no_tokenizer")
    with pytest.raises(ValueError, match="--model_dir .*: no usable tokenizer"):
        LLM(folder, device="cpu", max_total_token_num=8192)


def test_a_tokenizer_without_a_chat_template_is_a_start_up_warning(tmp_path, model, caplog):
    folder = tmp_path / "no_template"
    shutil.copytree(model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    caplog.set_level(logging.WARNING)
    assert load_tokenizer(str(folder)).chat_template is None
    assert [r.message for r in caplog.records if r.levelno == logging.WARNING] == [
        f"the tokenizer of {folder} has no chat template: /v1/chat/completions requests get a 400 (--chat_template "
        "gives one)"
    ]
    caplog.clear()
    load_tokenizer(model)
    assert not [r for r in caplog.records if "chat template" in r.message]


def _f64_norm(tensors):
    tensors["model.norm.weight"] = tensors["model.norm.weight"].double()


def _misname_q_proj(tensors):
    tensors["model.layers.0.self_attn.qproj.weight"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")


def break_weights(folder, edit=None, truncate=False):
    """``folder``'s model.safetensors with ``edit(tensors)`` applied, or cut in half."""
    path = folder / "model.safetensors"
    if truncate:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def runner_error(args) -> str:
    """The ValueError that building the runner for ``args`` raises, in this process (for inputs that fail before any
    large allocation): the engine process sends its message to the HTTP process, which prints it as the server's one
    error line (``test_malformed_weights_are_one_line`` runs that path whole)."""
    _, engine_args = parse_args(args)
    with pytest.raises(ValueError) as e:
        ModelRunner(engine_args)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_malformed_weights_are_one_line(tmp_path):
    """Found by the engine process while loading: it sends the message, the HTTP process prints it (exit 2)."""
    model = make_tiny_qwen3(tmp_path / "m")
    break_weights(model, _f64_norm)
    code, out = run_server(tmp_path, ["--model_dir", str(model), "--device", "cpu"])
    assert_one_error_line(
        code, out, "model.safetensors: tensor model.norm.weight has dtype F64; only F16, BF16 and F32"
    )


@pytest.mark.parametrize("edit, truncate, expected", [
    (_misname_q_proj, False, ["tensor model.layers.0.self_attn.q_proj.weight is missing",
                              "the files have unknown tensors: model.layers.0.self_attn.qproj.weight"]),
    (None, True, ["model.safetensors: cannot read safetensors file"]),
], ids=["misnamed", "truncated"])  # fmt: skip
def test_other_malformed_weights_are_one_line(tmp_path, edit, truncate, expected):
    model = make_tiny_qwen3(tmp_path / "m")
    break_weights(model, edit, truncate)
    message = runner_error(["--model_dir", str(model), "--device", "cpu"])
    assert all(text in message for text in expected), message


def test_malformed_weights_are_one_line_with_tensor_parallelism(tmp_path):
    """--tp 2: rank 0 or the worker (through rank 0's watchdog), whichever finds it first, gives the one line."""
    model = make_tiny_qwen3(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    break_weights(model, _f64_norm)
    code, out = run_server(tmp_path, ["--model_dir", str(model), "--device", "cpu", "--tp", "2"])
    assert_one_error_line(code, out, "tensor model.norm.weight has dtype F64")


def test_nccl_port_in_use_is_one_line(tmp_path):
    """--tp 2 with --nccl_port taken by another process: rank 0 cannot listen there to host the rendezvous."""
    model = make_tiny_qwen3(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--model_dir", str(model), "--device", "cpu", "--tp", "2", "--nccl_port", str(port)]
        code, out = run_server(tmp_path, [*args, "--port", str(free_port())])
    assert_one_error_line(code, out, f"--nccl_port {port}: the ranks cannot meet", "address already in use")


@pytest.mark.parametrize("args, expected", [
    (["--running_max_req_size", "1000000000"], ["--running_max_req_size 1000000000 does not fit in RAM"]),
    (["--max_total_token_num", "2147483648"], ["--max_total_token_num 2147483648 does not fit in RAM"]),
], ids=["running_max_req_size", "max_total_token_num"])  # fmt: skip
def test_sizes_beyond_the_ram_are_one_line(tmp_path, model, args, expected):
    """On the CPU (16 TB of req_to_token table, 1 TiB of KV): one line, not the OOM killer or an allocator error. In
    a server process of its own: should the check ever let such a size through, its allocation must not take this
    process down."""
    assert_one_error_line(*run_server(tmp_path, ["--model_dir", model, "--device", "cpu", *args]), *expected)


def test_short_context_caps_the_default_and_everything_derived(short_model, caplog):
    """max_position_embeddings 64 < the default 16384: the warm-up prefill used to index past the rotary table."""
    caplog.set_level(logging.INFO)
    llm = LLM(short_model, data_type="fp32", device="cpu", batch_max_tokens=256, running_max_req_size=4)
    a = llm.runner.args
    assert (a.max_req_total_len, a.graph_max_len_in_batch) == (64, 64)
    assert llm.runner.kv.num_tokens == 5 * 64  # CPU sizing: (running_max_req_size + padding) requests
    assert [r.message for r in caplog.records if "max_req_total_len 16384 -> 64" in r.message] == [
        "max_req_total_len 16384 -> 64: the model's context (max_position_embeddings)"
    ]
    (out,) = llm.generate([list(range(1, 40))], SamplingParams(max_new_tokens=25, ignore_eos=True))
    assert len(out.token_ids) == 25 and out.finish_reason == "length"


def test_a_given_length_over_the_context_names_both_numbers(short_model):
    with pytest.raises(SystemExit) as e:
        parse_args(["--model_dir", short_model, "--device", "cpu", "--max_req_total_len", "65"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="--max_req_total_len 65 expected at most the model's context, "
                       "max_position_embeddings 64"):  # fmt: skip
        LLM(short_model, device="cpu", max_req_total_len=65)


@pytest.mark.parametrize("chunking", [False, True], ids=["disable_chunked_prefill", "chunked"])
def test_budget_note_is_logged_once_and_says_what_happens(model, caplog, chunking):
    """Parsing and the runner both normalize the options; the note comes once, from the scheduler that acts on it,
    and only when it is true: with chunked prefill (the default) a long prompt is split, not run whole."""
    caplog.set_level(logging.INFO)
    _, engine = parse_args(["--model_dir", model, "--device", "cpu", "--data_type", "fp32", "--batch_max_tokens", "32",
                            "--max_req_total_len", "64", "--running_max_req_size", "2"]
                           + ([] if chunking else ["--disable_chunked_prefill"]))  # fmt: skip
    Engine(ModelRunner(engine), eos_ids=[])
    notes = [r.message for r in caplog.records if "batch_max_tokens 32 < max_req_total_len 64" in r.message]
    if chunking:
        assert notes == []
        return
    assert len(notes) == 1 and "prefilled alone and whole" in notes[0]
