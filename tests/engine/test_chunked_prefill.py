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
    r.prefill = lambda slots, prompts: (step_tokens.append(sum(map(len, prompts))), real(slots, prompts))[1]
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
    engine = Engine(runner(model_dir, chunk=4), eos_ids=[])
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
