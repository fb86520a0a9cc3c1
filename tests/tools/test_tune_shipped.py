import json
import os
import logging

import pytest
import torch

from lightllm.tools import tune_shipped


def test_variants_map_to_backend_and_kv_type():
    kw = tune_shipped._start_kwargs("m", "int4kv", 4096)
    assert (kw["llm_kv_type"], kw["llm_decode_att_backend"], kw["graph_max_len_in_batch"]) == ("int4kv", "triton", 4096)
    kw = tune_shipped._start_kwargs("m", "fa3", 32768)
    assert (kw["llm_kv_type"], kw["llm_decode_att_backend"], kw["max_req_total_len"]) == ("None", "fa3", 32768)
    assert "mtp_mode" not in kw
    kw = tune_shipped._start_kwargs("m", "triton", 4096, mtp_step=3)
    assert (kw["mtp_mode"], kw["mtp_step"], kw["llm_kv_type"]) == ("eagle_with_att", 3, "None")
    assert "graph_len_buckets" not in kw


def test_buckets_below_each_start_s_graph_length_reach_the_engine():
    """``--graph-len-buckets 1024 4096 16384``: a 32K start captures its graphs per bucket (tuned per served range);
    a 4096 start keeps the 1024 bucket only; a 1024 start none."""
    from lightllm.engine.args import EngineArgs

    buckets = [1024, 4096, 16384]
    kw = tune_shipped._start_kwargs("m", "triton", 32768, buckets=buckets)
    assert kw["graph_len_buckets"] == buckets
    assert tune_shipped._start_kwargs("m", "triton", 4096, buckets=buckets)["graph_len_buckets"] == [1024]
    assert "graph_len_buckets" not in tune_shipped._start_kwargs("m", "triton", 1024, buckets=buckets)
    args = EngineArgs(**{k: v for k, v in kw.items() if k != "model_dir"}, device="cpu")
    assert args.normalize().fit_to_model(32768, 128, "bfloat16").graph_lens() == [1024, 4096, 16384, 32768]


def _ship(name):
    """A shipped config folder for kernel ``name`` (the tests' shipped root is an empty temporary folder)."""
    from lightllm.common.autotuner import store

    (store.SHIPPED_ROOT / "triton_3.6.0" / "NVIDIA_H200" / name).mkdir(parents=True, exist_ok=True)


def test_bad_arguments_and_no_gpu(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--graph-lens", "4096", "1", "0"])
    assert "--graph-lens expected lengths of at least 2 (one prompt token and one generated), got [1, 0]" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--graph-len-buckets", "4096", "-1"])
    assert "--graph-len-buckets expected positive lengths, got [-1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--shapes", "qwen9"])
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--mtp-step", "5"])
    assert "--mtp-step expected 0 (no MTP starts) or a draft count in [1, 4], got 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--mtp-step", "0", "--mtp-only"])
    assert "--mtp-only expected --mtp-step in [1, 4], got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--per-start-timeout", "0"])
    assert "--per-start-timeout expected a positive number of seconds, got 0" in capsys.readouterr().err
    _ship("gqa_flash_decode_int8kv")
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--retune", "gqa_flash_decode_int9kv"])
    err = capsys.readouterr().err
    assert "--retune expected 'all' or kernels with shipped configs (" in err and "gqa_flash_decode_int8kv" in err
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--retune", "all", "rmsnorm"])
    assert "--retune expected 'all' or kernels" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert tune_shipped.main(["--out", "x"]) == 2
    assert "tuning needs a CUDA GPU" in capsys.readouterr().err


def test_out_and_log_dir_that_cannot_be_folders_stop_before_any_start(tmp_path, capsys):
    """Each export would fail after its start's tuning (an hour on a GPU, in a scratch folder then removed)."""
    file = tmp_path / "file"
    file.write_text("")
    for flag, path, problem in [
        ("--out", str(file), "is a file"),
        ("--out", "", "is empty"),
        ("--out", str(file / "configs"), f"is under a file ({file})"),
        ("--log-dir", str(file), "is a file"),
        ("--log-dir", "", "is empty"),  # not the current folder
    ]:
        argv = ["--out", str(tmp_path / "out"), "--dry-run"] + [flag, path]
        with pytest.raises(SystemExit) as exit_info:
            tune_shipped.main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [  # one line: no usage block above it
            f"python -m lightllm.tools.tune_shipped: error: {flag} {path!r} {problem}; expected a folder to create "
            "or write into"
        ]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_log_dir_that_cannot_be_created_is_one_line_before_any_start(monkeypatch, tmp_path, capsys):
    ran = []
    _fake_starts(monkeypatch, lambda *args, **kwargs: ran.append(args))
    argv = ["--out", str(tmp_path / "out"), "--shapes", "builtin", "--variants", "triton", "--log-dir", "/proc/nope"]
    assert tune_shipped.main(argv) == 2  # /proc takes no new folders, not even root's
    assert capsys.readouterr().err.startswith("error: --log-dir '/proc/nope' cannot be created (FileNotFoundError: ")
    assert ran == []


def test_repeated_shapes_variants_and_graph_lens_plan_each_start_once(capsys):
    argv = ["--out", "x", "--shapes", "builtin", "builtin", "--variants", "triton", "int8kv", "triton", "--graph-lens",
            "4096", "1024", "4096", "--dry-run"]  # fmt: skip
    assert tune_shipped.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [
        "builtin      triton  graph len   4096",
        "builtin      triton  graph len   1024",
        "builtin      int8kv  graph len   4096",
        "builtin      int8kv  graph len   1024",
        "4 starts",
    ]


def test_every_shape_names_its_intermediate_size():
    """The fused SiLU-and-mul kernel is keyed by it: a made-up size would tune a key the real model never uses."""
    assert [shape for shape, widths in tune_shipped.SHAPES.items() if "intermediate_size" not in widths] == []


def test_mtp_starts_only_for_qwen3_5_on_unquantized_kv():
    starts = tune_shipped.plan_starts(["qwen3-8b", "qwen3.5-27b"], ["triton", "int8kv", "fa3"], [4096], 3)
    assert [(s.shape, s.variant, s.mtp_step) for s in starts] == [
        ("qwen3-8b", "triton", 0),
        ("qwen3-8b", "int8kv", 0),
        ("qwen3-8b", "fa3", 0),
        ("qwen3.5-27b", "triton", 0),
        ("qwen3.5-27b", "triton", 3),
        ("qwen3.5-27b", "int8kv", 0),
        ("qwen3.5-27b", "fa3", 0),
        ("qwen3.5-27b", "fa3", 3),
    ]
    assert all(s.mtp_step == 0 for s in tune_shipped.plan_starts(["qwen3.5-27b"], ["triton"], [4096], 0))
    only = tune_shipped.plan_starts(["qwen3-8b", "qwen3.5-27b"], ["triton", "int8kv", "fa3"], [4096], 3, mtp_only=True)
    assert [(s.shape, s.variant, s.mtp_step) for s in only] == [("qwen3.5-27b", "triton", 3), ("qwen3.5-27b", "fa3", 3)]


def test_dry_run_lists_the_starts_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = [
        "--out",
        "x",
        "--shapes",
        "qwen3.5-27b",
        "--variants",
        "triton",
        "int4kv",
        "--graph-lens",
        "4096",
        "--dry-run",
    ]
    assert tune_shipped.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [
        "qwen3.5-27b  triton  graph len   4096",
        "qwen3.5-27b  triton  graph len   4096  mtp_step 3",
        "qwen3.5-27b  int4kv  graph len   4096",
        "3 starts",
    ]


def test_a_start_over_its_timeout_is_stopped_and_named(monkeypatch, tmp_path):
    monkeypatch.setattr(tune_shipped, "_START", "print('started', flush=True)\nimport time\ntime.sleep(600)")
    log = tmp_path / "start.log"
    with pytest.raises(RuntimeError, match=r"ran out of --per-start-timeout 0.5 s and was stopped \(no searches\)"):
        tune_shipped._run_start({"model_dir": "m"}, tmp_path, timeout=0.5, log_path=log)
    # a stopped start's log is kept (what it holds depends on how far a busy machine got in 0.5 s: not checked)
    assert log.exists() and set(log.read_text().split()) <= {"started"}


def test_a_start_gets_the_kernels_whose_shipped_configs_it_ignores_in_its_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", raising=False)
    monkeypatch.setattr(tune_shipped, "_START", "import os\nprint(os.environ.get('LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED'))")
    log = tmp_path / "start.log"
    tune_shipped._run_start({"model_dir": "m"}, tmp_path, timeout=None, log_path=log)
    assert log.read_text() == "None\n"
    tune_shipped._run_start({"model_dir": "m"}, tmp_path, None, log, ["gqa_flash_decode_int8kv", "rmsnorm"])
    assert log.read_text() == "gqa_flash_decode_int8kv,rmsnorm\n"
    assert "LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED" not in os.environ  # the caller's environment is left alone


def test_a_failed_start_names_itself_and_keeps_its_log(monkeypatch, tmp_path):
    monkeypatch.setattr(tune_shipped, "_START", "print('started', flush=True)\nraise SystemExit(3)")
    log = tmp_path / "start.log"
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\):\nstarted$"):
        tune_shipped._run_start({"model_dir": "m"}, tmp_path, timeout=None, log_path=log)
    assert log.read_text() == "started\n"


def _fake_starts(monkeypatch, run_start):
    """main() with ``run_start`` as each start and the export recorded: (argv, what each export saw)."""
    exported = []

    def export(argv):
        from lightllm.common import envs

        exported.append((argv, sorted(p.name for p in envs.get_autotune_config_dir().rglob("*.json"))))
        return 0

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(tune_shipped, "build_model", lambda out, widths, max_len, mtp=False, vocab=0: out)
    monkeypatch.setattr(tune_shipped, "_run_start", run_start)
    monkeypatch.setattr("lightllm.common.autotuner.__main__.main", export)
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", "unused")  # main points it at its scratch folder
    return exported


def _tune(config_dir, name):
    """What a start's search leaves in the scratch folder: one config file of kernel ``name``."""
    kernel_dir = config_dir / "triton_3.6.0" / "NVIDIA_H200" / name
    kernel_dir.mkdir(parents=True, exist_ok=True)
    (kernel_dir / "k=1.json").write_text(json.dumps({"configs": {}}))


def test_a_failed_start_loses_nothing_the_others_tuned(monkeypatch, tmp_path, capsys):
    """Every planned start runs; what each tuned is exported as it ends, the failed one's included; the failure is
    named and the status is 1."""
    ran = []

    def run_start(kwargs, config_dir, timeout, log_path, ignore_shipped=()):
        log_path.write_text("")
        backend, graph_len = kwargs["llm_decode_att_backend"], kwargs["graph_max_len_in_batch"]
        ran.append((backend, graph_len, timeout))
        _tune(config_dir, f"{backend}{graph_len}")
        if graph_len == 4096 and backend == "fa3":
            raise RuntimeError("start failed (exit 1)")
        return 1.0

    exported = _fake_starts(monkeypatch, run_start)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "builtin", "--variants", "fa3", "triton", "--graph-lens",
            "4096", "8192", "--per-start-timeout", "900"]  # fmt: skip
    assert tune_shipped.main(argv) == 1
    assert ran == [("fa3", 4096, 900.0), ("fa3", 8192, 900.0), ("triton", 4096, 900.0), ("triton", 8192, 900.0)]
    assert [argv for argv, _ in exported] == [["export", str(tmp_path / "out")]] * 4
    assert [len(files) for _, files in exported] == [1, 2, 3, 4]  # the scratch folder grows start by start
    err = capsys.readouterr().err
    assert "builtin      fa3     graph len   4096: FAILED, start failed (exit 1)" in err
    assert "1 of 4 starts failed" in err


def test_a_run_stopped_by_sigterm_exports_what_it_tuned_and_ends(monkeypatch, tmp_path, capsys):
    """``timeout`` or a batch job's time limit sends SIGTERM: the running start is unwound (its process tree stopped by
    ``_run_start``), what it and the starts before it tuned is exported, no later start runs."""
    import os
    import signal

    ran = []

    def run_start(kwargs, config_dir, timeout, log_path, ignore_shipped=()):
        log_path.write_text("")
        ran.append(kwargs["graph_max_len_in_batch"])
        _tune(config_dir, f"k{len(ran)}")
        if len(ran) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to main()'s handler, as from outside
        return 1.0

    class Unhandled(Exception):
        pass

    def guard(signum, frame):  # a SIGTERM main() does not take fails this test, never the whole pytest process
        raise Unhandled

    exported = _fake_starts(monkeypatch, run_start)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "builtin", "--variants", "triton", "--graph-lens", "1024",
            "2048", "4096"]  # fmt: skip
    previous = signal.signal(signal.SIGTERM, guard)
    try:
        with pytest.raises(SystemExit) as stop:
            tune_shipped.main(argv)
        assert signal.getsignal(signal.SIGTERM) is guard  # main() put back the handler it found
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 128 + signal.SIGTERM
    assert ran == [1024, 2048]
    assert [len(files) for _, files in exported] == [1, 2]
    assert "builtin      triton  graph len   2048: stopped by SIGTERM (no searches); later starts not run" in (
        capsys.readouterr().err
    )


def test_a_run_with_every_key_already_tuned_succeeds_and_exports_nothing(monkeypatch, tmp_path, capsys):
    """A second pass whose starts all find their configs shipped writes no config: exit 0, ``--out`` untouched."""

    def run_start(kwargs, config_dir, timeout, log_path, ignore_shipped=()):
        # a start that searched nothing: no config written
        log_path.write_text("")
        return 1.0

    exported = _fake_starts(monkeypatch, run_start)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "builtin", "--variants", "triton", "--graph-lens", "4096"]
    assert tune_shipped.main(argv) == 0
    assert exported == []
    assert "nothing new to export" in capsys.readouterr().out


def test_retune_makes_the_starts_ignore_those_kernels_shipped_configs(monkeypatch, tmp_path, capsys):
    """--retune KERNEL ...: every start is told to ignore those kernels' shipped configs (so level 1 searches their
    keys although configs ship); without it the starts read what ships."""
    seen = []

    def run_start(kwargs, config_dir, timeout, log_path, ignore_shipped=()):
        log_path.write_text("")
        seen.append(list(ignore_shipped))
        return 1.0

    _fake_starts(monkeypatch, run_start)
    _ship("gqa_flash_decode_int8kv")
    _ship("gqa_flash_decode_int4kv")
    monkeypatch.delenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", raising=False)
    argv = ["--out", str(tmp_path / "out"), "--shapes", "builtin", "--variants", "int8kv", "--graph-lens", "4096"]
    assert tune_shipped.main(argv) == 0
    assert tune_shipped.main(argv + ["--retune", "gqa_flash_decode_int8kv", "gqa_flash_decode_int4kv"]) == 0
    assert seen == [[], ["gqa_flash_decode_int8kv", "gqa_flash_decode_int4kv"]]
    # main() puts back the config folder it pointed its export at, and sets nothing else
    assert (
        "LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED" not in os.environ and os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] == "unused"
    )
    # these fake starts search nothing: with --retune that is said as such, not as "already shipped"
    assert "no start searched gqa_flash_decode_int8kv, gqa_flash_decode_int4kv" in capsys.readouterr().out


def test_mtp_only_without_a_start_to_run_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert tune_shipped.main(["--out", "x", "--shapes", "qwen3-8b", "--mtp-only"]) == 2
    assert "no start to run" in capsys.readouterr().err


# The Qwen3.5-27B entry scaled down (a quarter of every head count and head width, hidden / 40) for a CPU build
SMALL_QWEN3_5 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=6, num_key_value_heads=1, head_dim=64,
                     partial_rotary_factor=0.25, linear_num_key_heads=4, linear_num_value_heads=12,
                     linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)  # fmt: skip


def test_qwen3_5_model_folder_has_one_layer_of_each_kind_and_its_mtp_head_and_loads(tmp_path):
    from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig
    from lightllm.models.qwen3_5.family import has_mtp_weights
    from lightllm.models.qwen3_5.weights import load_qwen3_5_weights

    assert set(SMALL_QWEN3_5) == set(tune_shipped.SHAPES["qwen3.5-27b"])  # the same fields as the real entry
    model_dir = tune_shipped.build_model(tmp_path / "m", SMALL_QWEN3_5, 4096, mtp=True)
    config = Qwen3_5ModelConfig.from_model_dir(model_dir)
    assert config.layer_types == ("linear_attention", "full_attention") and config.num_kv_layers == 1
    assert (config.linear_num_value_heads, config.head_dim, config.rotary_dim) == (12, 64, 16)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert has_mtp_weights(model_dir)
    weights = load_qwen3_5_weights(model_dir, config, torch.float32, mtp=True)
    assert weights.mtp is not None
    # the checkpoint's vocabulary rows (the lm_head GEMM's tuned width), over the small tokenizer's own
    padded = tune_shipped.build_model(tmp_path / "v", SMALL_QWEN3_5, 4096, vocab=1000)
    assert json.loads((padded / "config.json").read_text())["vocab_size"] == 1000
    assert tune_shipped.VOCABS["qwen3.5-27b"] == 248320 and tune_shipped.VOCABS["qwen3-8b"] == 151936
    assert set(tune_shipped.VOCABS) == set(tune_shipped.SHAPES) - {"builtin"}
    with pytest.raises(ValueError, match="mtp=True expected a Qwen3.5 shape"):
        tune_shipped.build_model(tmp_path / "q3", tune_shipped.SHAPES["builtin"], 4096, mtp=True)


def test_qwen3_5_27b_widths_pass_the_models_config_checks(tmp_path):
    """The real widths in one linear and one full layer, through the config reader the server uses (no weights)."""
    from transformers import Qwen3_5TextConfig

    from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig

    widths = dict(tune_shipped.SHAPES["qwen3.5-27b"])
    factor = widths.pop("partial_rotary_factor")
    hf = Qwen3_5TextConfig(num_hidden_layers=2, layer_types=list(tune_shipped.HYBRID_LAYERS), vocab_size=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": factor},
                           **widths)  # fmt: skip
    hf.architectures = ["Qwen3_5ForCausalLM"]
    hf.save_pretrained(tmp_path)
    c = Qwen3_5ModelConfig.from_model_dir(tmp_path)
    assert (c.num_attention_heads // c.num_key_value_heads, c.head_dim, c.rotary_dim) == (6, 256, 64)
    assert (c.linear_num_value_heads // c.linear_num_key_heads, c.linear_conv_dim) == (3, 2 * 16 * 128 + 48 * 128)


def test_search_summary_reads_the_tuners_own_log_lines(caplog, monkeypatch, isolated_autotune):
    """Where a start's time went, from the log lines a real search writes (not a hand-made copy of their format)."""
    from lightllm.common.autotuner import AutotuneKernelType, autotune, autotune_warmup, set_bench_func

    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")

    @autotune("summary_probe", configs_gen_func=lambda: [{"x": 1}, {"x": 2}], static_key_func=lambda a: a.shape[1],
              run_key_func=lambda a: a.shape[0])  # fmt: skip
    def probe(a, run_config=None):
        return a + 1

    set_bench_func(lambda run: (run(), 1.0)[1])
    with caplog.at_level(logging.INFO), autotune_warmup(AutotuneKernelType.GENERAL):
        probe(torch.zeros(2, 3))
        probe(torch.zeros(4, 3))
    summary = tune_shipped.search_summary(caplog.text)
    assert summary.startswith("summary_probe 2 searches ") and summary.endswith(" s")
    assert tune_shipped.search_summary("nothing tuned") == "no searches"
