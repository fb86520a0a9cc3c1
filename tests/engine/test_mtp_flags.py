"""MTP's flags (LightLLM's names): bad values and models that can't serve a mode are one ``error:`` line at start-up;
the offline ``LLM`` raises the same message; the server's metrics count drafts and accepted tokens."""

import contextlib
import shutil

import pytest

from lightllm.engine.args import EngineArgs
from lightllm.server.args import parse_args
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    make = tmp_path_factory.mktemp
    return {"mtp": str(make_tiny_qwen3_5(make("mtp"), mtp=True)), "plain": str(make_tiny_qwen3_5(make("plain"))),
            "qwen3": str(make_tiny_qwen3(make("qwen3")))}  # fmt: skip


def refused(capsys, model, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model_dir", model, "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def test_the_flags_parse_into_the_engine_args(dirs):
    engine = parse_args(["--model_dir", dirs["mtp"], "--device", "cpu", "--mtp_mode", "eagle_with_att", "--mtp_step",
                         "3", "--mtp_draft_model_dir", dirs["mtp"]])[1]  # fmt: skip
    assert (engine.mtp_mode, engine.mtp_step, engine.spec_tokens) == ("eagle_with_att", 3, 4)
    assert parse_args(["--model_dir", dirs["mtp"], "--device", "cpu"])[1].spec_tokens == 1  # off by default


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mtp_mode", "eagle"], "argument --mtp_mode: invalid choice: 'eagle'"),
        (["--mtp_mode", "eagle_with_att"], "--mtp_step expected an integer in [1, 4] with --mtp_mode, got 0"),
        (["--mtp_mode", "eagle_with_att", "--mtp_step", "5"], "--mtp_step expected an integer in [1, 4]"),
        (["--mtp_step", "2"], "--mtp_step 2 expected --mtp_mode (one of ('vanilla_with_att', 'eagle_with_att', "),
        (["--mtp_mode", "vanilla_with_att", "--mtp_step", "1"], "the checkpoint's single MTP layer, reused for every "
         "draft step, is --mtp_mode eagle_with_att; vanilla_with_att is not served"),
        (["--mtp_mode", "eagle_with_att", "--mtp_step", "1", "--mtp_draft_model_dir", "/elsewhere"],
         "--mtp_draft_model_dir /elsewhere: expected a folder holding the MTP head (mtp.* weights and a config.json), "
         "found no such folder"),
    ],
    ids=["mode", "no step", "step 5", "step without mode", "vanilla", "no draft dir"],
)  # fmt: skip
def test_bad_values_are_one_line(capsys, dirs, argv, message):
    assert message in refused(capsys, dirs["mtp"], *argv)


@pytest.mark.parametrize(
    "model, message",
    [("plain", "can't run on {dir}: its safetensors files hold no MTP head (mtp.* weights)"),
     ("qwen3", "--mtp_mode eagle_with_att: Qwen3 models have no MTP head; MTP serves Qwen3.5")],
)  # fmt: skip
def test_a_model_that_cannot_serve_mtp_is_one_line(capsys, dirs, model, message):
    got = refused(capsys, dirs[model], "--mtp_mode", "eagle_with_att", "--mtp_step", "2")
    assert message.format(dir=dirs[model]) in got


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory, dirs):
    """The "mtp" folder split into a main folder without ``mtp.*`` weights and a head folder; a head folder whose
    config.json disagrees with the main model (hidden size); a folder without a config.json."""
    from pathlib import Path

    from lightllm.tools.tiny_mtp import split_mtp_head

    out = tmp_path_factory.mktemp("heads")
    split_mtp_head(Path(dirs["mtp"]), out / "main", out / "head")
    wide = make_tiny_qwen3_5(out / "wide-model", mtp=True, hidden_size=96)
    split_mtp_head(wide, out / "wide-main", out / "wide")
    (out / "bare").mkdir()
    (out / "unweighted").mkdir()  # a config.json and no safetensors
    shutil.copy(out / "head" / "config.json", out / "unweighted" / "config.json")
    return {name: str(out / name) for name in ("main", "head", "wide", "bare", "unweighted")}


def test_a_head_folder_of_its_own_is_accepted(dirs, head_dirs):
    argv = ["--device", "cpu", "--mtp_mode", "eagle_with_att", "--mtp_step", "2"]
    engine = parse_args(["--model_dir", head_dirs["main"], *argv, "--mtp_draft_model_dir", head_dirs["head"]])[1]
    assert engine.mtp_draft_model_dir == head_dirs["head"]


@pytest.mark.parametrize(
    "draft, message",
    [("wide", "--mtp_draft_model_dir {wide}: its config.json hidden_size is 96, --model_dir's is 64; the MTP head "
      "must match the main model"),
     ("plain", "--mtp_mode eagle_with_att can't run on {plain}: its safetensors files hold no MTP head (mtp.* "
      "weights)"),
     ("bare", "--mtp_draft_model_dir {bare}: expected a Qwen3.5 folder with a config.json: "),
     ("unweighted", "--mtp_draft_model_dir {unweighted}: {unweighted}: no *.safetensors files found")],
    ids=["config mismatch", "no head weights", "no config", "no safetensors"],
)  # fmt: skip
def test_a_head_folder_that_cannot_serve_is_one_line(capsys, dirs, head_dirs, draft, message):
    folders = {**dirs, **head_dirs}
    got = refused(capsys, head_dirs["main"], "--mtp_mode", "eagle_with_att", "--mtp_step", "2",
                  "--mtp_draft_model_dir", folders[draft])  # fmt: skip
    assert message.format(**folders) in got


def test_offline_llm_raises_the_same_message(dirs):
    from lightllm import LLM

    with pytest.raises(ValueError, match=r"its safetensors files hold no MTP head"):
        LLM(dirs["plain"], device="cpu", data_type="fp32", max_req_total_len=64, mtp_mode="eagle_with_att",
            mtp_step=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"--mtp_step expected an integer, got True \(bool\)"):
        EngineArgs(mtp_mode="eagle_with_att", mtp_step=True, device="cpu").normalize()
    with pytest.raises(ValueError, match=r"--mtp_step expected an integer in \[1, 4\] with --mtp_mode, got 5"):
        EngineArgs(mtp_mode="eagle_with_att", mtp_step=5, device="cpu").normalize()


def test_metrics_count_draft_and_accepted_tokens():
    from prometheus_client import generate_latest

    from lightllm.server.metrics import Metrics

    metrics = Metrics()
    metrics.on_spec(6, 4)
    metrics.on_spec(3, 0)
    text = generate_latest(metrics.registry).decode()
    assert "lightllm_spec_decode_num_draft_tokens_total 9.0" in text
    assert "lightllm_spec_decode_num_accepted_tokens_total 4.0" in text


def test_each_mtp_graph_is_captured_right_after_a_decode_attention_forward(dirs, monkeypatch):
    """Verify, first draft and draft graphs, longest KV length bucket first, then largest batch first: per graph one
    eager forward launched for its bucket inside the DECODE_ATTENTION warm-up scope (where the MTP decode kernels
    tune), then the capture outside it; no plain decode graph."""
    from lightllm.common.autotuner import current_warmup_kernel_type
    from lightllm.engine.model_runner import ModelRunner
    from lightllm.engine.mtp_graphs import MTPGraphs

    log = []
    for kind in ("verify", "first_draft", "draft"):
        real = getattr(MTPGraphs, f"_{kind}_forward")
        monkeypatch.setattr(MTPGraphs, f"_{kind}_forward", lambda self, bs, n, real=real, kind=kind: (
            log.append((kind, n, bs, str(current_warmup_kernel_type()))), real(self, bs, n))[1])  # fmt: skip

    class Capturing:
        def new_graph(self):
            return object()

        def capture(self, graph, pool):
            log.append(("capture", str(current_warmup_kernel_type())))
            return contextlib.nullcontext()

        def pool(self, graph):
            return None

        def memory_used(self):
            return 0

    args = EngineArgs(model_dir=dirs["mtp"], device="cpu", data_type="fp32", max_req_total_len=64,
                      running_max_req_size=2, mtp_mode="eagle_with_att", mtp_step=2,
                      graph_len_buckets=[16])  # fmt: skip
    runner = ModelRunner(args, graph_api=Capturing())
    assert runner.graphs is None
    scope = str(current_warmup_kernel_type())  # outside any warm-up
    tuned = "AutotuneKernelType.DECODE_ATTENTION"
    want = []
    for kind in ("verify", "first_draft", "draft"):
        for n in (64, 16):
            for bs in (2, 1):
                want += [(kind, n, bs, tuned), ("capture", scope), (kind, n, bs, scope)]
    assert log == want


def test_a_cache_without_room_for_one_request_and_its_drafts_is_one_error(dirs):
    from lightllm.engine.model_runner import ModelRunner

    args = EngineArgs(model_dir=dirs["mtp"], device="cpu", data_type="fp32", max_req_total_len=64,
                      max_total_token_num=66, running_max_req_size=2, mtp_mode="eagle_with_att",
                      mtp_step=2)  # fmt: skip
    # refused with the model's config, before any weight loads (the runner's own check came after loading)
    with pytest.raises(ValueError, match=r"--max_total_token_num 66 expected at least 67: one --max_req_total_len "
                                         r"\(64\) \+ --mtp_step 2 request plus the padding token"):  # fmt: skip
        ModelRunner(args)
