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
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.runner import Runner
from lightllm.engine.sampler import SamplingParams
from lightllm.server.metrics import Metrics
from lightllm.tools.make_tiny_model import make_tiny_qwen3

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


def run(model_dir, observer, top_logprobs=0):
    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64,
                      chunked_prefill_size=16, running_max_req_size=4, max_total_token_num=512)  # fmt: skip
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


def test_the_runner_marks_each_forward_once_its_inputs_are_staged(model_dir):
    """The hook runs once per forward, after the step's KV rows were extended (host work before the launch)."""
    args = EngineArgs(
        model_dir=model_dir, data_type="fp32", device="cpu", max_req_total_len=64, max_total_token_num=512
    )
    r = ModelRunner(args)
    seen = []
    r.set_launch_hook(lambda: seen.append(list(r.kv.seq_lens([slot]))))
    slot = r.add_request()
    r.prefill([slot], [[3, 4, 5]])
    r.decode([slot], [6])
    r.decode([slot], [7])
    assert seen == [[3], [4], [5]]


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
def test_an_engine_step_on_the_gpu_takes_less_gpu_time_than_wall_time(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "GPU_TIME_EVERY", 1)
    model = str(make_tiny_qwen3(tmp_path / "m", seed=2))
    r = ModelRunner(EngineArgs(model_dir=model, data_type="bf16", max_req_total_len=64, running_max_req_size=4))
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
    engine.submit(Request("0", [3, 4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True), lambda ev: None))
    while engine.step():
        pass
    decode = [s for k, s in observer.gpu if k == "decode"]
    assert len(decode) == len(walls["decode"]) == 7
    assert all(0 < g < 0.02 <= w for g, w in zip(decode, walls["decode"])), (decode, walls["decode"])
