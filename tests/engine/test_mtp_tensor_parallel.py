"""MTP speculative decoding at --tp 2 on the CPU (gloo): the head sharded like the main model's full-attention
layers, rank 0's draft picks and acceptance counts broadcast. Greedy tokens and acceptance counts equal one process
with and without MTP, token for token; the head may come from a folder of its own (``--mtp_draft_model_dir``)."""

import json
import os
import sys

import pytest
import torch

from lightllm.common import proc as procs
from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5
from lightllm.tools.tiny_mtp import split_mtp_head
from tests.engine.mtp_tp_probe import generate
from tests.engine.test_mtp_engine import load_benchmark
from tests.engine.test_scheduler import run_all
from tests.server.server_helpers import REPO

PROMPTS = [[5, 6, 7], [100, 20, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19], [250]]
# one more that shares the second's first 17 tokens: admitted a step later, it starts from the second's first chunk
# (its checkpoint in the prefix cache, which every rank keeps alike)
PROMPTS.append(PROMPTS[1][:17] + [33])
NEW_TOKENS = 9
ARGS = dict(data_type="fp32", device="cpu", batch_max_tokens=16, max_req_total_len=64, running_max_req_size=4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A random head (its layer far from the identity: the drafts show whether the sharded layer computes what one
    process does), an agreeing head (~100 % accepted), and one at ~50 % (both paths of every step) split into a
    main folder without ``mtp.*`` weights and a head folder of its own, beside the folder that holds both."""
    out = tmp_path_factory.mktemp("mtp-tp")
    make_tiny_qwen3_5(out / "random", mtp=True, seed=7)
    agree = make_tiny_qwen3_5(out / "agree", mtp="agree", seed=7)
    vocab = json.loads((agree / "config.json").read_text())["vocab_size"]
    noise = load_benchmark("mtp_e2e").noise_for_acceptance(0.5, 64, vocab)
    half = make_tiny_qwen3_5(out / "half", mtp="agree", mtp_noise=noise, seed=7)
    split_mtp_head(half, out / "main", out / "head")
    return {name: str(out / name) for name in ("random", "agree", "half", "main", "head")}


def one_process(model_dir, sampling=None, **opts):
    runner = ModelRunner(EngineArgs(model_dir=model_dir, **ARGS, **opts))
    return generate(runner, {"prompts": PROMPTS, "max_new_tokens": NEW_TOKENS}, sampling)


def test_tp2_mtp_matches_one_process(folders, tmp_path):
    """Greedy: step 1 with the random head, step 3 with the agreeing one and with the half-agreeing one from a
    folder of its own: every tp 2 run proposes one process's drafts, accepts as many and emits its tokens, which
    are those of one process without MTP. Seeded sampling (rank 0 draws the drafts, the workers must follow):
    one process's drafts, acceptance and tokens."""
    mtp = dict(mtp_mode="eagle_with_att")
    runs = [dict(model_dir=folders["random"], mtp_step=1, **mtp), dict(model_dir=folders["agree"], mtp_step=3, **mtp),
            dict(model_dir=folders["main"], mtp_draft_model_dir=folders["head"], mtp_step=3, **mtp),
            dict(model_dir=folders["random"], mtp_step=2, **mtp)]  # fmt: skip
    sampling = dict(temperature=1.0, seed=11)
    spec = {"runs": [{"args": {**ARGS, **run}} for run in runs], "prompts": PROMPTS, "max_new_tokens": NEW_TOKENS}
    spec["runs"][3]["sampling"] = sampling
    # one OpenMP thread per rank: on a 2-core machine threads spinning after each op starve the rank waiting in gloo
    env = {"PYTHONPATH": REPO, "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(tmp_path / "autotune"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = procs.run([sys.executable, "-m", "tests.engine.mtp_tp_probe", json.dumps(spec)], cwd=REPO,
                     timeout=procs.HANG_TIMEOUT_S, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for tp2 in got:
        tp2["tokens"] = {int(i): t for i, t in tp2["tokens"].items()}
    random, agree, apart, sampled = got
    want = {name: one_process(folders[name]) for name in ("random", "agree", "half")}  # MTP off
    both = one_process(folders["half"], mtp_step=3, **mtp)  # the head inside the model's folder
    for tp2, tp1, plain in [(random, one_process(**runs[0]), want["random"]),
                            (agree, one_process(**runs[1]), want["agree"]), (apart, both, want["half"])]:  # fmt: skip
        assert tp2["tokens"] == tp1["tokens"] == plain["tokens"]
        assert (tp2["proposed"], tp2["drafts"], tp2["accepted"]) == (tp1["proposed"], tp1["drafts"], tp1["accepted"])
        assert tp2["cached"] == tp1["cached"] > 0
    assert agree["accepted"] == agree["drafts"] > 0  # the agreeing head: every draft
    assert 0 < apart["accepted"] < apart["drafts"]  # accepted and rejected drafts both happen
    assert one_process(**runs[2]) == both  # one process with the head from its own folder too
    assert sampled == one_process(**runs[3], sampling=sampling)
    assert 0 < sampled["accepted"] < sampled["drafts"]


def test_the_tp_runner_broadcasts_every_mtp_step(folders):
    """Rank 0's MTP steps are written out (none forwarded) and each goes to the workers before it runs here; the
    engine uses exactly the MTPSteps interface."""
    import contextlib

    from lightllm.engine.runner import STATE_CHANGING, MTPSteps
    from lightllm.server import tp
    from tests.engine.test_runner_interface import Recording, members

    class Workers:
        def command(self, name):
            return contextlib.nullcontext()

    rank0 = tp.TPRunner(ModelRunner(EngineArgs(model_dir=folders["half"], mtp_mode="eagle_with_att", mtp_step=2,
                                               **ARGS)), group=None, workers=Workers())  # fmt: skip
    cast, used = [], set()
    rank0._cast = lambda *cmd: cast.append(cmd)
    assert isinstance(rank0.mtp, MTPSteps) and "__getattr__" not in vars(tp.TPMTPSteps)
    assert members(MTPSteps) <= set(vars(tp.TPMTPSteps))
    rank0._mtp = Recording(rank0.mtp, used)
    run_all(Engine(rank0, eos_ids=[]), [[5, 6, 7]], params={0: SamplingParams(max_new_tokens=4, ignore_eos=True)})
    assert used == members(MTPSteps)
    names = [c[0] for c in cast]
    assert names[:5] == ["add_request", "prefill", "mtp.draft", "mtp.verify", "mtp.accept"]
    assert set(names) <= set(STATE_CHANGING) and names[-1] == "free"
    draft = cast[2]
    assert draft == ("mtp.draft", [draft[1][0]], [draft[2][0]])  # slots and last tokens only: no callable


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_mtp_on_two_gpus(tmp_path):
    """NCCL, bf16, the MTP verify and draft graphs (their all-reduces captured) and the eager first draft step:
    greedy tokens at --tp 2 equal --tp 2 without MTP, and the agreeing head's drafts are accepted (~100 %)."""
    from lightllm.tools.make_tiny_model import QWEN3_5_GPU_SHAPE

    gpu = dict(data_type="bf16", device="cuda", batch_max_tokens=128, max_req_total_len=512, running_max_req_size=4,
               graph_max_batch_size=4, max_total_token_num=4096)  # fmt: skip
    model = str(make_tiny_qwen3_5(tmp_path / "agree", mtp="agree", seed=7, dtype="bfloat16", **QWEN3_5_GPU_SHAPE))
    runs = [{"args": {**gpu, "model_dir": model}},
            {"args": {**gpu, "model_dir": model, "mtp_mode": "eagle_with_att", "mtp_step": 3}}]  # fmt: skip
    spec = {"runs": runs, "prompts": PROMPTS, "max_new_tokens": 25}
    env = {"PYTHONPATH": REPO, "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(tmp_path / "autotune"), "HF_HUB_OFFLINE": "1"}
    done = procs.run([sys.executable, "-m", "tests.engine.mtp_tp_probe", json.dumps(spec)], cwd=REPO,
                     timeout=procs.HANG_TIMEOUT_S, env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    off, on = json.loads(done.stdout.strip().splitlines()[-1])
    assert on["tokens"] == off["tokens"]
    assert on["accepted"] >= 0.9 * on["drafts"] > 0
