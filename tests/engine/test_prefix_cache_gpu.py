"""The prefix cache's publishing on the GPU (tiny models, bf16, graphs on): a request admitted while another decodes
reads that one's published prompt; Qwen3.5's second request with a shared prefix stops at the branch and leaves a
checkpoint, from which the third starts. Each request's first-token log-probabilities match the cache-off engine's
to bf16's tolerance (a wrong state or a wrong slot would move them by far more)."""

import pytest

from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, QWEN3_5_GPU_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5
from tests.engine.test_engine_gpu import engine_args

pytestmark = pytest.mark.gpu

SHARED = list(range(10, 210))  # a 200-token system prompt: over the scheduler's minimum branch (64)


@pytest.fixture(scope="module", params=["qwen3", "qwen3.5"])
def model_dir(request, tmp_path_factory):
    if request.param == "qwen3":
        return str(make_tiny_qwen3(tmp_path_factory.mktemp("q3"), seed=1, **BUILTIN_SHAPE))
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("q35"), seed=2, **QWEN3_5_GPU_SHAPE))


def first_tokens(engine, prompts, steps_between=0, max_new=4):
    """Submit ``prompts`` one by one, ``steps_between`` engine steps apart; run all to the end: per prompt, (its
    first token's log-probability, its cached prompt tokens, its tokens)."""
    got = [dict(tokens=[], logprob=None, cached=None) for _ in prompts]

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                if not got[i]["tokens"]:
                    got[i]["logprob"], got[i]["cached"] = ev.logprob, ev.cached_tokens
                got[i]["tokens"].append(ev.token_id)

        return emit

    for i, p in enumerate(prompts):
        engine.submit(Request(str(i), p, SamplingParams(max_new_tokens=max_new, ignore_eos=True), emitter(i)))
        for _ in range(steps_between):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return got


def test_published_prompts_and_branches_are_reused_on_the_gpu(model_dir):
    from lightllm.engine.model_runner import ModelRunner

    prompts = [SHARED + [300 + i, 301 + i] for i in range(3)]
    off = first_tokens(Engine(ModelRunner(engine_args(model_dir, disable_dynamic_prompt_cache=True)), eos_ids=[]),
                       prompts, steps_between=3)  # fmt: skip
    runner = ModelRunner(engine_args(model_dir))
    on = first_tokens(Engine(runner, eos_ids=[]), prompts, steps_between=3)  # each admitted while the last decodes
    hybrid = runner.kv.stateful
    # Qwen3: the second and third read the first's published prompt; Qwen3.5: the second stops at the branch
    assert [g["cached"] for g in on] == ([0, 0, 200] if hybrid else [0, 200, 200])
    for got, want in zip(on, off):
        assert abs(got["logprob"] - want["logprob"]) < 0.05, (got, want)
    assert runner.kv.prefix.num_evictable == runner.kv.prefix.num_tokens  # every pin released


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("q35-mtp"), seed=2, mtp="agree", **QWEN3_5_GPU_SHAPE))


def test_with_mtp_the_third_request_reads_the_shared_prompt_on_the_gpu(mtp_dir):
    """MTP's draft and verify graphs around the prompt-end and request-end checkpoints: the third request reads
    the shared prompt but its last slot (keyed with the next token, which differs), its first token as the
    cache-off engine's, and the agreeing head's drafts accepted as often (a wrong cached head entry would cost
    acceptance)."""
    from lightllm.engine.model_runner import ModelRunner

    from tests.engine.test_mtp_engine import SpecCounts

    prompts = [SHARED + [300 + i, 301 + i] for i in range(3)]
    mtp = dict(mtp_mode="eagle_with_att", mtp_step=2)
    runs = {}
    for cache in (False, True):
        counts = SpecCounts()
        runner = ModelRunner(engine_args(mtp_dir, disable_dynamic_prompt_cache=not cache, **mtp))
        runs[cache] = first_tokens(Engine(runner, eos_ids=[], observer=counts), prompts, steps_between=3, max_new=8)
        runs[cache, "spec"] = counts.drafts, counts.accepted
    assert [g["cached"] for g in runs[True]] == [0, 0, 199]
    for got, want in zip(runs[True], runs[False]):
        assert abs(got["logprob"] - want["logprob"]) < 0.05, (got, want)
    (drafts_on, accepted_on), (drafts_off, accepted_off) = runs[True, "spec"], runs[False, "spec"]
    assert accepted_off > 0 and accepted_on / drafts_on >= 0.9 * accepted_off / drafts_off
    assert runner.kv.prefix.num_evictable == runner.kv.prefix.num_tokens  # every pin released
