"""Random workloads through the engine with the prefix cache on and off (CPU, float32, tiny Qwen3 and Qwen3.5):
prompts built from a few shared starts, submitted in random waves (some while others decode), under random chunk
sizes, mixed steps, minimum branches and pools down to one small enough to evict. Every request's greedy tokens are
the cache-off engine's, every request ends by length, prefixes are read from the cache, and no slot, pin or
checkpoint leaks. With an MTP head (Qwen3.5), the accepted drafts are the cache-off engine's too."""

import random

import pytest

from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5
from tests.engine.test_mtp_engine import SpecCounts, half_dir  # noqa: F401 (a fixture)
from tests.engine.test_prefix_cache import assert_no_leak, runner


@pytest.fixture(scope="module", params=["qwen3", "qwen3.5"])
def model_dir(request, tmp_path_factory):
    if request.param == "qwen3":
        return str(make_tiny_qwen3(tmp_path_factory.mktemp("q3"), seed=5))
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("q35"), seed=6))


def workload(rng):
    """(waves of (prompt, max_new_tokens), engine steps between waves)."""
    starts = [[rng.randrange(3, 400) for _ in range(rng.randrange(10, 40))] for _ in range(3)]
    waves, earlier = [], []
    for _ in range(5):
        wave = []
        for _ in range(rng.randrange(1, 4)):
            if earlier and rng.random() < 0.3:  # a later turn: an earlier prompt and more
                start = rng.choice(earlier) + [rng.randrange(3, 400) for _ in range(rng.randrange(1, 8))]
            else:
                start = rng.choice(starts)
                start = start[: rng.randrange(1, len(start) + 1)]
            prompt = (start + [rng.randrange(3, 400) for _ in range(rng.randrange(4))])[:50]
            wave.append((prompt, rng.randrange(1, 10)))
        waves.append(wave)
        earlier += [p for p, _ in wave]
    return waves, [rng.randrange(0, 4) for _ in waves]


def run_workload(engine, waves, gaps):
    outs, fins, cached, n = {}, {}, {}, 0
    for wave, gap in zip(waves, gaps):
        for prompt, max_new in wave:
            i, n = n, n + 1
            outs[i] = []

            def emit(ev, i=i):
                if ev.kind == "token":
                    outs[i].append(ev.token_id)
                    cached[i] = ev.cached_tokens
                else:
                    fins[i] = ev.finish_reason

            engine.submit(Request(str(i), prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), emit))
        for _ in range(gap):  # the next wave comes while these decode
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return outs, fins, sum(cached.values())


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_give_the_cache_off_tokens(model_dir, seed):
    rng = random.Random(seed)
    waves, gaps = workload(rng)
    chunk = rng.choice([4, 8, 64])
    opts = dict(chunked_prefill_size=chunk, enable_mixed_chunk=rng.random() < 0.5)
    want, _, _ = run_workload(Engine(runner(model_dir, cache=False, **opts), eos_ids=[]), waves, gaps)
    r = runner(model_dir, tokens=rng.choice([80, 100, 512]), **opts)
    engine = Engine(r, eos_ids=[])
    engine.scheduler.branch_min_tokens = rng.choice([1, 8, 64])
    got, fins, hits = run_workload(engine, waves, gaps)
    assert got == want and set(fins.values()) == {"length"} and hits > 0, (chunk, opts)
    if r.kv.stateful:
        states = r.kv.prefix.num_states
        assert states + len(r.kv._free_states) == r.args.linear_att_cache_size
    assert_no_leak(r)


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_with_mtp_give_the_cache_off_tokens_and_acceptance(half_dir, seed):  # noqa: F811
    """Qwen3.5 with an MTP head that accepts about half its drafts: the same tokens and the same accepted drafts
    as without the cache (a wrong cached head entry would change the drafts), prefixes read, nothing leaked."""
    rng = random.Random(100 + seed)
    waves, gaps = workload(rng)
    # two more turns after the longest prompt: MTP keys a slot with the token after it, so both miss the checkpoint
    # after that prompt (its last slot read the request's first token); the first stops at the branch and leaves
    # one there, which the second reads while the first decodes
    longest = max((p for wave in waves for p, _ in wave), key=len)
    waves += [[(longest[:49] + [401], 9)], [(longest[:49] + [402], 3)]]
    gaps[-1:] = [100, 3, 0]  # the two turns come once the rest is done, and a few steps apart
    opts = dict(chunked_prefill_size=rng.choice([4, 8, 64]), mtp_mode="eagle_with_att", mtp_step=rng.choice([1, 3]))
    runs = []
    for cache in (False, True):
        counts = SpecCounts()
        # pools the tree must evict from, but that never preempt (a re-prefill emits a token without drafting)
        r = runner(half_dir, cache=cache, tokens=rng.choice([300, 512]) if cache else 512, **opts)
        engine = Engine(r, eos_ids=[], observer=counts)
        engine.scheduler.branch_min_tokens = 1  # these prompts' branches are short, and with MTP the way to a hit
        runs.append((*run_workload(engine, waves, gaps), (counts.drafts, counts.accepted)))
    (want, _, _, want_spec), (got, fins, hits, got_spec) = runs
    assert got == want and set(fins.values()) == {"length"} and hits > 0, opts
    assert got_spec == want_spec and got_spec[1] > 0, (got_spec, want_spec)
    assert r.kv.prefix.num_states + len(r.kv._free_states) == r.args.linear_att_cache_size
    assert_no_leak(r)
