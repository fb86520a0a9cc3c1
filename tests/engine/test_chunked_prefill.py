"""Chunked prefill on the CPU with tiny Qwen3 and Qwen3.5 models: a chunk continues its request's KV (and Qwen3.5's
linear-attention state), so greedy output is the same with chunking on and off, for any chunk size, with several
requests and with preemption; running requests keep decoding between the chunks of a long prompt."""

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5

PROMPTS = [list(range(3, 26)), [40, 41, 42, 43, 44, 45, 46, 47, 48], list(range(60, 77)), [90, 91, 92]]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    make = make_tiny_qwen3 if request.param == "qwen3" else make_tiny_qwen3_5
    return str(make(tmp_path_factory.mktemp(request.param), seed=5))


def runner(model_dir, chunk=None, tokens=512, **kw):
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=40,
                      running_max_req_size=4, max_total_token_num=tokens, chunked_prefill_size=chunk or 4096,
                      disable_chunked_prefill=chunk is None, **kw)  # fmt: skip
    return ModelRunner(args)


def run_all(engine, prompts, max_new=8, trace=None):
    """Submit every prompt, step until all finished: {i: token ids}. ``trace`` collects, per step, its kind and
    the ids of the requests that emitted a token."""
    outs, done = {i: [] for i in range(len(prompts))}, set()

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                outs[i].append(ev.token_id)
                if trace is not None:
                    trace[-1][1].append(i)
            else:
                assert ev.finish_reason == "length", ev
                done.add(i)

        return emit

    for i, p in enumerate(prompts):
        engine.submit(Request(str(i), p, SamplingParams(max_new_tokens=max_new, ignore_eos=True), emitter(i)))
    while len(done) < len(prompts):
        if trace is not None:
            trace.append([None, []])
        assert engine.step()
        if trace is not None:
            trace[-1][0] = engine.scheduler.last_step
    return outs


def test_a_chunk_continues_the_request(model_dir):
    """The runner alone: a prompt prefilled in three chunks gives the logits of the whole prefill, and the decode
    step after it too (KV and Qwen3.5's state slot carried across chunks)."""
    r = runner(model_dir)
    prompt = PROMPTS[0]
    whole, chunked = r.add_request(), r.add_request()
    want = r.prefill([whole], [prompt])
    r.prefill([chunked], [prompt[:7]])
    r.prefill([chunked], [prompt[7:8]])
    got = r.prefill([chunked], [prompt[8:]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r.decode([chunked], [5]), r.decode([whole], [5]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_greedy_output_is_the_same_chunked_or_not(model_dir, chunk):
    want = run_all(Engine(runner(model_dir), eos_ids=[]), PROMPTS)
    trace, r = [], runner(model_dir, chunk)
    step_tokens, real = [], r.prefill

    def prefill(slots, prompts, *publish):
        step_tokens.append(sum(map(len, prompts)))
        return real(slots, prompts, *publish)

    r.prefill = prefill
    got = run_all(Engine(r, eos_ids=[]), PROMPTS, trace=trace)
    assert got == want
    assert max(step_tokens) <= chunk and sum(step_tokens) == sum(map(len, PROMPTS))
    if chunk < len(PROMPTS[0]):  # the long prompt really was prefilled in pieces
        assert sum(kind == "prefill" for kind, _ in trace) >= -(-sum(map(len, PROMPTS)) // chunk)


@pytest.mark.parametrize("chunk", [1, 7])
def test_greedy_output_is_the_same_with_preemption(model_dir, chunk):
    want = run_all(Engine(runner(model_dir), eos_ids=[]), PROMPTS, max_new=16)
    tight = Engine(runner(model_dir, chunk, tokens=42), eos_ids=[])  # 52 prompt tokens + 64 new ones do not fit
    preempted = []
    real = tight.scheduler._preempt
    tight.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    assert run_all(tight, PROMPTS, max_new=16) == want
    assert preempted, "the cache was meant to run out"
    assert tight.runner.kv.num_free_tokens == 42 - 1  # all freed but the padding token


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(model_dir):
    """Counted in engine steps: while a 33-token prompt is prefilled in chunks of 4 (9 prefill steps), the two
    running requests emit a token in a decode step after every chunk but the last, and the long request's first
    token comes only with its last chunk."""
    # counted in emissions per step() call: overlapped decode would emit a step's tokens in the next call
    engine = Engine(runner(model_dir, chunk=4, disable_overlap_schedule=True), eos_ids=[])
    outs, events = {}, []
    for i, p in enumerate(PROMPTS[3:] + PROMPTS[1:2]):  # two short requests, running first
        outs[i] = []
        engine.submit(Request(f"short{i}", p, SamplingParams(max_new_tokens=30, ignore_eos=True),
                              lambda ev, i=i: ev.kind == "token" and outs[i].append(ev.token_id)))  # fmt: skip
    while min(len(o) for o in outs.values()) < 1:
        engine.step()
    long_tokens = []
    engine.submit(Request("long", list(range(100, 133)), SamplingParams(max_new_tokens=2, ignore_eos=True),
                          lambda ev: ev.kind == "token" and long_tokens.append(ev.token_id)))  # fmt: skip
    chunks = 0
    while not long_tokens:
        before = [len(o) for o in outs.values()]
        assert engine.step()
        kind = engine.scheduler.last_step
        events.append(kind)
        if kind == "prefill":
            chunks += 1
            assert [len(o) for o in outs.values()] == before, "a prefill step emitted a running request's token"
        else:
            assert [len(o) for o in outs.values()] == [n + 1 for n in before], "a running request missed a step"
    assert chunks == 9 and events == ["prefill", "decode"] * 8 + ["prefill"]


def test_abort_during_a_chunked_prefill_frees_its_kv(model_dir):
    r = runner(model_dir, chunk=4)
    engine = Engine(r, eos_ids=[])
    events = []
    engine.submit(Request("long", PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True), events.append))
    engine.step()
    engine.step()
    assert r.kv.num_free_tokens == 511 - 8 and engine.scheduler.prefilling  # two chunks in, more to come
    engine.abort("long")
    assert not engine.step()  # nothing left to run
    assert [e.kind for e in events] == ["finish"] and events[0].finish_reason == "abort"
    assert r.kv.num_free_tokens == 511 and not engine.scheduler.prefilling and not engine.has_unfinished()


@pytest.mark.parametrize("chunk", [7, 16])
def test_mixed_steps_give_the_same_greedy_output(model_dir, chunk):
    """--enable_mixed_chunk: chunk steps carry the running requests' tokens (Qwen3.5's state slots carried through
    the prefill path), and greedy output is what unmixed, unchunked prefill gives, preemption included."""
    want = run_all(Engine(runner(model_dir), eos_ids=[]), PROMPTS, max_new=16)
    trace = []
    assert run_all(Engine(runner(model_dir, chunk, enable_mixed_chunk=True), eos_ids=[]), PROMPTS, 16, trace) == want
    assert any(kind == "mixed" for kind, _ in trace)
    tight = Engine(runner(model_dir, chunk, tokens=42, enable_mixed_chunk=True), eos_ids=[])
    preempted = []
    real = tight.scheduler._preempt
    tight.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    assert run_all(tight, PROMPTS, max_new=16) == want
    assert preempted and tight.runner.kv.num_free_tokens == 42 - 1


def test_mixed_step_carries_the_running_requests_with_each_chunk(model_dir):
    """Counted in engine steps: with mixing, each of the 33-token prompt's chunks of 4 is one forward that also
    emits a token for both running requests (9 mixed steps, no decode step between them); each mixed forward holds
    the chunk and one token per running request, and the long request's first token comes with its last chunk."""
    r = runner(model_dir, chunk=6, enable_mixed_chunk=True)  # a budget of 6: 4 prompt tokens beside 2 running
    forwards, real = [], r.prefill

    def prefill(slots, prompts, *publish):
        forwards.append([len(p) for p in prompts])
        return real(slots, prompts, *publish)

    r.prefill = prefill
    engine = Engine(r, eos_ids=[])
    outs = {}
    for i, p in enumerate(PROMPTS[3:] + PROMPTS[1:2]):
        outs[i] = []
        engine.submit(Request(f"short{i}", p, SamplingParams(max_new_tokens=30, ignore_eos=True),
                              lambda ev, i=i: ev.kind == "token" and outs[i].append(ev.token_id)))  # fmt: skip
    while min(len(o) for o in outs.values()) < 1:
        engine.step()
    long_tokens, kinds = [], []
    engine.submit(Request("long", list(range(100, 133)), SamplingParams(max_new_tokens=2, ignore_eos=True),
                          lambda ev: ev.kind == "token" and long_tokens.append(ev.token_id)))  # fmt: skip
    forwards.clear()
    while not long_tokens:
        before = [len(o) for o in outs.values()]
        assert engine.step()
        kinds.append(engine.scheduler.last_step)
        assert [len(o) for o in outs.values()] == [n + 1 for n in before], "a running request missed a step"
    assert kinds == ["mixed"] * 9
    assert forwards == [[1, 1, 4]] * 8 + [[1, 1, 1]]  # the running requests' tokens, then the chunk


def test_mixed_steps_alternate_when_the_running_requests_take_half_the_budget(model_dir):
    """A budget of 5: beside three running requests a chunk would get 2 tokens, under half the budget, so chunk and
    decode steps alternate as without mixing; beside one or two the chunk step is mixed."""
    # every step through the scheduler: an overlapped decode step follows the last one without asking it
    engine = Engine(runner(model_dir, chunk=5, enable_mixed_chunk=True, disable_overlap_schedule=True), eos_ids=[])
    steps, real = [], engine.scheduler.schedule

    def spy():
        running = len(engine.scheduler.running)
        kind, batch = real()
        steps.append((kind, running))
        return kind, batch

    engine.scheduler.schedule = spy
    run_all(engine, PROMPTS, max_new=12)
    assert {n for kind, n in steps if kind == "mixed"} == {1, 2}
    assert ("prefill", 3) in steps and ("decode", 3) in steps


def test_a_failed_mixed_step_fails_its_chunk_and_re_prefills_the_running_requests(model_dir):
    """A mixed forward that raises: the long prompt it carried ends with an error; the running requests are
    preempted, re-prefilled from what they generated, and finish with the tokens an undisturbed run gives."""
    short = PROMPTS[3:] + PROMPTS[1:2]
    want = run_all(Engine(runner(model_dir), eos_ids=[]), short, max_new=6)
    r = runner(model_dir, chunk=6, enable_mixed_chunk=True)
    engine = Engine(r, eos_ids=[])
    outs, finished = {i: [] for i in range(2)}, {}

    def emitter(key):
        def emit(ev):
            if ev.kind == "token":
                outs.setdefault(key, []).append(ev.token_id)
            else:
                finished[key] = ev.finish_reason

        return emit

    for i, p in enumerate(short):
        engine.submit(Request(f"short{i}", p, SamplingParams(max_new_tokens=6, ignore_eos=True), emitter(i)))
    while min(len(o) for o in outs.values()) < 2:
        engine.step()
    real = r.prefill

    def fail_once(slots, prompts, publish=()):
        r.prefill = real
        raise RuntimeError("out of memory (injected)")

    r.prefill = fail_once
    engine.submit(Request("long", list(range(100, 133)), SamplingParams(max_new_tokens=2), emitter("long")))
    while engine.has_unfinished():
        engine.step()
    assert finished == {"long": "error", 0: "length", 1: "length"}
    assert {i: outs[i] for i in range(2)} == want
    assert r.kv.can_allocate(511) and not engine.scheduler.requests()  # every token free or evictable again


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("qwen3_cache"), seed=5))  # Qwen3.5 runs without the cache


@pytest.mark.parametrize("shared", [1, 9], ids=["first-decode-token", "all-output-with-kv"])
def test_a_prefix_cached_after_mixed_steps_gives_the_uncached_output(qwen3_dir, shared):
    """A request whose row mixes decode steps and mixed-step chunks ends; a later prompt sharing its prompt and
    ``shared`` of its tokens reuses that KV from the prefix cache and decodes exactly as without the cache: the
    tree maps each token id to its own position's KV (attention over a whole row would not notice a permuted one;
    a prefix cut inside it does)."""
    first = PROMPTS[3]
    engine = Engine(runner(qwen3_dir, chunk=6, enable_mixed_chunk=True), eos_ids=[])
    outs = {"a": [], "b": []}
    engine.submit(Request("a", first, SamplingParams(max_new_tokens=10, ignore_eos=True),
                          lambda ev: ev.kind == "token" and outs["a"].append(ev.token_id)))  # fmt: skip
    while len(outs["a"]) < 2:
        engine.step()
    engine.submit(Request("b", list(range(100, 133)), SamplingParams(max_new_tokens=2, ignore_eos=True),
                          lambda ev: ev.kind == "token" and outs["b"].append(ev.token_id)))  # fmt: skip
    kinds = []
    while engine.has_unfinished():
        engine.step()
        kinds.append(engine.scheduler.last_step)
    assert "mixed" in kinds and "decode" in kinds
    follow = first + outs["a"][:shared] + [77]
    assert engine.runner.kv.match_prefix(follow[:-1])[0] == len(follow) - 1
    cached = run_all(engine, [follow], max_new=6)
    uncached = run_all(Engine(runner(qwen3_dir, disable_dynamic_prompt_cache=True), eos_ids=[]), [follow], max_new=6)
    assert cached == uncached
