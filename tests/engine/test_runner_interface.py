"""The runner interface is exactly what the engine uses, and the tensor-parallel runner implements it explicitly:
no call reaches rank 0's runner without being either broadcast or read-only."""

import contextlib

import pytest
import torch

from lightllm.engine.engine import Engine, eos_token_ids
from lightllm.engine.request import Request
from lightllm.engine.runner import STATE_CHANGING, AheadDecoder, KVQueries, Runner
from lightllm.engine.sampler import SamplingParams
from lightllm.server import tp
from lightllm.tools.make_tiny_model import make_tiny_qwen3
from tests.engine.test_scheduler import runner as make_runner


def members(protocol) -> set:
    return {n for n in dir(protocol) if not n.startswith("_")}


class Recording:
    """Passes every attribute through to ``target`` and notes its name."""

    def __init__(self, target, used: set, wrap=None):
        self._target, self._used, self._wrap = target, used, wrap or {}

    def __getattr__(self, name):
        self._used.add(name)
        value = getattr(self._target, name)
        return self._wrap[name](value) if name in self._wrap else value


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2))


def test_the_interface_lists_exactly_what_the_engine_uses(model_dir):
    """Admission, prefill, decode, preemption (a 40-token cache), finishing, an abort and a seeded request: every
    runner and KV member the engine touches is in the interface, and every member is touched (``model_dir`` is
    for the server and LLM, which load the tokenizer from it)."""
    used, kv_used = set(), set()
    runner = Recording(make_runner(model_dir, 40), used, {"kv": lambda kv: Recording(kv, kv_used)})
    steps = []

    class Observer:  # the server's metrics: they ask for the KV usage
        def on_queues(self, waiting, running, kv_usage):
            pass

        def on_token(self, first, seconds):
            pass

        def on_step(self, kind, batch_size, seconds):
            steps.append(kind)

        def on_spec(self, drafts, accepted):
            pass

        def on_step_gpu(self, kind, seconds):  # asked for the runner's launch hook (a timer only on a GPU)
            pass

    # built as the server and LLM build it: the EOS ids come from the runner's config
    engine = Engine(runner, eos_token_ids(runner.config, None), observer=Observer())
    preempted = []
    real = engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    finished = {}
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35], [40, 41]]
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=i)
        engine.submit(Request(str(i), p, params, lambda ev, i=i: finished.update({i: ev.finish_reason})
                              if ev.kind == "finish" else None))  # fmt: skip
    engine.step()
    engine.abort("3")
    while engine.has_unfinished():
        engine.step()
    assert finished == {0: "length", 1: "length", 2: "length", 3: "abort"}
    assert preempted and {"prefill", "decode"} <= set(steps)
    assert used | {"model_dir"} == members(Runner) | members(AheadDecoder)  # the model runner decodes ahead
    assert kv_used == members(KVQueries)


def test_the_tensor_parallel_runner_forwards_nothing_implicitly(model_dir):
    class Workers:
        def command(self, name):
            return contextlib.nullcontext()

    rank0 = tp.TPRunner(make_runner(model_dir, 256), group=None, workers=Workers())
    cast = []
    rank0._cast = lambda *cmd: cast.append(cmd)
    assert "__getattr__" not in vars(tp.TPRunner)
    assert isinstance(rank0, Runner) and isinstance(rank0.kv, KVQueries)
    assert isinstance(rank0, AheadDecoder)  # overlapped decode: rank 0's draws reach the others on the device
    assert members(Runner) <= set(vars(tp.TPRunner))  # each one written out, none inherited or forwarded
    assert set(tp._COMMANDS) == set(STATE_CHANGING)
    with pytest.raises(AttributeError):
        rank0.extend  # a ModelRunner-only call does not silently run on rank 0 alone
    marks = []
    rank0.set_launch_hook(lambda: marks.append(len(cast)))  # rank 0's own launches, each after its broadcast
    slot = rank0.add_request()
    rank0.prefill([slot], [[3, 4, 5]])
    rank0.decode([slot], [6])
    rank0.decode_ahead([slot], [0], torch.tensor([7]))  # the draws stay on rank 0: the cast carries slots and rows
    rank0.inputs_known([slot], [7])
    rank0.free(slot)
    assert [c[0] for c in cast] == ["add_request", "prefill", "decode", "decode_ahead", "inputs_known", "free"]
    # what to publish, and MTP's tokens after each chunk, travel with the prefill; the last token with a free
    assert cast[1] == ("prefill", [slot], [[3, 4, 5]], [], [])
    assert cast[5] == ("free", slot, None)
    assert cast[3] == ("decode_ahead", [slot], [0]) and marks == [2, 3, 4]
