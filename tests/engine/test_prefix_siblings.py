"""Requests that arrive together with a shared prefix (``n`` samples of one prompt, a system prompt several clients
send at once): the first is prefilled, the others wait until it has published what they share and read it from the
prefix cache, so the shared tokens are computed once. Qwen3 (KV alone), Qwen3.5 (the first stops a chunk where
they part, for a state checkpoint) and Qwen3.5 with MTP (slots keyed with the next token); greedy tokens as the
cache-off engine's, on the CPU in float32."""

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5
from tests.engine.test_prefix_cache import counting
from tests.engine.test_scheduler import run_all

GEN = torch.Generator().manual_seed(31)
SHARED = torch.randint(3, 400, (100,), generator=GEN).tolist()


@pytest.fixture(scope="module", params=["qwen3", "qwen3.5", "qwen3.5-mtp"])
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        return str(make_tiny_qwen3(out, seed=3)), {}
    if request.param == "qwen3.5":
        return str(make_tiny_qwen3_5(out, seed=3)), {}
    return str(make_tiny_qwen3_5(out, mtp=True, seed=3)), dict(mtp_mode="eagle_with_att", mtp_step=2)


def engine(model, cache=True, branch_min=8, **kw):
    """An engine whose scheduler waits for a sibling from ``branch_min`` shared tokens on (64 by default: here the
    budget is 64 tokens a step, so fewer make the steps visible)."""
    model_dir, opts = model
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=160,
                      running_max_req_size=4, linear_att_cache_size=8, disable_dynamic_prompt_cache=not cache,
                      **opts, **kw)  # fmt: skip
    runner = ModelRunner(args)
    eng = Engine(runner, eos_ids=[])
    eng.scheduler.branch_min_tokens = branch_min
    return eng, counting(runner)


def cached_tokens(eng, prompts):
    """The tokens each admission read from the cache, in admission order (the prompts submitted together and run to
    the end), and each prompt's tokens."""
    got = {}
    real = eng.runner.add_request

    def admit(prefix=()):
        slot = real(prefix)
        got[len(got)] = len(prefix)
        return slot

    eng.runner.add_request = admit
    tokens, _ = run_all(eng, prompts, max_new=5)
    return [got[i] for i in range(len(prompts))], tokens


def test_samples_of_one_prompt_compute_it_once(model):
    """Four samples of a 100-token prompt: the first prefills it (Qwen3.5 stops a chunk one token short, where the
    others part from it: their last token is computed for its logits), the other three read all but the last
    token, and the tokens computed are the prompt's once plus one per sample."""
    prompts = [SHARED] * 4
    off, off_calls = engine(model, cache=False)
    want, _ = run_all(off, prompts, max_new=5)
    assert off_calls[:2] == [[64], [36, 28]]  # without the cache nothing waits: the budget goes to the next in line
    assert sum(map(sum, off_calls)) == 4 * 100
    eng, calls = engine(model)
    cached, got = cached_tokens(eng, prompts)
    assert got == want
    assert cached == [0, 99, 99, 99]
    assert sum(map(sum, calls)) == 100 + 3


def test_a_system_prompt_sent_together_is_computed_once(model):
    """Four prompts sharing 100 tokens, each with its own 6: the three after the first wait for its first two chunks
    (64-token steps) and read the shared part (with MTP the last shared slot read the first's own next token)."""
    prompts = [SHARED + torch.randint(3, 400, (6,), generator=GEN).tolist() for _ in range(4)]
    want, _ = run_all(engine(model, cache=False)[0], prompts, max_new=5)
    eng, calls = engine(model)
    cached, got = cached_tokens(eng, prompts)
    assert got == want
    shared = 99 if eng.spec is not None else 100
    assert cached == [0, shared, shared, shared]
    assert sum(map(sum, calls)) == 106 + 3 * (106 - shared)


def test_a_short_common_start_does_not_wait(model):
    """Prompts sharing fewer tokens than the scheduler's minimum (64 by default) are prefilled together, as without
    the cache: a chat template's header is not worth a step."""
    prompts = [SHARED[:20] + torch.randint(3, 400, (30,), generator=GEN).tolist() for _ in range(3)]
    eng, calls = engine(model, branch_min=64)
    cached_tokens(eng, prompts)
    assert calls[0] == [50, 14]  # the first step: the budget's 64 tokens, two prompts


def test_requests_behind_waiting_samples_go_first(model):
    """Samples waiting for their first keep their place in line, but an unrelated request behind them is admitted
    in the step they wait: the budget left goes to it."""
    other = torch.randint(3, 400, (30,), generator=GEN).tolist()
    prompts = [SHARED] * 3 + [other]
    want, _ = run_all(engine(model, cache=False)[0], prompts, max_new=5)
    eng, calls = engine(model)
    cached, got = cached_tokens(eng, prompts)
    assert got == want
    # step 2: the first's rest (Qwen3.5: to the token before its last, where the samples part) and the other's 28
    assert calls[1] == [35 if eng.runner.kv.stateful else 36, 28]
    assert cached == [0, 0, 99, 99]  # in admission order: the first, the other, the two samples
