"""The prefix cache with MTP (Qwen3.5's head, float32 on the CPU): a request that starts from cached KV drafts and
verifies exactly as it would from a fresh prefill of its whole context. The head's KV at a position reads the token
after it, so the tree keys each slot by both (``next_token_keys``); a prompt's chunks, its end (at the first draft),
a branch and a request's end each leave a state checkpoint a later request starts from."""

import pytest
import torch

from lightllm.common.kv_cache.manager import KVCacheManager, next_token_keys
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.llm import LLM
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5

from tests.engine.test_mtp_engine import SpecCounts, half_dir  # noqa: F401 (a fixture)
from tests.engine.test_mtp_engine import engine as mtp_engine
from tests.engine.test_mtp_runner import ReplayingGraphAPI

GEN = torch.Generator().manual_seed(23)
PROMPT = torch.randint(3, 400, (40,), generator=GEN).tolist()
CHUNK = 16
N = 3  # drafts per step


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-mtp-prefix"), mtp=True, seed=5))


def cpu_runner(model_dir, **opts):
    base = dict(model_dir=model_dir, data_type="fp32", device="cpu", max_req_total_len=128, running_max_req_size=3,
                mtp_mode="eagle_with_att", mtp_step=N, linear_att_cache_size=16)  # fmt: skip
    return ModelRunner(EngineArgs(**{**base, **opts}))


def fresh_tokens(n):
    return torch.randint(3, 400, (n,), generator=GEN).tolist()


class Trajectory:
    """One request through the runner as the engine drives it: admitted with its longest usable hit (a branch
    taken from one token on), prefilled in chunks (each published, with the token after it), then MTP steps
    with forced acceptance counts, then freed with its last token. ``drafts`` forces the draft tokens (another
    runner's), so two runners' steps can be compared logit for logit."""

    def __init__(self, runner, context, accepts, drafts=None):
        kv = runner.kv
        key = kv.context_key(context)
        self.cached, _, branch = kv.match_prefix_with_branch(key)
        slot = runner.add_request(key[: self.cached])
        pos = self.cached
        while pos < len(context):
            end = min(pos + CHUNK, len(context), branch if pos < branch else len(context))
            after = context[end] if end < len(context) else None
            logits = runner.prefill([slot], [context[pos:end]], [(slot, end in (len(context), branch))], [after])
            pos = end
        last = int(logits[-1].argmax())
        self.draft_logits, self.verified, self.drafts = [], [], []
        self.context = list(context)
        for step, accepted in enumerate(accepts):
            seen = []

            def choose(k, logits, step=step):
                seen.append(logits[0].clone())
                forced = logits.argmax(-1) if drafts is None else torch.tensor([drafts[step][k]])
                return forced

            got = runner.mtp.draft([slot], [last], choose)[0].tolist()
            self.drafts.append(got)
            self.draft_logits.append(torch.stack(seen))
            self.verified.append(runner.mtp.verify([slot], [last], [got])[0].clone())  # a graph replay reuses it
            runner.mtp.accept([slot], [accepted])
            self.context += [last] + got[:accepted]
            last = (step * 37 + 11) % 400  # any bonus token: the engine would draw it from the verify's logits
        self.kv_len = kv.seq_len(slot)
        assert self.kv_len == len(self.context)
        self.context.append(last)
        runner.free(slot, last)

    def assert_same_steps(self, other):
        assert self.drafts == other.drafts
        for step, (a, b, c, d) in enumerate(zip(self.draft_logits, other.draft_logits, self.verified, other.verified)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"draft logits, step {step}")
            torch.testing.assert_close(c, d, atol=1e-4, rtol=0, msg=f"verify logits, step {step}")


def test_next_token_keys_pair_each_token_with_the_next():
    assert next_token_keys([5, 7, 9]) == [(5 << 32) | 7, (7 << 32) | 9]
    assert next_token_keys([5]) == [] and next_token_keys([]) == []
    kv = KVCacheManager(64, 2, 16, "cpu", prefix_cache=True, next_token_keys=True)
    assert kv.context_key([1, 2, 3]) == next_token_keys([1, 2, 3])  # one per slot a hit could cover
    plain = KVCacheManager(64, 2, 16, "cpu", prefix_cache=True)
    assert plain.context_key([1, 2, 3]) == [1, 2]


def test_a_row_shorter_than_its_kv_publishes_its_keys_and_a_checkpoint_only_when_vouched():
    """A row whose booked keys lag its length (MTP: the prompt's last slot waits for the next token) publishes
    them without a checkpoint, unless the caller vouches for the state (the draft step's prompt-end checkpoint)."""
    kv = KVCacheManager(64, 2, 16, "cpu", prefix_cache=True, state_checkpoints=2, next_token_keys=True)
    a = kv.add_request()
    kv.extend(a, 4)
    kv.computed(a, next_token_keys([1, 2, 3, 4]))  # 3 slots whole, the 4th's key waits
    assert kv.publish(a) is None and kv.prefix.num_tokens == 3
    assert kv.match_prefix(next_token_keys([1, 2, 3, 4, 9])) == (0, 0)  # no checkpoint: nothing usable
    kv.extend(a, 4)  # a draft step's slots
    kv.computed(a, next_token_keys([4, 8]))
    assert kv.publish(a, True, state_at_computed=True) == 0  # the state after 4 tokens, vouched
    assert kv.match_prefix(next_token_keys([1, 2, 3, 4, 8, 5])) == (4, 0)
    assert kv.match_prefix(next_token_keys([1, 2, 3, 4, 9, 5])) == (0, 0)  # slot 3 read 8 next, not 9


@pytest.mark.parametrize("graphs", [False, True])
def test_cached_prefixes_draft_and_verify_as_a_fresh_prefill_does(mtp_dir, graphs):
    """Each later request starts from a checkpoint its predecessor left, and every one of its steps' draft and
    verify logits equals a runner without the cache's on the same context: the cached head KV is exact. With the
    draft and verify graphs (a CPU stand-in replaying them) the prompt-end checkpoint is taken between replays."""
    if graphs:
        api = ReplayingGraphAPI()
        runner = ModelRunner(EngineArgs(model_dir=mtp_dir, data_type="fp32", device="cpu", max_req_total_len=128,
                                        running_max_req_size=3, mtp_mode="eagle_with_att", mtp_step=N,
                                        linear_att_cache_size=16, graph_max_batch_size=1, graph_max_len_in_batch=128),
                             graph_api=api)  # fmt: skip
        api.runner = runner
    else:
        runner = cpu_runner(mtp_dir)
    plain = cpu_runner(mtp_dir, disable_dynamic_prompt_cache=True)

    def check(context, accepts, want_cached):
        got = Trajectory(runner, context, accepts)
        want = Trajectory(plain, context, accepts, drafts=got.drafts)
        assert (got.cached, want.cached) == (want_cached, 0)
        got.assert_same_steps(want)
        return got

    first = check(PROMPT, [2, 0, 3], 0)
    # a follow-up that repeats the answer: from the request's end (its last token's slot waits for the next)
    check(first.context + fresh_tokens(7), [1, 3], first.kv_len)
    # one that goes on after the prompt's first token another way: from the prompt's end, checkpointed at the first
    # draft (its last slot read that token next)
    check(first.context[: len(PROMPT) + 1] + fresh_tokens(5), [3, 3], len(PROMPT))
    # one that leaves at the prompt's end: the last slot read another token next, so from the last chunk's
    # checkpoint, stopping at the branch, where the next such prompt starts
    check(PROMPT + fresh_tokens(5), [2], 2 * CHUNK)
    check(PROMPT + fresh_tokens(3), [0, 1], len(PROMPT) - 1)
    # one that leaves inside a chunk: the same from that chunk's checkpoint
    check(PROMPT[:35] + fresh_tokens(9), [0, 2], 2 * CHUNK)
    check(PROMPT[:35] + fresh_tokens(6), [2], 34)
    if graphs:
        assert api.replays["verify"] == api.replays["first_draft"] > 0 and api.replays["draft"] > 0


def test_every_slot_and_checkpoint_comes_back(mtp_dir):
    """After requests that share, branch and end inside and after their prompts, clearing the tree returns every
    pool token and checkpoint id."""
    runner = cpu_runner(mtp_dir)
    kv = runner.kv
    free, states = kv.tokens.num_free, len(kv._free_states)
    first = Trajectory(runner, PROMPT, [3, 1])
    Trajectory(runner, first.context + fresh_tokens(4), [0])
    Trajectory(runner, PROMPT[:20] + fresh_tokens(3), [])
    slot = runner.add_request()
    runner.prefill([slot], [PROMPT[:CHUNK]], [(slot, False)], [PROMPT[CHUNK]])
    runner.free(slot)  # inside its prompt, no token emitted
    assert kv.prefix.num_states > 0
    kv.prefix.clear()
    assert (kv.tokens.num_free, len(kv._free_states)) == (free, states)


def test_engine_outputs_and_acceptance_are_the_same_with_the_cache_on_and_off(half_dir):  # noqa: F811
    """Through the engine (chunked prefill, branches at the scheduler's threshold set to 1): requests sharing a
    prefix, sent one after another, give the same greedy tokens and accept the same drafts with the cache on as
    off (a head with 50 % acceptance: a wrong cached head entry would change its drafts), and report their hits."""
    base = PROMPT[:30]
    prompts = [base + fresh_tokens(6), base + fresh_tokens(9), base[:25] + fresh_tokens(4), base + fresh_tokens(6)]
    results = {}
    for cache in (True, False):
        counts = SpecCounts()
        eng = mtp_engine(half_dir, counts, mtp_mode="eagle_with_att", mtp_step=N, max_req_total_len=96,
                         linear_att_cache_size=8, disable_dynamic_prompt_cache=not cache)  # fmt: skip
        eng.scheduler.branch_min_tokens = 1
        outs, cached = [], []
        for i, prompt in enumerate(prompts):
            events = []
            eng.submit(Request(str(i), prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), events.append))
            while not events or events[-1].kind != "finish":
                assert eng.step()
            outs.append([e.token_id for e in events if e.kind == "token"])
            cached.append(events[0].cached_tokens)
        results[cache] = outs, (counts.drafts, counts.accepted), cached
    (on, on_spec, on_cached), (off, off_spec, off_cached) = results[True], results[False]
    assert on == off and on_spec == off_spec
    assert 0 < on_spec[1] < on_spec[0]  # some drafts accepted, some not: the comparison can tell
    assert off_cached == [0, 0, 0, 0] and on_cached[0] == 0 and min(on_cached[1:]) > 0


def test_an_interrupt_in_the_heads_catch_up_at_a_requests_end_frees_its_slot(mtp_dir):
    """Ctrl-C in ``LLM.generate`` while the MTP head catches up on a finished request's last token: its request slot
    and KV still go back (they leaked for good: every later call ran with one slot and its tokens fewer), and the
    state checkpoint the prefix cache keeps for it is filled (a later prompt extending it read an unsaved state)."""
    opts = dict(data_type="fp32", device="cpu", max_req_total_len=128, running_max_req_size=3,
                mtp_mode="eagle_with_att", mtp_step=N, linear_att_cache_size=16)  # fmt: skip
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
    prompts = [fresh_tokens(20), fresh_tokens(9)]
    calm = LLM(mtp_dir, **opts)
    answers = [out.token_ids for out in calm.generate(prompts, params)]
    follow_up = prompts[0] + answers[0] + [7, 8, 9]
    expected = calm.generate(follow_up, params)[0]
    assert expected.num_cached_tokens > len(prompts[0])  # it reads the first answer's state from the cache

    llm = LLM(mtp_dir, **opts)
    mtp = llm.runner.mtp
    finish = mtp.finish

    def interrupted(*args):  # the user's Ctrl-C lands while the head's forward runs
        finish(*args)
        raise KeyboardInterrupt

    mtp.finish = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    mtp.finish = finish
    assert llm.runner.kv.num_free_slots == calm.runner.kv.num_free_slots  # every request slot back
    out = llm.generate(follow_up, params)[0]
    assert (out.num_cached_tokens, out.token_ids) == (expected.num_cached_tokens, expected.token_ids)
    assert out.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
