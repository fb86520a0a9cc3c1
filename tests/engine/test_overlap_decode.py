"""Overlapped decode: a decode step is launched from the last step's draws still on the device, before the host reads
them. Everything a client sees (tokens, logprobs, top logprobs, finish reasons) and what the KV cache keeps must equal
synchronous decode, whatever ends a request (a stop token read while the next step is in flight, length, an abort,
preemption, a failed forward)."""

import pytest
import torch

import lightllm.engine.engine as engine_module
from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, make_tiny_qwen3
from tests.engine.test_prefill_graph import graph_runner

PROMPTS = [[3, 4, 5, 6], [20, 21, 22], [30, 31, 32, 33, 34], [7, 8], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2))


def eager_runner(model_dir, overlap, tokens=512, **kw):
    kw = {"batch_max_tokens": 64, "running_max_req_size": 4, **kw}
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", max_req_total_len=48,
                      max_total_token_num=tokens, disable_overlap_schedule=not overlap, **kw)  # fmt: skip
    return ModelRunner(args)


def staged_runner(model_dir, overlap):
    """Decode graphs (CPU stand-ins) for batches up to 2: the staged path, whose input ids are filled on the device."""
    runner, _ = graph_runner(model_dir, max_req_total_len=48, disable_overlap_schedule=not overlap)
    return runner


def mixed_params(stop):
    """Greedy, greedy stopping on ``stop``, seeded top-p with top logprobs, penalised with a bias, min_tokens."""
    return [
        SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=12, stop_token_ids=[stop], logprobs=True),
        SamplingParams(max_new_tokens=7, temperature=0.9, top_p=0.9, seed=5, top_logprobs=3, ignore_eos=True),
        SamplingParams(
            max_new_tokens=10,
            temperature=0.7,
            seed=9,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logit_bias={11: 2.0},
            ignore_eos=True,
        ),
        SamplingParams(max_new_tokens=6, min_tokens=4, stop_token_ids=[stop], logprobs=True),
    ]


def same(got, want):
    """Tokens, top logprob ids and finish reasons equal; logprobs to float32 rounding: a request that ended on a stop
    token still had its next token computed in the step in flight, so the steps after it run one more row, and a
    CPU matmul's rounding may differ with its batch size."""
    assert got.keys() == want.keys()
    for rid, (toks, lps, tops, reason) in got.items():
        w_toks, w_lps, w_tops, w_reason = want[rid]
        assert (toks, reason) == (w_toks, w_reason), rid
        assert lps == pytest.approx(w_lps, abs=1e-5), rid
        ids = [None if t is None else [i for i, _ in t] for t in tops]
        assert ids == [None if t is None else [i for i, _ in t] for t in w_tops], rid
        for t, w in zip(tops, w_tops):
            assert t is None or [v for _, v in t] == pytest.approx([v for _, v in w], abs=1e-5), rid


def run(engine, prompts, params, abort_after=None):
    """Every prompt to its end: {id: (tokens, logprobs, top logprobs, finish reason)}. ``abort_after`` (id, n):
    abort that request once it has emitted n tokens."""
    out = {}

    def emitter(rid):
        def emit(ev):
            toks, lps, tops, reason = out.setdefault(rid, ([], [], [], []))
            if ev.kind == "token":
                assert not reason, f"request {rid} emitted a token after its finish"
                toks.append(ev.token_id)
                lps.append(ev.logprob)
                tops.append(ev.top_logprobs)
                if abort_after and abort_after == (rid, len(toks)):
                    engine.abort(rid)
            else:
                reason.append(ev.finish_reason)

        return emit

    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(Request(str(i), p, sp, emitter(str(i))))
    while engine.has_unfinished():
        engine.step()
    while engine.step():  # a step still in flight holds only ended requests: read it
        pass
    assert all(len(v[3]) == 1 for v in out.values())
    return out


def stop_token(model_dir):
    """A token the second prompt's greedy output reaches at its 5th token (and not before), so a stop on it ends
    that request mid-run."""
    engine = Engine(eager_runner(model_dir, False), eos_ids=[])
    out = run(engine, PROMPTS[1:2], [SamplingParams(max_new_tokens=8, ignore_eos=True)])["0"][0]
    fresh = [tok for n, tok in enumerate(out) if n >= 2 and tok not in out[:n]]
    assert fresh, f"the tiny model's greedy output {out} has no new token after its second: no stop to test"
    return fresh[0]


@pytest.mark.parametrize("make", [eager_runner, staged_runner], ids=["eager", "staged"])
def test_overlapped_decode_emits_exactly_what_synchronous_decode_does(model_dir, make):
    stop = stop_token(model_dir)
    params = mixed_params(stop)
    want = run(Engine(make(model_dir, False), eos_ids=[]), PROMPTS, params)
    engine = Engine(make(model_dir, True), eos_ids=[])
    assert engine.overlap
    ahead, real = [], engine.runner.decode_ahead
    engine.runner.decode_ahead = lambda *a: (ahead.append(len(a[0])), real(*a))[1]
    got = run(engine, PROMPTS, params)
    same(got, want)
    assert want["1"][3] == ["stop"] and len(want["1"][0]) < 12  # the stop token ended it mid-run
    assert ahead, "no decode step was launched ahead"
    assert engine.scheduler.requests() == [] and engine.processor.rows_in_use == 0


def test_a_step_is_launched_before_the_one_it_follows_is_read(model_dir, monkeypatch):
    """The order of the host's calls: each ``decode_ahead`` comes before the read of the step whose draws it takes."""
    log = []
    engine = Engine(eager_runner(model_dir, True), eos_ids=[])
    real_ahead, real_lists = engine.runner.decode_ahead, engine_module.HostCopy.lists
    engine.runner.decode_ahead = lambda *a: (log.append("launch"), real_ahead(*a))[1]
    monkeypatch.setattr(engine_module.HostCopy, "lists", lambda self: (log.append("read"), real_lists(self))[1])
    run(engine, PROMPTS[:2], [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 2)
    # prefill read, first decode launched (no launch ahead: its inputs are host tokens), then launch-read pairs
    assert log[0] == "read" and log.count("launch") == 4 and "launch read launch read" in " ".join(log)
    assert log[-1] == "read"


def test_the_kv_cache_ends_as_with_synchronous_decode(model_dir):
    """No KV slot leaks (every slot free or the prefix cache's to evict), and the prefix cache keeps each finished
    request's context: a later prompt equal to it finds all but its last token cached, and all of it for a request
    that ended on a stop token with overlap (that token's KV was computed in the step in flight; kept, not wasted)."""
    stop = stop_token(model_dir)
    params = mixed_params(stop)
    for overlap in (False, True):
        runner = eager_runner(model_dir, overlap)
        engine = Engine(runner, eos_ids=[])
        free = runner.kv.num_free_tokens
        out = run(engine, PROMPTS, params)
        assert runner.kv.num_free_tokens == free
        assert runner.kv.prefix.num_tokens == runner.kv.prefix.num_evictable > 0
        for i, prompt in enumerate(PROMPTS):
            toks, _, _, reason = out[str(i)]
            context = prompt + toks
            ahead = overlap and reason == ["stop"]
            assert runner.kv.match_prefix(context)[0] == len(context) - (0 if ahead else 1), (overlap, i)


def test_a_request_waiting_for_kv_does_not_stop_the_overlap(model_dir):
    """A 70-token pool: three 16-token prompts run and a 30-token one waits, a request slot free but not the KV for
    its context, until they end. Steps go on being launched ahead while it waits (the scheduler's admission check,
    not just a free slot, decides), and the outputs are synchronous decode's."""
    prompts = [list(range(10 + i, 26 + i)) for i in range(3)] + [list(range(100, 130))]
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3 + [SamplingParams(max_new_tokens=4)]
    want = run(Engine(eager_runner(model_dir, False, tokens=70), eos_ids=[]), prompts, params)
    engine = Engine(eager_runner(model_dir, True, tokens=70), eos_ids=[])
    waiting, real = [], engine.runner.decode_ahead
    engine.runner.decode_ahead = lambda *a: (waiting.append(len(engine.scheduler.waiting)), real(*a))[1]
    same(run(engine, prompts, params), want)
    assert waiting.count(1) >= 3 and engine.scheduler.requests() == []


def test_an_abort_while_a_step_is_in_flight_ends_only_that_request(model_dir):
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * 3
    want = run(Engine(eager_runner(model_dir, False), eos_ids=[]), PROMPTS[:3], params, abort_after=("1", 3))
    got = run(Engine(eager_runner(model_dir, True), eos_ids=[]), PROMPTS[:3], params, abort_after=("1", 3))
    assert got["1"][3] == ["abort"] and len(got["1"][0]) == 3  # its token in flight is dropped
    same(got, want)


def served(engine, requests, on_token):
    """Serve ``requests`` ((id, prompt, params)) to their end; ``on_token(engine, id, n)`` runs in the emit of each
    request's n-th token (a callback's aborts and submits). {id: (tokens, finish reasons)}."""
    out = {}

    def emitter(rid):
        def emit(ev):
            toks, reasons = out.setdefault(rid, ([], []))
            if ev.kind == "token":
                toks.append(ev.token_id)
                on_token(engine, rid, len(toks))
            else:
                reasons.append(ev.finish_reason)

        return emit

    for rid, prompt, params in requests:
        engine.submit(Request(rid, prompt, params, emitter(rid)))
    while engine.has_unfinished():
        engine.step()
    while engine.step():
        pass
    return out


def test_an_abort_made_while_the_step_in_flight_is_read_comes_before_the_next_forward(model_dir):
    """Aborts from emit callbacks while the step in flight is read, when that read is followed by a prefill or mixed
    step in the same ``step()`` (not a decode launched ahead): the aborted running request gets no further token
    and ends "abort", and a waiting request aborted there is never admitted, as with synchronous decode."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    late = [("0", [3, 4, 5, 6], params), ("1", list(range(10, 40)), SamplingParams(max_new_tokens=3, ignore_eos=True))]

    def abort_own_third_and_submit_the_long_prompt(engine, rid, n):  # the prompt's chunk comes with the next step
        if rid == "0" and n == 2:
            engine.submit(Request(*late[1], lambda ev: None))
        if rid == "0" and n == 3:
            engine.abort("0")

    def abort_waiting(engine, rid, n):  # one request slot: "1" waits until "0" ends with its 4th token
        if rid == "0" and n == 4:
            engine.abort("1")

    waiting = [("0", [3, 4, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True)),
               ("1", [20, 21, 22], SamplingParams(max_new_tokens=1, ignore_eos=True))]  # fmt: skip
    for overlap in (False, True):
        mixed = Engine(eager_runner(model_dir, overlap, enable_mixed_chunk=True, batch_max_tokens=16), eos_ids=[])
        got = served(mixed, late[:1], abort_own_third_and_submit_the_long_prompt)
        assert (len(got["0"][0]), got["0"][1]) == (3, ["abort"]), overlap
        one_slot = Engine(eager_runner(model_dir, overlap, running_max_req_size=1), eos_ids=[])
        got = served(one_slot, waiting, abort_waiting)
        assert got["1"] == ([], ["abort"]) and (len(got["0"][0]), got["0"][1]) == (4, ["length"]), overlap


def test_abort_all_from_an_emit_ends_every_request_with_what_it_emitted_so_far(model_dir):
    """Shutdown from a callback: the tokens in flight are dropped, as synchronous decode would not have computed
    them, and every request ends "abort", none by length on a token computed past the shutdown."""
    requests = [("0", [3, 4, 5, 6], SamplingParams(max_new_tokens=10, ignore_eos=True)),
                ("1", [20, 21, 22], SamplingParams(max_new_tokens=4, ignore_eos=True))]  # fmt: skip

    def shut_down(engine, rid, n):
        if rid == "0" and n == 3:
            engine.abort_all()

    for overlap in (False, True):
        got = served(Engine(eager_runner(model_dir, overlap), eos_ids=[]), requests, shut_down)
        assert {rid: (len(t), r) for rid, (t, r) in got.items()} == {"0": (3, ["abort"]), "1": (3, ["abort"])}


def test_preemption_gives_the_same_tokens(model_dir):
    """A 49-token pool (the least a 48-token request allows) for five requests of up to 16 tokens each, four running
    at once: one is preempted and re-prefilled."""
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * len(PROMPTS)
    want = run(Engine(eager_runner(model_dir, False, tokens=49), eos_ids=[]), PROMPTS, params)
    preempted = []
    engine = Engine(eager_runner(model_dir, True, tokens=49), eos_ids=[])
    real = engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    same(run(engine, PROMPTS, params), want)
    assert preempted


def test_a_failed_forward_ahead_ends_its_batch_with_an_error_and_the_engine_goes_on(model_dir):
    """The step in flight is still read (its tokens emitted), the requests of the failed step end with "error",
    and a request submitted afterwards is served."""
    engine = Engine(eager_runner(model_dir, True), eos_ids=[])
    real, calls = engine.runner.decode_ahead, []

    def fail_third(*a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory (test)")
        return real(*a)

    engine.runner.decode_ahead = fail_third
    out = run(engine, PROMPTS[:2], [SamplingParams(max_new_tokens=10, ignore_eos=True)] * 2)
    # prefill token, the first decode (synchronous launch) and two steps launched ahead were read: 4 tokens each
    assert {k: (len(v[0]), v[3]) for k, v in out.items()} == {"0": (4, ["error"]), "1": (4, ["error"])}
    engine.runner.decode_ahead = real
    later = run(engine, PROMPTS[2:3], [SamplingParams(max_new_tokens=5, ignore_eos=True)])
    assert later["0"][3] == ["length"] and len(later["0"][0]) == 5


def test_disable_overlap_schedule_turns_it_off(model_dir):
    """(Tensor parallelism's runner does not decode ahead: ``test_runner_interface.py``.)"""
    assert Engine(eager_runner(model_dir, True), eos_ids=[]).overlap
    assert not Engine(eager_runner(model_dir, False), eos_ids=[]).overlap


@pytest.mark.gpu
def test_overlapped_decode_on_the_gpu_emits_what_synchronous_decode_does(tmp_path):
    """bf16 with decode graphs (batches over the largest graph decode eagerly) and the mixed sampling settings."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = str(make_tiny_qwen3(tmp_path / "m", seed=2, **BUILTIN_SHAPE))
    outs = {}
    for overlap in (False, True):
        # a small pool: the GPU tests after this one find their memory free
        runner = ModelRunner(EngineArgs(model_dir=model, data_type="bf16", max_req_total_len=64,
                                        max_total_token_num=2048, running_max_req_size=8, graph_max_batch_size=4,
                                        disable_overlap_schedule=not overlap))  # fmt: skip
        engine = Engine(runner, eos_ids=[])
        assert engine.overlap == overlap
        prompts = PROMPTS + [[50 + i, 60 + i, 70 + i] for i in range(3)]  # 8 requests: over the 4-graph
        params = mixed_params(stop=17) + [SamplingParams(max_new_tokens=20 + i, ignore_eos=True) for i in range(3)]
        outs[overlap] = run(engine, prompts, params)
        del engine, runner
        torch.cuda.empty_cache()
    same(outs[True], outs[False])


@pytest.mark.gpu
def test_from_a_launch_ahead_to_the_read_of_the_step_before_nothing_waits_for_the_gpu(tmp_path, monkeypatch):
    """The host is free while the GPU works: launching a step ahead (staging, the input ids taken from the draws on
    the device, the graph replay or eager forward, penalties, the draw, top logprobs and the copies to the host)
    never synchronizes; only the read waits. torch's sync debug mode raises on any synchronizing call."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = str(make_tiny_qwen3(tmp_path / "m", seed=2, **BUILTIN_SHAPE))
    runner = ModelRunner(EngineArgs(model_dir=model, data_type="bf16", max_req_total_len=64, max_total_token_num=2048,
                                    running_max_req_size=8, graph_max_batch_size=4))  # fmt: skip
    engine = Engine(runner, eos_ids=[])
    real_ahead, real_lists, windows = runner.decode_ahead, engine_module.HostCopy.lists, []

    def strict_ahead(*a):
        torch.cuda.set_sync_debug_mode("error")
        windows.append(len(a[0]))
        return real_ahead(*a)

    def lists(self):
        torch.cuda.set_sync_debug_mode(0)
        return real_lists(self)

    runner.decode_ahead = strict_ahead
    monkeypatch.setattr(engine_module.HostCopy, "lists", lists)
    try:
        params = mixed_params(stop=17) + [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in range(3)]
        out = run(engine, PROMPTS + [[50 + i, 60 + i] for i in range(3)], params)  # 8: graphs to 4, then eager
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert max(windows) > 4 and min(windows) <= 4 and all(len(v[3]) == 1 for v in out.values())
