"""The prefix cache in the engine on the CPU with a tiny Qwen3: greedy output is the same with the cache on and off,
a hit is prefilled only past the cached prefix (counted through the runner), eviction under a tiny pool loses no
request, preemption and aborts leave the tree's pins and the pool's free count consistent. Qwen3.5 (state checkpoints
beside the KV): test_prefix_cache_hybrid.py."""

import pytest

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3

BASE = list(range(3, 40))
# waves run one after the other, so a later wave can hit what an earlier one left in the tree
WAVES = [
    [BASE, [7, 8, 9, 10, 11]],
    [BASE[:20], BASE + [99, 98], BASE[:30] + [5, 6, 7], [7, 8, 9]],  # contained, longer, diverging, contained
    [BASE, BASE[:37] + [1], [7, 8, 9, 10, 11]],  # identical prompts
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=7))


def runner(model_dir, tokens=512, cache=True, **kw):
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=128, max_req_total_len=64,
                      running_max_req_size=4, max_total_token_num=tokens, disable_dynamic_prompt_cache=not cache,
                      **kw)  # fmt: skip
    return ModelRunner(args)


def counting(r):
    """``r`` with every prefill's new tokens counted, per request: a list of lists, one per prefill call."""
    calls, real = [], r.prefill
    r.prefill = lambda slots, prompts, *rest: (calls.append([len(p) for p in prompts]), real(slots, prompts, *rest))[1]
    return calls


def run(engine, prompts, max_new=6, abort_after=None):
    """Submit ``prompts``, step until all finished: ([token ids], [finish events])."""
    outs, fins = [[] for _ in prompts], [None] * len(prompts)

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                outs[i].append(ev.token_id)
                if abort_after is not None and i in abort_after and len(outs[i]) == abort_after[i]:
                    engine.abort(str(i))
            else:
                fins[i] = ev

        return emit

    for i, p in enumerate(prompts):
        engine.submit(Request(str(i), p, SamplingParams(max_new_tokens=max_new, ignore_eos=True), emitter(i)))
    while None in fins:
        assert engine.step()
    return outs, fins


def run_waves(r, waves=WAVES):
    engine = Engine(r, eos_ids=[])
    return [run(engine, w) for w in waves]


def assert_no_leak(r):
    """Every request finished: the pool holds the padding token and what the tree keeps; clearing it returns all."""
    kv = r.kv
    assert kv.num_free_slots == r.args.running_max_req_size
    assert kv.prefix.num_evictable == kv.prefix.num_tokens  # nothing pinned
    assert kv.tokens.num_free == kv.num_tokens - 1 - kv.prefix.num_tokens
    kv.prefix.clear()
    assert kv.tokens.num_free == kv.num_tokens - 1


@pytest.mark.parametrize("kv_type", ["None", "int8kv"])
def test_greedy_output_is_the_same_with_the_cache_on_and_off(model_dir, kv_type):
    want = [outs for outs, _ in run_waves(runner(model_dir, cache=False, llm_kv_type=kv_type))]
    r = runner(model_dir, llm_kv_type=kv_type)
    calls = counting(r)
    got = run_waves(r)
    assert [outs for outs, _ in got] == want
    cached = [[ev.cached_tokens for ev in fins] for _, fins in got]
    # a prompt the tree holds whole still computes its last token (its logits are needed)
    assert cached == [[0, 0], [19, 37, 30, 2], [36, 37, 4]]
    prompt_tokens = sum(len(p) for w in WAVES for p in w)
    assert sum(map(sum, calls)) == prompt_tokens - sum(map(sum, cached))
    assert_no_leak(r)


def test_a_second_identical_prompt_computes_one_token(model_dir):
    r = runner(model_dir)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    first, _ = run(engine, [BASE])
    assert calls == [[len(BASE)]]
    second, fins = run(engine, [BASE])
    assert calls[1:] == [[1]] and fins[0].cached_tokens == len(BASE) - 1 and second == first


def run_second_after(engine, prompts, max_new, steps):
    """Submit ``prompts[0]``, run ``steps`` engine steps, submit ``prompts[1]``, run both to the end: (tokens,
    finish events) of each."""
    outs, fins = [[], []], [None, None]
    for i, prompt in enumerate(prompts):
        emit = (lambda i: lambda ev: outs[i].append(ev.token_id) if ev.kind == "token" else fins.__setitem__(i, ev))(i)
        engine.submit(Request(str(i), prompt, SamplingParams(max_new_tokens=max_new[i], ignore_eos=True), emit))
        for _ in range(steps if i == 0 else 0):
            engine.step()
    while None in fins:
        assert engine.step()
    return outs, fins


def test_a_running_request_shares_its_prompt(model_dir):
    """A prompt is published once prefilled: a request admitted while the first still decodes reuses the prefix
    they share (counted through the runner), and both give the cache-off output."""
    prompts = [BASE, BASE[:30] + [5, 6]]
    want, _ = run(Engine(runner(model_dir, cache=False), eos_ids=[]), prompts[:1], max_new=10)
    want += run(Engine(runner(model_dir, cache=False), eos_ids=[]), prompts[1:], max_new=4)[0]
    r = runner(model_dir)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    outs, fins = run_second_after(engine, prompts, [10, 4], steps=2)  # the first prefilled and decoding
    assert fins[1].cached_tokens == 30 and calls == [[len(BASE)], [2]]
    assert outs == want and fins[0].finish_reason == fins[1].finish_reason == "length"
    assert_no_leak(r)


def test_a_prompt_still_prefilling_shares_its_chunks(model_dir):
    """Each prompt chunk is published as it is computed: a request submitted after two of a long prompt's 8-token
    chunks is admitted beside its last chunk (the budget is the first's until then) and reuses the 20 tokens they
    share from the four chunks already published; both give the cache-off output."""
    prompts = [BASE, BASE[:20] + [5, 6]]
    want = [run(Engine(runner(model_dir, cache=False), eos_ids=[]), [p], max_new=4)[0][0] for p in prompts]
    r = runner(model_dir, chunked_prefill_size=8)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    outs, fins = run_second_after(engine, prompts, [4, 4], steps=2)  # two chunks in, three to go
    assert calls[:5] == [[8], [8], [8], [8], [5, 2]] and fins[1].cached_tokens == 20 and outs == want
    assert_no_leak(r)


def test_the_flag_turns_it_off(model_dir):
    r = runner(model_dir, cache=False)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    run(engine, [BASE])
    _, fins = run(engine, [BASE])
    assert r.kv.prefix is None and calls == [[len(BASE)], [len(BASE)]] and fins[0].cached_tokens == 0


def test_eviction_under_a_tiny_pool_loses_no_request(model_dir):
    """A pool of 100 tokens holds about one and a half requests (their shared prefixes published as they run): the
    tree evicts (and requests are preempted) all along."""
    prompts = [BASE[: 20 + 3 * i] + [i, i + 1] for i in range(6)] + [[200 + i for i in range(30)], BASE]
    want, _ = run(Engine(runner(model_dir, cache=False), eos_ids=[]), prompts, max_new=12)
    r = runner(model_dir, tokens=100)
    evicted, real = [], r.kv.prefix.evict
    r.kv.prefix.evict = lambda n: evicted.append(real(n)) or evicted[-1]
    engine = Engine(r, eos_ids=[])
    preempted, real_preempt = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: (preempted.append(req.id), real_preempt(req))
    got, fins = run(engine, prompts, max_new=12)
    assert got == want and all(ev.finish_reason == "length" for ev in fins)
    assert sum(evicted) > 0 and preempted
    assert_no_leak(r)


def test_aborts_release_their_pins(model_dir):
    r = runner(model_dir)
    engine = Engine(r, eos_ids=[])
    run(engine, [BASE])
    outs, fins = run(engine, [BASE + [1], BASE + [2], BASE[:10]], max_new=8, abort_after={0: 1, 2: 3})
    assert [ev.finish_reason for ev in fins] == ["abort", "length", "abort"] and len(outs[1]) == 8
    assert_no_leak(r)


def test_offline_outputs_report_the_cached_prompt_tokens(model_dir):
    from lightllm.llm import LLM

    llm = LLM(model_dir, data_type="fp32", device="cpu", batch_max_tokens=128, max_req_total_len=64,
              running_max_req_size=4, max_total_token_num=512)  # fmt: skip
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first, second = llm.generate(BASE, params)[0], llm.generate(BASE, params)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, len(BASE) - 1)
    assert second.token_ids == first.token_ids


@pytest.mark.parametrize("steps", [1, 2], ids=["prefill", "decode"])
def test_fail_all_does_not_finish_again_a_request_the_failed_step_finished(model_dir, steps):
    """A step that raises after its requests finished (their finish emitted, their slots freed; here a bug in one's
    finish callback): ``fail_all`` ends them no second time: every request gets exactly one finish event."""
    r = runner(model_dir)
    engine = Engine(r, eos_ids=[])
    events = {"done": [], "bad": []}

    def recorder(name, raise_on=None):
        def emit(ev):
            events[name].append((ev.kind, ev.finish_reason))
            if ev.kind == raise_on:
                raise RuntimeError("emit callback bug")

        return emit

    engine.submit(Request("done", BASE, SamplingParams(max_new_tokens=steps), recorder("done")))
    engine.submit(Request("bad", BASE[:-1], SamplingParams(max_new_tokens=steps), recorder("bad", "finish")))
    with pytest.raises(RuntimeError, match="emit callback bug"):
        while engine.has_unfinished():  # an overlapped step emits what the one before it launched
            engine.step()
    engine.fail_all()
    for name in events:
        assert events[name] == [("token", "")] * steps + [("finish", "length")], events
    assert not engine.has_unfinished()
    assert_no_leak(r)


def test_fail_all_after_a_step_raised_past_its_prefill_frees_the_prefilled_requests(model_dir):
    """A prefill step's sampled requests are out of the prefilling list and not yet running while their tokens are
    emitted: a step that raises there (a bug in an emit callback) must still leave them to ``fail_all``, which ends
    each once and releases its slot and its pinned prefix (else the slot leaks and the prefix is never evictable)."""
    r = runner(model_dir)
    engine = Engine(r, eos_ids=[])
    run(engine, [BASE])
    events = []

    def emit(ev):
        events.append((ev.kind, ev.finish_reason))
        if ev.kind == "token":
            raise RuntimeError("emit callback bug")

    engine.submit(Request("x", BASE + [1], SamplingParams(max_new_tokens=4, ignore_eos=True), emit))
    with pytest.raises(RuntimeError, match="emit callback bug"):
        engine.step()
    engine.fail_all()
    assert events == [("token", ""), ("finish", "error")] and not engine.has_unfinished()
    assert_no_leak(r)


@pytest.mark.parametrize("mixed", [False, True], ids=["chunk", "mixed"])
def test_fail_all_after_a_step_raised_past_a_last_chunk_frees_its_request(model_dir, mixed):
    """A request admitted by an earlier step whose last chunk this step prefilled is, until the step's end, in no
    list but ``admitted``: a step raising there (here in its first token's emit) must still leave it to ``fail_all``."""
    r = runner(model_dir, chunked_prefill_size=8, enable_mixed_chunk=mixed)
    engine = Engine(r, eos_ids=[])
    events = []

    def emit(ev):
        events.append((ev.kind, ev.finish_reason))
        if ev.kind == "token":
            raise RuntimeError("emit callback bug")

    engine.submit(Request("x", list(range(3, 23)), SamplingParams(max_new_tokens=4, ignore_eos=True), emit))
    with pytest.raises(RuntimeError, match="emit callback bug"):
        for _ in range(3):  # chunks of 8, 8 and 4 tokens: the third samples the first token
            engine.step()
    engine.fail_all()
    assert events == [("token", ""), ("finish", "error")] and not engine.has_unfinished()
    assert_no_leak(r)


def test_a_release_that_raises_still_ends_the_request_once(model_dir, monkeypatch):
    """Freeing a finished request raised something other than the slot bookkeeping's own errors (a device error):
    the step fails, and the request has had its one finish event (``fail_all`` skips it as finished)."""
    r = runner(model_dir)
    engine = Engine(r, eos_ids=[])
    events = []
    engine.submit(Request("a", list(range(3, 20)), SamplingParams(max_new_tokens=8, ignore_eos=True), events.append))
    engine.step()
    release = engine.scheduler.release

    def failing(req):
        monkeypatch.setattr(engine.scheduler, "release", release)
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(engine.scheduler, "release", failing)
    engine.abort("a")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        while engine.has_unfinished():
            engine.step()
    engine.fail_all()
    assert [e.kind for e in events] == ["token", "finish"] and events[-1].finish_reason == "abort"
