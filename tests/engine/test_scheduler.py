"""The engine on the CPU with a tiny model: preemption under a small KV cache, aborts free KV, failures stay
with their requests."""

import threading
from types import SimpleNamespace

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.sampler import SamplingParams
from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.scheduler import Scheduler
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2))


def runner(model_dir, tokens):
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=32,
                      running_max_req_size=4, max_total_token_num=tokens)  # fmt: skip
    return ModelRunner(args)


def run_all(sched, prompts, max_new=12, params=None):
    """Submit every prompt and step until all finished: ({i: token ids}, {i: finish reason})."""
    outs = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)
    reasons = {}

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                outs[i].append(ev.token_id)
            else:
                reasons[i] = ev.finish_reason
                done.release()

        return emit

    for i, p in enumerate(prompts):
        sp = (params or {}).get(i) or SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        sched.submit(Request(str(i), p, sp, emitter(i)))
    while len(reasons) < len(prompts):
        assert sched.step() or len(reasons) == len(prompts)
    return outs, reasons


def test_preemption_under_a_small_cache_gives_the_same_tokens(model_dir):
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35], [40, 41]]
    roomy = Engine(runner(model_dir, 512), eos_ids=[])
    want, _ = run_all(roomy, prompts)
    tight_runner = runner(model_dir, 40)  # 20 prompt tokens + 48 new ones cannot all fit: someone is preempted
    tight = Engine(tight_runner, eos_ids=[])
    preempted = []
    real = tight.scheduler._preempt
    tight.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    got, reasons = run_all(tight, prompts)
    assert preempted, "the cache was meant to run out"
    assert got == want and set(reasons.values()) == {"length"}
    assert tight_runner.kv.num_free_tokens == 40 - 1  # all freed but the padding token


def test_a_request_reaches_max_req_total_len_and_ends_there_whatever_its_max_new_tokens(model_dir):
    """max_req_total_len is 32: a 29-token prompt asking for 100 new tokens gets 3, prompt and output filling the
    bound exactly, and ends "length" (the engine API; the HTTP routes refuse such a max_tokens with a 400)."""
    r = runner(model_dir, 256)
    outs, reasons = run_all(Engine(r, eos_ids=[]), [list(range(3, 32))], max_new=100)
    assert len(outs[0]) == 3 and reasons == {0: "length"}
    assert r.kv.num_free_tokens == 256 - 1


def test_a_short_cache_preempts_the_partly_prefilled_request_then_the_newest_running_one():
    """The scheduler alone, over a fake KV cache that cannot hold the next decode step twice over: the request being
    prefilled in chunks goes first, then the newest running one; each frees its slot and waits, the one preempted
    last first in line."""
    answers = iter([False, False, True])  # can_allocate: room once two requests are gone
    kv = SimpleNamespace(can_allocate=lambda n: next(answers), has_free_slot=lambda: False)
    args = SimpleNamespace(disable_chunked_prefill=False, enable_mixed_chunk=False, prefill_step_tokens=64,
                           spec_tokens=1, batch_max_tokens=64, max_req_total_len=64,
                           running_max_req_size=4)  # fmt: skip
    freed = []
    sched = Scheduler(SimpleNamespace(args=args, kv=kv, free=lambda slot, last: freed.append(slot)), [])
    old, new, part = (Request(name, list(range(3, 3 + n)), SamplingParams(), lambda ev: None)
                      for name, n in (("old", 3), ("new", 4), ("part", 40)))  # fmt: skip
    old.slot, new.slot, part.slot, part.prefilled = 0, 1, 2, 16
    sched.running, sched.prefilling, sched.last_step = [old, new], [part], "prefill"  # a chunk step just ran
    assert sched.schedule() == ("decode", [old])
    assert [r.id for r in sched.waiting] == ["new", "part"] and freed == [2, 1] and not sched.prefilling
    assert (new.slot, part.slot, part.prefilled) == (-1, -1, 0)


def test_abort_frees_kv(model_dir):
    r = runner(model_dir, 256)
    sched = Engine(r, eos_ids=[])
    events = []
    sched.submit(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True), events.append))
    sched.step()  # prefill
    sched.step()  # one decode
    assert r.kv.num_free_tokens < 255
    sched.abort("a")
    sched.step()
    assert r.kv.num_free_tokens == 255 and events[-1].finish_reason == "abort"


def test_cache_smaller_than_one_request_is_a_startup_error(model_dir):
    with pytest.raises(ValueError, match="--max_total_token_num 20 expected at least 33: one --max_req_total_len"):
        runner(model_dir, 20)


def test_step_metrics_count_every_prefill_and_decode_step(model_dir):
    """4 prompts that fit one prefill, 12 tokens each: 1 prefill step of 4 requests, then 11 decode steps of 4."""
    from lightllm.server.metrics import Metrics

    metrics = Metrics()
    sched = Engine(runner(model_dir, 512), eos_ids=[], observer=metrics)
    run_all(sched, [[3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35], [40, 41]])
    value = metrics.registry.get_sample_value
    assert value("lightllm_step_batch_size_count", {"kind": "prefill"}) == 1
    assert value("lightllm_step_batch_size_sum", {"kind": "prefill"}) == 4
    assert value("lightllm_step_batch_size_count", {"kind": "decode"}) == 11
    assert value("lightllm_step_batch_size_sum", {"kind": "decode"}) == 44
    for kind, steps in (("prefill", 1), ("decode", 11)):
        assert value("lightllm_step_seconds_count", {"kind": kind}) == steps
        assert value("lightllm_step_seconds_sum", {"kind": kind}) > 0
    assert value("lightllm_generated_tokens_total") == 4 * 12


def test_a_failing_prefill_fails_its_batch_and_frees_it(model_dir):
    """The admitted batch is in neither the running nor the waiting list while it prefills."""
    r = runner(model_dir, 512)
    events = []
    sched = Engine(r, eos_ids=[])
    r.prefill = lambda slots, prompts, publish=(): (_ for _ in ()).throw(RuntimeError("device lost"))
    for i in range(2):
        sched.submit(Request(str(i), [3, 4, 5], SamplingParams(max_new_tokens=4), events.append))
    assert sched.step()
    assert [(ev.kind, ev.finish_reason) for ev in events] == [("finish", "error")] * 2
    assert r.kv.num_free_tokens == 512 - 1 and r.kv.num_free_slots == r.args.running_max_req_size
    assert not sched.has_unfinished()


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_a_failed_forward_fails_only_the_requests_in_it(model_dir, failing):
    """One long prompt running out of memory must not end the requests already decoding (a failed prefill) or
    the ones still queued (either): they finish as they would have without it."""
    prompts = [[3, 4, 5, 6], [20, 21, 22], [30, 31, 32, 33, 34]]  # 0 decodes; 1 is the culprit; 2 is queued
    want, _ = run_all(Engine(runner(model_dir, 512), eos_ids=[]), [prompts[0], prompts[2]])
    r = runner(model_dir, 512)
    r.args.running_max_req_size = 2  # request 2 waits behind 0 and 1
    slots = r.kv.num_free_slots
    real_prefill, real_decode = r.prefill, r.decode
    culprit = {}

    def prefill(slots, contexts, publish=()):
        if failing == "prefill" and contexts[0][:3] == prompts[1]:
            raise RuntimeError("CUDA out of memory")
        return real_prefill(slots, contexts, publish)

    def decode(slots, tokens):
        if failing == "decode" and len(slots) == 2 and not culprit:  # 0 and 1 decoding together, once
            culprit["hit"] = True
            raise RuntimeError("CUDA out of memory")
        return real_decode(slots, tokens)

    r.prefill, r.decode = prefill, decode
    sched = Engine(r, eos_ids=[])
    outs, reasons = {i: [] for i in range(3)}, {}
    for i, p in enumerate(prompts):
        emit = (
            lambda i: lambda ev: (
                outs[i].append(ev.token_id) if ev.kind == "token" else reasons.update({i: ev.finish_reason})
            )
        )(i)
        sched.submit(Request(str(i), p, SamplingParams(max_new_tokens=12, ignore_eos=True), emit))
        if i == 0:
            sched.step()  # 0 runs alone first, then 1 arrives
    while len(reasons) < 3:
        assert sched.step()
    if failing == "prefill":
        assert reasons == {0: "length", 1: "error", 2: "length"} and outs[1] == []
        assert [outs[0], outs[2]] == [want[0], want[1]]
    else:  # the decode step held 0 and 1: both fail there; 2 was queued and goes on
        assert reasons == {0: "error", 1: "error", 2: "length"} and outs[2] == want[1]
    assert r.kv.num_free_tokens == 512 - 1 and r.kv.num_free_slots == slots


def test_a_seeded_neighbour_draws_the_same_tokens_when_the_batch_draw_fails(model_dir, monkeypatch):
    import lightllm.engine.engine as engine_module

    seeded = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=7)
    want, _ = run_all(Engine(runner(model_dir, 512), eos_ids=[]), [[3, 4, 5]], params={0: seeded})
    real = engine_module.sample
    poisoned = SamplingParams(max_new_tokens=8, ignore_eos=True, top_p=0.5)

    def sample(logits, params, generators):
        if len(params) > 1:  # the batch draw advances the seeded generator, then fails
            for g in generators:
                if g is not None:
                    torch.rand(16, generator=g, device=g.device)
            raise RuntimeError("this batch's parameters break the sampler")
        if params[0] is poisoned:
            raise RuntimeError("this request's parameters break the sampler")
        return real(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", sample)
    got, reasons = run_all(
        Engine(runner(model_dir, 512), eos_ids=[]), [[3, 4, 5], [9, 9]], params={0: seeded, 1: poisoned}
    )
    assert reasons == {0: "length", 1: "error"} and got[0] == want[0]


@pytest.mark.parametrize("fail_at_call", [1, 4], ids=["in-prefill", "in-decode"])
def test_a_request_whose_sampling_fails_ends_alone(model_dir, monkeypatch, fail_at_call):
    """Its neighbours in the step finish normally with the tokens they get without it; its KV is freed."""
    import lightllm.engine.engine as engine_module

    prompts = [[3, 4, 5, 6], [20, 21, 22], [30, 31, 32, 33, 34]]
    want, _ = run_all(Engine(runner(model_dir, 512), eos_ids=[]), prompts[::2])
    real, calls = engine_module.sample, []
    poisoned = SamplingParams(max_new_tokens=12, ignore_eos=True, top_p=0.5)  # greedy: top_p marks it only

    def sample(logits, params, generators):
        calls.append(len(params))
        if len(calls) >= fail_at_call and any(p is poisoned for p in params):
            raise RuntimeError("this request's parameters break the sampler")
        return real(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", sample)
    r = runner(model_dir, 512)
    got, reasons = run_all(Engine(r, eos_ids=[]), prompts, params={1: poisoned})
    assert reasons == {0: "length", 1: "error", 2: "length"}
    assert [got[0], got[2]] == [want[0], want[1]]
    assert len(got[1]) == fail_at_call - 1  # the tokens it had before its draw failed
    assert r.kv.num_free_tokens == 512 - 1 and r.kv.num_free_slots == r.args.running_max_req_size


def test_an_abort_ends_a_waiting_request_too_and_keeps_its_reason(model_dir):
    """Every submitted request gets one finish event: a request aborted while still queued as well; a stop
    string's abort ends the request with "stop"."""
    r = runner(model_dir, 512)  # running_max_req_size 4: the fifth request waits
    sched = Engine(r, eos_ids=[])
    events = {str(i): [] for i in range(5)}
    for i in range(5):
        req_id = str(i)
        sched.submit(
            Request(req_id, [3, 4, 5], SamplingParams(max_new_tokens=20, ignore_eos=True), events[req_id].append)
        )
    sched.step()  # prefill of the first four
    assert [r.id for r in sched.scheduler.waiting] == ["4"]
    sched.abort("4")
    sched.abort("0", reason="stop")
    sched.step()
    assert [(e.kind, e.finish_reason) for e in events["4"]] == [("finish", "abort")]
    assert (events["0"][-1].kind, events["0"][-1].finish_reason) == ("finish", "stop")
    assert not sched.scheduler.waiting and [r.id for r in sched.scheduler.running] == ["1", "2", "3"]


def test_a_request_whose_logits_processor_setup_fails_ends_alone_with_error(model_dir):
    """A logit bias outside the vocabulary (past the entry points' checks) makes its first draw's table setup raise:
    that request ends "error" and frees its row; it did not go on, its bias silently dropped, with a row taken but
    never filled (the one-by-one retry found the row and skipped the setup)."""
    prompts = [[3, 4, 5, 6], [20, 21, 22], [30, 31, 32, 33, 34]]
    want, _ = run_all(Engine(runner(model_dir, 512), eos_ids=[]), prompts[::2])
    bad = SamplingParams(max_new_tokens=12, ignore_eos=True)
    bad.logit_bias = {10**6: 1.0}  # set after the constructor's checks
    r = runner(model_dir, 512)
    engine = Engine(r, eos_ids=[])
    got, reasons = run_all(engine, prompts, params={1: bad})
    assert reasons == {0: "length", 1: "error", 2: "length"} and got[1] == []
    assert [got[0], got[2]] == [want[0], want[1]]
    assert engine.processor.rows_in_use == 0 and r.kv.num_free_tokens == 512 - 1
