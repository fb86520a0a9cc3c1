"""The GPU part of an engine step (``gpu_timer.py``): when the engine starts, stops and reads its timer, what the
observer gets, and the ``/metrics`` histogram it lands in. On the CPU a fake timer stands in for CUDA events; the
real timer runs under ``pytest -m gpu``."""

import time

import pytest
import torch
from prometheus_client import generate_latest

import lightllm.engine.engine as engine_module
from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.gpu_timer import StepGpuTimer, step_gpu_timer
from lightllm.engine.logits_processor import LogitsProcessor
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.runner import Runner
from lightllm.engine.sampler import SamplingParams
from lightllm.server.metrics import Metrics
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, make_tiny_qwen3
from tests.engine.test_prefill_graph import graph_runner

PROMPTS = [[3, 4, 5, 6], [20, 21, 22], list(range(40, 80))]  # the last one (40 tokens) is prefilled in chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2))


class FakeTimer:
    """Records the engine's calls; a started and stopped step took 0.25 s of "GPU"."""

    def __init__(self):
        self.calls = []
        self.state = "idle"

    def start(self):
        self.calls.append("start")
        self.state = "started"

    def stop(self):
        self.calls.append("stop")
        self.state = "stopped" if self.state != "idle" else "idle"

    def seconds(self):
        self.calls.append("seconds")
        stopped, self.state = self.state == "stopped", "idle"
        return 0.25 if stopped else None


class Observer:
    def __init__(self):
        self.steps, self.gpu = [], []

    def on_queues(self, *a): ...

    def on_token(self, *a): ...

    def on_step(self, kind, batch_size, seconds):
        self.steps.append(kind)

    def on_step_gpu(self, kind, seconds):
        self.gpu.append((kind, seconds))

    def on_spec(self, *a): ...


def run(model_dir, observer, top_logprobs=0, overlap=False):
    """The prompts to 4 new tokens each; decode steps synchronous unless ``overlap`` (the timer's calls per step
    are then interleaved with the next step's launches)."""
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64,
                      chunked_prefill_size=16, running_max_req_size=4, max_total_token_num=512,
                      disable_overlap_schedule=not overlap)  # fmt: skip
    engine = Engine(ModelRunner(args), eos_ids=[], observer=observer)
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=4, ignore_eos=True, top_logprobs=top_logprobs)
        engine.submit(Request(str(i), p, params, lambda ev: None, arrival=0.0))
    while engine.step():
        pass
    return engine


def fake_timers(monkeypatch, every=1):
    timers = []
    monkeypatch.setattr(engine_module, "step_gpu_timer", lambda device: timers.append(FakeTimer()) or timers[-1])
    monkeypatch.setattr(engine_module, "GPU_TIME_EVERY", every)
    return timers


@pytest.mark.parametrize("top_logprobs", [0, 2])
def test_every_step_that_samples_reports_its_gpu_time_and_a_chunk_that_does_not_reports_none(
    model_dir, monkeypatch, top_logprobs
):
    timers = fake_timers(monkeypatch)
    observer = Observer()
    run(model_dir, observer, top_logprobs=top_logprobs)
    (timer,) = timers
    # per step: the runner starts it as it launches the forward, the engine stops it after the step's last launch
    # and reads it once the step is done; a prefill chunk that samples nothing is started and read, never stopped
    steps = " ".join(timer.calls).replace("start stop seconds", "S").replace("start seconds", "C").split()
    assert set(steps) == {"S", "C"} and len(steps) == len(observer.steps)
    # the 40-token prompt's middle chunk: its first 9 tokens share the first step with the short prompts (sampled),
    # then a 16-token chunk samples nothing, and its last 15 tokens are sampled
    assert steps.count("C") == 1 and observer.steps[steps.index("C")] == "prefill"
    assert len(observer.gpu) == steps.count("S") and all(s == 0.25 for _, s in observer.gpu)
    assert [k for k, _ in observer.gpu] == [k for k, step in zip(observer.steps, steps) if step == "S"]
    assert {k for k, _ in observer.gpu} == {"prefill", "decode"}


def test_one_step_in_gpu_time_every_is_timed_and_the_others_record_nothing(model_dir, monkeypatch):
    timers = fake_timers(monkeypatch, every=3)
    observer = Observer()
    run(model_dir, observer)
    (timer,) = timers
    timed = " ".join(timer.calls).replace("start stop seconds", "S").replace("start seconds", "C").split()
    assert len(timed) == -(-len(observer.steps) // 3)  # steps 0, 3, 6, ...: nothing recorded in between
    assert len(observer.gpu) == timed.count("S") > 0


def test_with_overlapped_decode_a_step_launched_while_a_timed_one_is_in_flight_is_not_timed(model_dir, monkeypatch):
    """One timer, one step at a time: with every step due (``GPU_TIME_EVERY`` 1) each timed step is started, stopped
    and read before the next timed one starts; the decode steps launched while one is in flight are not timed."""
    timers = fake_timers(monkeypatch)
    observer = Observer()
    run(model_dir, observer, overlap=True)
    (timer,) = timers
    steps = " ".join(timer.calls).replace("start stop seconds", "S").replace("start seconds", "C").split()
    assert set(steps) == {"S", "C"}  # never a start before the step in flight was read
    assert len(observer.gpu) == steps.count("S") and len(steps) < len(observer.steps)
    assert {k for k, _ in observer.gpu} == {"prefill", "decode"}


def test_the_runner_marks_each_forward_once_its_inputs_are_staged(model_dir):
    """The hook runs once per forward, after the host staged its inputs and before the launch: decode and prefill
    graph replays (CPU stand-ins replaying the captured forward), an eager prefill, and a prefill no graph serves."""
    r, api = graph_runner(model_dir, batch_max_tokens=64)  # prefill graphs up to 64 tokens
    log = []
    for name, obj in (("stage", r._staging), ("stage", r.prefill_graphs.staging), ("replay", api)):
        method = getattr(obj, name)
        setattr(obj, name, lambda *a, _m=method, _n=name, **k: (log.append(_n), _m(*a, **k))[1])
    r.set_launch_hook(lambda: log.append("hook"))
    a, b, c = r.add_request(), r.add_request(), r.add_request()
    r.prefill([a], [[3, 4, 5]])  # one request within a bucket: a prefill graph
    assert log == ["stage", "hook", "replay"]
    log.clear()
    r.prefill([b, c], [[9, 10], [11]])  # two requests: eager, its inputs built before the hook
    assert log == ["hook"]
    log.clear()
    r.prefill([c], [list(range(20, 120))])  # one request over the largest bucket: no graph, eager, one hook
    assert log == ["hook"]
    log.clear()
    r.decode([a], [6])  # a decode graph
    assert log == ["stage", "hook", "replay"]
    log.clear()
    r.decode([a, b], [7, 8])  # batch 2 (graphs to 2): staged, replayed
    assert log == ["stage", "hook", "replay"]


def test_the_timer_stops_after_the_steps_last_launch_and_before_any_read(model_dir, monkeypatch):
    """Top logprobs and penalty counts are launched before the stop; reading them (``tolist``) comes after it."""
    timers = fake_timers(monkeypatch)
    launch, record, read = engine_module.top_logprobs_launch, LogitsProcessor.record, engine_module.HostCopy.lists

    def logged(name, fn):
        def call(*a, **k):
            timers[0].calls.append(name)
            return fn(*a, **k)

        return call

    monkeypatch.setattr(engine_module, "top_logprobs_launch", logged("top_launch", launch))
    monkeypatch.setattr(LogitsProcessor, "record", logged("record", record))
    monkeypatch.setattr(engine_module.HostCopy, "lists", logged("read", read))
    observer = Observer()
    run(model_dir, observer, top_logprobs=2)
    sampled = [c for c in " ".join(timers[0].calls).split("seconds") if "stop" in c]
    assert sampled and all(c.split() == ["start", "top_launch", "record", "stop", "read"] for c in sampled)


@pytest.mark.parametrize("second", ["greedy", "sampled", "penalised"])
def test_an_mtp_step_is_timed_from_its_draft_to_its_one_read(tmp_path, monkeypatch, second):
    """MTP: a decode step (greedy, sampled, or with a penalised request: every verify position is decided on the
    device) starts the timer before its draft and stops it after the acceptance's last launch, before its one read.
    Prefill steps are timed as without MTP."""
    from lightllm.engine import spec_decode
    from lightllm.tools.make_tiny_model import make_tiny_qwen3_5

    timers = fake_timers(monkeypatch)
    real_cat = torch.cat

    def logged_cat(tensors, *a, **k):  # the acceptance packs its one read with a cat of three float64 tensors
        if len(tensors) == 3 and all(t.dtype == torch.float64 for t in tensors):
            timers[0].calls.append("pack")
        return real_cat(tensors, *a, **k)

    monkeypatch.setattr(spec_decode.torch, "cat", logged_cat)
    model = str(make_tiny_qwen3_5(tmp_path / "m", mtp="agree", seed=7))
    args = EngineArgs(model_dir=model, data_type="fp32", device="cpu", max_req_total_len=64, running_max_req_size=2,
                      mtp_mode="eagle_with_att", mtp_step=2)  # fmt: skip
    observer = Observer()
    engine = Engine(ModelRunner(args), eos_ids=[], observer=observer)
    extra = {"greedy": {}, "sampled": {"temperature": 0.8, "top_k": 40, "seed": 3},
             "penalised": {"repetition_penalty": 1.2}}[second]  # fmt: skip
    for i, p in enumerate(PROMPTS[:2]):
        params = SamplingParams(max_new_tokens=9, ignore_eos=True, **(extra if i else {}))
        engine.submit(Request(str(i), p, params, lambda ev: None, arrival=0.0))
    while engine.step():
        pass
    steps = " ".join(timers[0].calls).split("seconds")[:-1]
    assert len(steps) == len(observer.steps)
    decode = [c.split() for c, kind in zip(steps, observer.steps) if kind == "decode"]
    assert decode and all(c == ["start", "pack", "stop"] for c in decode), timers[0].calls
    assert [k for k, _ in observer.gpu].count("decode") == len(decode)
    assert "prefill" in [k for k, _ in observer.gpu]


def test_no_timer_without_an_observer_that_takes_gpu_time(model_dir, monkeypatch):
    asked = []
    monkeypatch.setattr(engine_module, "step_gpu_timer", lambda device: asked.append(device))

    class StepsOnly:
        def on_queues(self, *a): ...

        def on_token(self, *a): ...

        def on_step(self, *a): ...

    run(model_dir, StepsOnly())
    run(model_dir, None)

    class NoLaunchHook:  # a runner that cannot mark its launches (e.g. a test fake): no timer either
        def __init__(self, runner):
            self._runner = runner

        def __getattr__(self, name):
            if name == "set_launch_hook":
                raise AttributeError(name)
            return getattr(self._runner, name)

    args = EngineArgs(
        model_dir=model_dir, data_type="fp32", device="cpu", max_req_total_len=64, max_total_token_num=512
    )
    Engine(NoLaunchHook(ModelRunner(args)), eos_ids=[], observer=Observer())
    assert asked == []
    Engine(ModelRunner(args), eos_ids=[], observer=Observer())
    assert asked == [torch.device("cpu")]  # the check itself: asked once hook and observer are both there


def test_the_runners_launch_hook_does_not_keep_the_engine_alive(model_dir, monkeypatch):
    """The runner holds the engine's launch hook; the hook holds the engine weakly, so dropping the engine frees it
    (and what only it holds) at once, and ``set_observer(None)`` takes the hook off the runner."""
    import gc
    import weakref

    fake_timers(monkeypatch)
    runner = ModelRunner(EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", max_req_total_len=64,
                                    max_total_token_num=512))  # fmt: skip
    engine = Engine(runner, eos_ids=[], observer=Observer())
    assert runner._launch_hook is not None
    ref = weakref.ref(engine)
    gc.collect()
    gc.disable()
    try:
        del engine
        assert ref() is None
    finally:
        gc.enable()
    runner._launch_hook()  # a hook that outlives its engine does nothing
    engine = Engine(runner, eos_ids=[], observer=Observer())
    engine.set_observer(None)
    assert runner._launch_hook is None and engine._gpu_timer is None


def test_the_cpu_has_no_gpu_timer():
    assert step_gpu_timer(torch.device("cpu")) is None


def test_metrics_count_the_gpu_time_per_step_kind():
    metrics = Metrics()
    metrics.on_step_gpu("decode", 0.0012)
    metrics.on_step_gpu("decode", 0.0018)
    text = generate_latest(metrics.registry).decode()
    assert 'lightllm_step_gpu_seconds_count{kind="decode"} 2.0' in text
    assert 'lightllm_step_gpu_seconds_sum{kind="decode"} 0.003' in text
    assert 'lightllm_step_gpu_seconds_bucket{kind="decode",le="0.002"} 2.0' in text


@pytest.mark.gpu
def test_cuda_events_time_the_gpu_work_between_start_and_stop():
    timer = StepGpuTimer(torch.device("cuda"))
    assert timer.seconds() is None  # never started
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    timer.start()
    for _ in range(20):
        a = a @ a / 64
    timer.stop()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    time.sleep(0.05)  # host time after the GPU is done: not counted
    gpu = timer.seconds()
    assert 0 < gpu <= wall and timer.seconds() is None  # read once, then idle


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_engine_step_on_the_gpu_takes_less_gpu_time_than_wall_time_and_nothing_waits_inside(
    tmp_path, monkeypatch, overlap
):
    """Host work before the launch (a slowed staging) is wall time, never GPU time; and nothing between the timer's
    start and stop waits for the GPU (CUDA's sync debug mode raises on any wait), with a penalised request that
    asks for top logprobs beside a plain one. With overlapped decode every other decode step is timed (one launched
    while a timed one is in flight is not)."""
    monkeypatch.setattr(engine_module, "GPU_TIME_EVERY", 1)
    # the built-in model's shape: head_dim 64, the smallest the GPU kernels take; a small pool leaves the GPU free
    model = str(make_tiny_qwen3(tmp_path / "m", seed=2, **BUILTIN_SHAPE))
    r = ModelRunner(EngineArgs(model_dir=model, data_type="bf16", max_req_total_len=64, running_max_req_size=4,
                               max_total_token_num=1024, disable_overlap_schedule=not overlap))  # fmt: skip
    assert isinstance(r, Runner)
    walls = {}

    class Timed(Observer):
        def on_step(self, kind, batch_size, seconds):
            self.steps.append(kind)
            walls.setdefault(kind, []).append(seconds)

    seq_lens = r.kv.seq_lens

    def slow_staging(slots):  # 20 ms of host work before every decode launch: wall time, never GPU time
        time.sleep(0.02)
        return seq_lens(slots)

    r.kv.seq_lens = slow_staging
    observer = Timed()
    engine = Engine(r, eos_ids=[], observer=observer)
    timer, start, stop = engine._gpu_timer, engine._gpu_timer.start, engine._gpu_timer.stop

    def strict_start():
        start()
        torch.cuda.set_sync_debug_mode("error")

    def strict_stop():
        torch.cuda.set_sync_debug_mode("default")
        stop()

    timer.start, timer.stop = strict_start, strict_stop
    finished = {}
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    penalised = SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.3, top_logprobs=2)
    try:
        for rid, params in (("0", plain), ("1", penalised)):
            engine.submit(Request(rid, [3, 4, 5], params, lambda ev, rid=rid: finished.update({rid: ev.finish_reason})
                                  if ev.kind == "finish" else None))  # fmt: skip
            while engine.step():
                pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finished == {"0": "length", "1": "length"}  # a wait inside the window would have failed a step
    decode = [s for k, s in observer.gpu if k == "decode"]
    # 7 decode steps per request: with overlap the 1st, 3rd, 5th and 7th of each are timed
    assert len(walls["decode"]) == 14 and len(decode) == (8 if overlap else 14)
    assert all(0 < g < 0.02 for g in decode), decode
    # with overlap a step's wall time runs from the read before it to its own read, so it holds the slowed staging
    # of the step launched in between; each request's last step has none launched after it
    short = [w for w in walls["decode"] if w < 0.02]
    assert len(short) == (2 if overlap else 0), walls["decode"]
