"""LightLLM's server flags: each is accepted with its meaning, or (for a feature this server does not have) refused
with one ``error:`` line saying so, never argparse's "unrecognized arguments"."""

import logging
import os
import re
from types import SimpleNamespace

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.kernels.attention.decode import fa3
from lightllm.layers.attention import check_fa3_flags, pick_decode_backend, pick_prefill_backend
from lightllm.server.args import parse_args
from lightllm.server.prompts import load_tokenizer
from lightllm.server.tp import rendezvous_address
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m")))  # vocab_size 512 or less


def parse(model, *argv):
    return parse_args(["--model_dir", model, "--device", "cpu", *argv])


def refused(capsys, model, *argv) -> str:
    """The one ``error:`` line (exit 2) that ``argv`` gets."""
    with pytest.raises(SystemExit) as e:
        parse(model, *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def test_linear_att_cache_size_from_the_command_line(capsys, model):
    """Qwen3.5's state checkpoints: a count (0 turns its prefix cache off), by default running_max_req_size; a
    negative one is one line naming the flag."""
    assert parse(model, "--linear_att_cache_size", "0")[1].linear_att_cache_size == 0
    assert parse(model, "--linear_att_cache_size", "3")[1].linear_att_cache_size == 3
    engine = parse(model, "--running_max_req_size", "5")[1]
    assert engine.linear_att_cache_size == 5
    assert "--linear_att_cache_size expected a non-negative integer" in refused(
        capsys, model, "--linear_att_cache_size", "-1"
    )


def test_reasoning_and_tool_call_parsers(capsys, model):
    """LightLLM's and vLLM's parser names are taken; any other is one line naming the flag and the choices."""
    server = parse(model, "--reasoning_parser", "qwen3", "--tool_call_parser", "qwen25")[0]
    assert (server.reasoning_parser, server.tool_call_parser) == ("qwen3", "qwen25")
    server = parse(model, "--reasoning_parser", "deepseek-r1", "--tool_call_parser", "hermes")[0]
    assert (server.reasoning_parser, server.tool_call_parser) == ("deepseek-r1", "hermes")
    assert parse(model)[0].reasoning_parser is None and parse(model)[0].tool_call_parser is None
    err = refused(capsys, model, "--reasoning_parser", "qwen2")
    assert "--reasoning_parser" in err and "'qwen2'" in err and "qwen3" in err and "deepseek-r1" in err
    err = refused(capsys, model, "--tool_call_parser", "llama3")
    assert "--tool_call_parser" in err and "'llama3'" in err and "qwen25" in err and "hermes" in err


def test_chunked_prefill_flags(capsys, model):
    """LightLLM's meaning: on by default with chunks of 4096 tokens, off with --disable_chunked_prefill."""
    engine = parse(model)[1]
    assert (engine.chunked_prefill_size, engine.disable_chunked_prefill, engine.prefill_step_tokens) == (
        4096,
        False,
        4096,
    )
    engine = parse(model, "--chunked_prefill_size", "512", "--batch_max_tokens", "8192")[1]
    assert engine.prefill_step_tokens == 512
    assert parse(model, "--chunked_prefill_size", "512", "--disable_chunked_prefill")[1].prefill_step_tokens == 4096
    for bad in ("0", "-3"):
        assert refused(capsys, model, "--chunked_prefill_size", bad) == (
            f"error: --chunked_prefill_size expected a positive integer, got {bad} (--disable_chunked_prefill turns "
            "chunking off)"
        )


def test_mixed_chunk_flag(capsys, model):
    """Off by default; on only with chunked prefill and without MTP (one line naming the flag that conflicts)."""
    assert parse(model)[1].enable_mixed_chunk is False
    assert parse(model, "--enable_mixed_chunk")[1].enable_mixed_chunk is True
    assert refused(capsys, model, "--enable_mixed_chunk", "--disable_chunked_prefill") == (
        "error: --enable_mixed_chunk expected chunked prefill without MTP (mixed steps carry one decode token per "
        "request), got it with --disable_chunked_prefill"
    )
    with pytest.raises(ValueError, match="--enable_mixed_chunk expected chunked prefill .* got it with --mtp_mode"):
        EngineArgs(device="cpu", enable_mixed_chunk=True, mtp_mode="eagle_with_att", mtp_step=1).normalize()


def test_flags_accepted_for_compatibility_log_that_they_change_nothing(model, caplog):
    caplog.set_level(logging.INFO)
    server, _ = parse(model, "--trust_remote_code", "--nccl_port", "29500")
    assert server.trust_remote_code and server.nccl_port == 29500
    messages = [r.message for r in caplog.records]
    assert "--trust_remote_code: unused, the supported architectures (Qwen3, Qwen3.5) run no remote code" in messages
    assert "--nccl_port 29500: unused with --tp 1" in messages
    caplog.clear()
    server, _ = parse(model, "--linear_att_hash_page_size", "512")
    assert server.linear_att_hash_page_size == 512
    assert [r.message for r in caplog.records if "linear_att_hash_page_size" in r.message] == [
        "--linear_att_hash_page_size 512: unused, Qwen3.5's prefix cache checkpoints its linear-attention state after "
        "each prefill chunk, each prompt and at shared-prefix branches (docs/engine.md)"
    ]


def test_linear_att_hash_page_size_must_be_positive(capsys, model):
    assert refused(capsys, model, "--linear_att_hash_page_size", "0") == (
        "error: --linear_att_hash_page_size expected a positive integer, got 0"
    )


def test_disable_dynamic_prompt_cache_is_an_engine_option(model):
    assert not parse(model)[1].disable_dynamic_prompt_cache  # the prefix cache is on by default
    assert parse(model, "--disable_dynamic_prompt_cache")[1].disable_dynamic_prompt_cache


def test_model_name_and_eos_id(capsys, model):
    server, _ = parse(model, "--model_name", "Qwen/Qwen3-8B", "--eos_id", "3", "7")
    assert (server.model_name, server.eos_id) == ("Qwen/Qwen3-8B", (3, 7))
    assert parse(model)[0].eos_id == ()
    assert refused(capsys, model, "--eos_id", "3", "512") == (
        "error: --eos_id expected token ids in [0, 512) (the model's vocab_size), got [512]"
    )
    assert refused(capsys, model, "--model_name", " ") == "error: --model_name expected a non-empty name"


@pytest.mark.parametrize("port", ["0", "65536"])
def test_nccl_port_out_of_range(capsys, model, port):
    assert (
        refused(capsys, model, "--nccl_port", port) == f"error: --nccl_port expected a value in [1, 65535], got {port}"
    )


def test_nccl_port_is_where_the_ranks_meet():
    assert rendezvous_address(29511) == "tcp://127.0.0.1:29511"
    assert rendezvous_address(None).startswith("tcp://127.0.0.1:")


def test_graph_max_len_in_batch_0_is_max_req_total_len(capsys, model):
    assert parse(model, "--graph_max_len_in_batch", "0", "--max_req_total_len", "300")[1].graph_max_len_in_batch == 300
    assert parse(model, "--graph_max_len_in_batch", "0")[1].graph_max_len_in_batch == 4096
    assert parse(model, "--max_req_total_len", "300")[1].graph_max_len_in_batch == 300  # the default, capped
    assert "got -1" in refused(capsys, model, "--graph_max_len_in_batch", "-1")


def test_prefill_backend(capsys, model, caplog):
    caplog.set_level(logging.INFO)
    assert parse(model, "--llm_prefill_att_backend", "auto")[1].llm_prefill_att_backend == "triton"
    assert (
        "--llm_prefill_att_backend auto -> triton (FA3 decode is off; --llm_prefill_att_backend fa3 asks for FA3 "
        "prefill alone)" in [r.message for r in caplog.records]
    )
    assert parse(model, "--llm_prefill_att_backend", "triton")[1].llm_prefill_att_backend == "triton"
    err = refused(capsys, model, "--llm_prefill_att_backend", "fa3")  # on the CPU device: before any weight loads
    assert err == ("error: --llm_prefill_att_backend fa3: FA3 needs a Hopper GPU (sm90, H100/H200), found no GPU; use "
                   "--llm_prefill_att_backend triton")  # fmt: skip
    err = refused(capsys, model, "--llm_prefill_att_backend", "flashinfer")
    assert "--llm_prefill_att_backend" in err and "'flashinfer'" in err and "'auto', 'triton', 'fa3'" in err
    with pytest.raises(ValueError, match=r"--llm_prefill_att_backend expected one of \('auto', 'triton', 'fa3'\)"):
        EngineArgs(device="cpu", llm_prefill_att_backend="flashinfer").normalize()
    for flag in ("llm_prefill_att_backend", "llm_decode_att_backend"):
        err = refused(capsys, model, f"--{flag}", "fa3", "--llm_kv_type", "int8kv")
        assert err == (f"error: --{flag} fa3: FA3 reads no quantized KV cache (--llm_kv_type int8kv); use "
                       f"--llm_kv_type None or --{flag} triton")  # fmt: skip


def test_prefill_backend_auto_follows_fa3_decode(caplog, monkeypatch):
    """FA3 prefill by itself, with a provider without paged KV, would give each request a fixed row of the pool
    (the prefix cache off): auto takes it only with FA3 decode, which already chose the provider and the layout, and
    only from a provider without paged KV (the paged path has not run on a GPU)."""
    from lightllm.kernels.attention.decode import fa3

    caplog.set_level(logging.INFO)
    slots = fa3.FA3Provider("fa3_fwd_interface", "0.0.3", paged=False, split=True, fn=None, fp16=False)
    monkeypatch.setattr(fa3, "find_fa3_provider", lambda: slots)
    assert pick_prefill_backend("auto", "fa3") == "fa3" and pick_prefill_backend("auto", "triton") == "triton"
    assert pick_prefill_backend("fa3", "triton") == "fa3" and pick_prefill_backend("triton", "fa3") == "triton"
    monkeypatch.setattr(fa3, "find_fa3_provider", lambda: fa3.FA3Provider("sgl_kernel", "1", True, True, None))
    assert pick_prefill_backend("auto", "fa3") == "triton" and pick_prefill_backend("fa3", "fa3") == "fa3"
    assert [r.message for r in caplog.records if "auto ->" in r.message] == [
        "--llm_prefill_att_backend auto -> fa3 (FA3 decode: the same provider and KV layout)",
        "--llm_prefill_att_backend auto -> triton (FA3 decode is off; --llm_prefill_att_backend fa3 asks for FA3 "
        "prefill alone)",
        "--llm_prefill_att_backend auto -> triton (sgl_kernel has paged KV, whose FA3 prefill path has not run on a "
        "GPU yet; --llm_prefill_att_backend fa3 asks for it)",
    ]


# ---- --llm_decode_att_backend auto ------------------------------------------------------------------------


def test_decode_backend_auto_on_cpu_is_triton_and_logged(model, caplog):
    caplog.set_level(logging.INFO)
    assert parse(model, "--llm_decode_att_backend", "auto")[1].llm_decode_att_backend == "triton"
    assert "--llm_decode_att_backend auto -> triton (FA3 needs a Hopper GPU (sm90, H100/H200), found no GPU)" in [
        r.message for r in caplog.records
    ]


@pytest.fixture
def fake_gpu(monkeypatch):
    """A visible CUDA device whose Hopper-ness and FA3 provider the test sets."""
    state = SimpleNamespace(hopper=True, provider=fa3.FA3Provider("flash_attn_3", "3", True, True, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(fa3, "is_hopper", lambda device: state.hopper)
    monkeypatch.setattr(fa3, "find_fa3_provider", lambda: state.provider)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    return state


def test_decode_backend_auto_picks_fa3_only_where_it_runs(fake_gpu, caplog):
    caplog.set_level(logging.INFO)
    gpu, bf16, fp16 = torch.device("cuda"), torch.bfloat16, torch.float16
    assert pick_decode_backend("auto", gpu, "None", bf16) == "fa3"
    assert pick_decode_backend("auto", gpu, "int8kv", bf16) == "triton"
    assert pick_decode_backend("auto", gpu, "None", torch.float32) == "triton"
    fake_gpu.provider = fa3.FA3Provider("fa3_fwd_interface", "0.0.3", False, True, None, fp16=False)
    assert pick_decode_backend("auto", gpu, "None", fp16) == "triton"
    fake_gpu.provider = None
    assert pick_decode_backend("auto", gpu, "None", bf16) == "triton"
    fake_gpu.hopper = False
    assert pick_decode_backend("auto", gpu, "None", bf16) == "triton"
    assert pick_decode_backend("triton", gpu, "None", bf16) == "triton"
    assert pick_decode_backend("fa3", gpu, "None", bf16) == "fa3"
    assert [r.message for r in caplog.records if "auto ->" in r.message] == [
        "--llm_decode_att_backend auto -> fa3 (Hopper GPU, flash_attn_3)",
        "--llm_decode_att_backend auto -> triton (FA3 reads no quantized KV cache (--llm_kv_type int8kv))",
        "--llm_decode_att_backend auto -> triton (FA3 runs bfloat16/float16 models, got torch.float32)",
        "--llm_decode_att_backend auto -> triton (fa3_fwd_interface 0.0.3 was built without float16)",
        "--llm_decode_att_backend auto -> triton (no FlashAttention-3 provider found)",
        "--llm_decode_att_backend auto -> triton (FA3 needs a Hopper GPU (sm90, H100/H200), found NVIDIA A100)",
    ]


def test_explicit_fa3_with_a_dtype_the_build_does_not_run_stops_start_up(fake_gpu):
    fake_gpu.provider = fa3.FA3Provider("fa3_fwd_interface", "0.0.3", False, True, None, fp16=False)
    gpu = torch.device("cuda")
    for flag in ("--llm_decode_att_backend", "--llm_prefill_att_backend"):
        with pytest.raises(ValueError, match=f"{flag} fa3: FA3 runs bfloat16/float16 models, got torch.float32; "
                                             f"use {flag} triton"):  # fmt: skip
            check_fa3_flags({flag: "fa3"}, gpu, "None", torch.float32)
        with pytest.raises(ValueError, match=f"{flag} fa3: fa3_fwd_interface 0.0.3 was built without float16"):
            check_fa3_flags({flag: "fa3"}, gpu, "None", torch.float16)
        check_fa3_flags({flag: "fa3"}, gpu, "None", torch.bfloat16)  # runs
        check_fa3_flags({flag: "triton"}, gpu, "None", torch.float32)  # not asked for


@pytest.mark.parametrize("flag", ["--llm_decode_att_backend", "--llm_prefill_att_backend"])
def test_explicit_fa3_that_cannot_run_on_the_gpu_stops_start_up_before_any_load(fake_gpu, capsys, model, flag):
    """No FA3 provider, or a GPU that is not Hopper: one line when the flags are parsed (no weight loaded yet), the
    same line the backend's require_fa3 raises."""

    def refused_and_required(want):
        assert refused(capsys, model, "--device", "cuda", flag, "fa3") == f"error: {want}"
        with pytest.raises(ValueError, match=re.escape(want)):
            EngineArgs(device="cuda", data_type="bf16", **{flag[2:]: "fa3"}).normalize()
        with pytest.raises(RuntimeError) as built:
            fa3.require_fa3(torch.device("cuda"), flag)
        assert str(built.value) == want

    fake_gpu.provider = None
    refused_and_required(f"{flag} fa3: no FlashAttention-3 provider found; {fa3.INSTALL_HINT}")
    fake_gpu.hopper = False  # no install helps: the GPU is named first
    refused_and_required(f"{flag} fa3: FA3 needs a Hopper GPU (sm90, H100/H200), found NVIDIA A100; use {flag} triton")
    with pytest.raises(ValueError, match=re.escape(f"{flag} fa3: FA3 reads no quantized KV cache (--llm_kv_type "
                                                   f"int4kv); use --llm_kv_type None or {flag} triton")):  # fmt: skip
        EngineArgs(device="cuda", llm_kv_type="int4kv", **{flag[2:]: "fa3"}).normalize()


def test_explicit_fa3_where_it_runs_is_kept(fake_gpu):
    args = EngineArgs(device="cuda", data_type="bf16", llm_decode_att_backend="fa3", llm_prefill_att_backend="fa3")
    args.normalize().fit_to_model(4096, 128)
    assert (args.llm_decode_att_backend, args.llm_prefill_att_backend) == ("fa3", "fa3")
    assert fa3.require_fa3(torch.device("cuda")) is fake_gpu.provider


def test_tokenizer_modes(model, capsys):
    assert load_tokenizer(model, "fast").is_fast and load_tokenizer(model, "auto").is_fast
    with pytest.raises(ValueError, match="--tokenizer_mode slow: .* has no slow tokenizer; use fast or auto"):
        load_tokenizer(model, "slow")
    err = refused(capsys, model, "--tokenizer_mode", "sentencepiece")
    assert "--tokenizer_mode" in err and "'sentencepiece'" in err and "'fast', 'slow', 'auto'" in err


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def test_chat_template_from_a_file_or_inline_replaces_the_tokenizers(model, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    msgs = [{"role": "user", "content": "hi"}]
    default = load_tokenizer(model).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for value in (str(path), TEMPLATE):
        server, _ = parse(model, "--chat_template", value)
        assert server.chat_template == TEMPLATE
        tokenizer = load_tokenizer(model, chat_template=server.chat_template)
        assert tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "<user>hi"
    assert default != "<user>hi"


def test_a_bad_chat_template_is_one_line(capsys, model, tmp_path):
    missing = str(tmp_path / "nope.jinja")
    assert refused(capsys, model, "--chat_template", missing) == (
        f"error: --chat_template expected a Jinja template file or an inline template, got {missing!r}: no such file"
    )
    err = refused(capsys, model, "--chat_template", "{% for m in messages %}")
    assert err.startswith("error: --chat_template '{% for m in messages %}': invalid Jinja at line 1: ")
    assert "'endfor'" in err


def test_an_unreadable_chat_template_file_is_one_line(capsys, model, tmp_path):
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes(b"\xff{{ messages }}")
    err = refused(capsys, model, "--chat_template", str(latin1))
    assert err.startswith(f"error: --chat_template {str(latin1)!r}: cannot read: 'utf-8' codec can't decode byte 0xff")
    if os.path.exists("/proc/self/mem"):  # a file whose read fails (EIO at offset 0)
        err = refused(capsys, model, "--chat_template", "/proc/self/mem")
        assert err.startswith("error: --chat_template '/proc/self/mem': cannot read: [Errno")
