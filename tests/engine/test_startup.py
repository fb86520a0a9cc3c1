"""Start-up ordering, graph sizes and argument checks, on the CPU with a fake graph API."""

import logging
import re

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, current_warmup_kernel_type
from lightllm.common.cuda_graph import DecodeGraphs
from lightllm.engine.args import EngineArgs
from lightllm.layers.attention import check_head_dim


class FakeGraphAPI:
    """Records the order of events; capture is a context manager that marks 'capturing'."""

    def __init__(self, log):
        self.log = log
        self.capturing = False
        self.pools = []

    def new_graph(self):
        return {"ops": []}

    def capture(self, graph, pool):
        api = self
        self.pools.append(pool)

        class _Ctx:
            def __enter__(self):
                api.capturing = True
                api.log.append(("capture-begin", current_warmup_kernel_type()))

            def __exit__(self, *exc):
                api.capturing = False
                api.log.append(("capture-end", current_warmup_kernel_type()))
                return False

        return _Ctx()

    def pool(self, graph):
        return "shared-pool"

    def replay(self, graph):
        self.log.append(("replay",))

    def memory_used(self):
        return 0


def test_each_capture_follows_a_decode_forward_in_the_decode_attention_scope():
    log = []
    api = FakeGraphAPI(log)

    def run_decode(bs, graph_len):
        log.append(("forward", bs, current_warmup_kernel_type(), api.capturing))
        return torch.full((bs,), float(bs))

    graphs = DecodeGraphs([1, 2, 3, 8], [64], api).capture_all(run_decode)
    forwards = [e for e in log if e[0] == "forward"]
    assert [e[1] for e in forwards] == [8, 8, 3, 3, 2, 2, 1, 1]  # largest first, warmup then capture
    for warm, cap in zip(forwards[::2], forwards[1::2]):
        assert warm[2] is AutotuneKernelType.DECODE_ATTENTION and not warm[3]
        assert cap[2] is None and cap[3]  # outer phase restored for the capture
    assert api.pools == [None, "shared-pool", "shared-pool", "shared-pool"]  # one pool, from the first graph
    assert graphs.pick(1, 64) == (64, 1) and graphs.pick(4, 1) == (64, 8) and graphs.pick(9, 1) is None
    assert torch.equal(graphs.replay((64, 3)), torch.full((3,), 3.0))


def test_failed_warmup_forward_stops_with_phase_restored_and_nothing_captured():
    log = []
    api = FakeGraphAPI(log)

    def run_decode(bs, graph_len):
        if bs == 2:
            raise RuntimeError("out of memory")
        return torch.zeros(bs)

    graphs = DecodeGraphs([1, 2, 4], [64], api)
    with pytest.raises(
        RuntimeError, match="KV-length-64 batch-size-2 graph failed .*out of memory.*--disable_cudagraph"
    ):
        graphs.capture_all(run_decode)
    assert current_warmup_kernel_type() is None
    assert sorted(graphs.graphs) == [(64, 4)] and ("capture-begin", None) in log


def test_graph_sizes_and_cap():
    a = EngineArgs(graph_max_batch_size=64, running_max_req_size=20, graph_split_batch_size=4,
                   graph_grow_step_size=8, device="cpu").normalize()  # fmt: skip
    assert a.graph_max_batch_size == 20
    assert a.graph_batch_sizes() == [1, 2, 3, 4, 12, 20]
    off = EngineArgs(graph_max_batch_size=64, running_max_req_size=20, disable_cudagraph=True, device="cpu")
    assert off.normalize().graph_max_batch_size == 64


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("data_type", "int8", "--data_type expected one of"),
        ("running_max_req_size", 0, "--running_max_req_size expected a positive integer"),
        ("llm_kv_type", "fp8", "--llm_kv_type expected one of"),
        ("llm_decode_att_backend", "flashinfer", "--llm_decode_att_backend expected one of"),
        ("mem_fraction", 1.5, "--mem_fraction expected a value in"),
        ("llm_kv_quant_group_size", 0, "--llm_kv_quant_group_size expected a positive integer, got 0"),
    ],
)
def test_bad_engine_args(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value, "device": "cpu"}).normalize()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mem_fraction", "0.5", "--mem_fraction expected a number, got '0.5' (str)"),
        ("mem_fraction", True, "--mem_fraction expected a number, got True (bool)"),
        ("max_total_token_num", "5000", "--max_total_token_num expected an integer or None, got '5000' (str)"),
        ("max_total_token_num", 5000.5, "--max_total_token_num expected an integer or None, got 5000.5 (float)"),
        ("max_total_token_num", True, "--max_total_token_num expected an integer or None, got True (bool)"),
        ("running_max_req_size", 8.0, "--running_max_req_size expected an integer, got 8.0 (float)"),
        ("mtp_step", "0", "--mtp_step expected an integer, got '0' (str)"),
        ("device", 0, "--device expected a string or None, got 0 (int)"),
        ("disable_cudagraph", "no", "--disable_cudagraph expected a bool (True or False), got 'no' (str)"),
        ("enable_mixed_chunk", 1, "--enable_mixed_chunk expected a bool (True or False), got 1 (int)"),
        ("model_dir", 123, "--model_dir expected a folder path (str or os.PathLike) or None, got 123 (int)"),
        ("mtp_draft_model_dir", 5, "--mtp_draft_model_dir expected a folder path (str or os.PathLike) or None, got 5"),
        ("llm_kv_type", 8, "--llm_kv_type expected a string, got 8 (int)"),  # None is the flag's "None"
        # an unset variable in a launcher's --model_dir "$MODEL": not the built-in random model
        ("model_dir", "", "--model_dir expected a folder path (str or os.PathLike) or None, got '' (str)"),
        (
            "mtp_draft_model_dir",
            " ",
            "--mtp_draft_model_dir expected a folder path (str or os.PathLike) or None, got ' '",
        ),
    ],
)
def test_engine_args_of_the_wrong_type_name_the_option_and_the_type(field, value, message):
    """The offline API takes any value: each option's type is checked as the server's flags are parsed."""
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**{"device": "cpu", field: value}).normalize()


def test_engine_args_take_a_path_for_a_folder_and_an_int_for_a_number(tmp_path):
    args = EngineArgs(device="cpu", model_dir=tmp_path, mem_fraction=1).normalize()
    assert args.model_dir == str(tmp_path) and args.mem_fraction == 1


def test_device_names_the_allowed_values():
    with pytest.raises(ValueError, match="--device expected cpu, cuda or cuda:N, got 'gpu0'"):
        EngineArgs(device="gpu0").normalize()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_req_total_len=1), r"--max_req_total_len expected at least 2 \(one prompt token and one generated\)"),
        (
            dict(max_req_total_len=64, max_total_token_num=68, mtp_mode="eagle_with_att", mtp_step=4),
            r"--max_total_token_num 68 expected at least 69: one --max_req_total_len \(64\) \+ --mtp_step 4 request",
        ),
    ],
)
def test_sizes_that_no_request_fits_are_refused_before_loading(options, message):
    """Checked with the model's config (at parse time), not after the weights load or at the first request."""
    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", **options).normalize().fit_to_model(4096, 128)


@pytest.mark.parametrize(
    "kv_type, group, message",
    [
        ("int8kv", 48, r"--llm_kv_quant_group_size 48 expected a divisor of the model's head_dim / 2 = 64 \(--llm"),
        # decode reads an INT8 row as two halves too: a group of the whole row started up and failed at decode
        ("int8kv", 128, r"--llm_kv_quant_group_size 128 expected a divisor of the model's head_dim / 2 = 64"),
        ("int4kv", 128, r"--llm_kv_quant_group_size 128 expected a divisor of the model's head_dim / 2 = 64"),
    ],
)
def test_kv_group_size_is_checked_against_the_model(kv_type, group, message):
    EngineArgs(llm_kv_type=kv_type, llm_kv_quant_group_size=64, device="cpu").normalize().fit_to_model(4096, 128)
    with pytest.raises(ValueError, match=message):
        EngineArgs(llm_kv_type=kv_type, llm_kv_quant_group_size=group, device="cpu").normalize().fit_to_model(4096, 128)


def test_gpu_head_dim_checked_before_loading():
    check_head_dim(16, torch.device("cpu"))  # the torch references take any head_dim
    for d in (64, 128, 256):
        check_head_dim(d, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"head_dim expected one of \(64, 128, 256\) on a GPU, got 96"):
        check_head_dim(96, torch.device("cuda"))


@pytest.mark.parametrize("level, note", [("1", True), ("2", True), ("0", False), ("3", False)])
def test_summary_says_tuning_needs_a_gpu(tmp_path, monkeypatch, caplog, level, note):
    """On a CPU the torch references run, so a level that asks for tuning tunes nothing: the summary says why."""
    from lightllm.engine.model_runner import ModelRunner
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", level)
    args = EngineArgs(model_dir=str(make_tiny_qwen3(tmp_path / "m", seed=0)), data_type="fp32", device="cpu",
                      batch_max_tokens=16, max_req_total_len=16, running_max_req_size=2)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        ModelRunner(args)
    (ready,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    expected = f"0 kernels tuned (LIGHTLLM_TRITON_AUTOTUNE_LEVEL={level} asks for tuning, but tuning runs only on a GPU"
    assert (expected in ready) == note and ("0 kernels tuned, " in ready) != note


def test_ready_line_counts_the_kernels_compiled_ahead(tmp_path, monkeypatch, caplog):
    """Where a first start's time went: the kernels its searches and warm-ups compiled ahead (a GPU's; here the
    counters are stood in for), and nothing said when none was."""
    from lightllm.common.autotuner import AutotuneStats
    from lightllm.engine import model_runner
    from lightllm.engine.model_runner import ModelRunner
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    args = EngineArgs(model_dir=str(make_tiny_qwen3(tmp_path / "m", seed=0)), data_type="fp32", device="cpu",
                      batch_max_tokens=16, max_req_total_len=16, running_max_req_size=2)  # fmt: skip
    lines = []
    for ahead in (0, 34):
        counters = iter([AutotuneStats(), AutotuneStats(kernels_compiled_ahead=ahead, compile_ahead_seconds=8.74)])
        monkeypatch.setattr(model_runner, "get_autotune_stats", lambda: next(counters))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
            ModelRunner(args)
        lines += [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert "compiled ahead" not in lines[0]
    assert "0 configs written, 34 kernels compiled ahead in 8.7s; " in lines[1]


def test_data_type_auto_is_the_checkpoints_own(caplog):
    caplog.set_level(logging.INFO)
    fit = lambda dtype: EngineArgs(device="cpu").normalize().fit_to_model(4096, 128, dtype)  # noqa: E731
    assert fit("float16").torch_dtype == torch.float16
    assert fit("bfloat16").data_type == "bfloat16"
    assert fit("float8_e4m3fn").data_type == "bf16" and fit(None).data_type == "bf16"
    notes = [r.message for r in caplog.records if r.message.startswith("data_type auto")]
    assert notes == [
        "data_type auto -> float16 (the checkpoint's dtype)",
        "data_type auto -> bfloat16 (the checkpoint's dtype)",
        "data_type auto -> bf16 (config.json names 'float8_e4m3fn')",
        "data_type auto -> bf16 (config.json names no dtype)",
    ]
    with pytest.raises(RuntimeError, match="data_type 'auto' is resolved by fit_to_model"):
        EngineArgs(device="cpu").normalize().torch_dtype
    with pytest.raises(ValueError, match=r"--data_type expected one of \('auto', 'bf16'"):
        EngineArgs(device="cpu", data_type="int8").normalize()
