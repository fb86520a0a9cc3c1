"""The engine's start-up draw (``Engine.warm_up_sampling``): on a GPU it runs every sampling option once before the
first request (CUDA loads each kernel's module at its first launch), and it leaves nothing behind."""

import sys
from pathlib import Path

import pytest
import torch

from lightllm.engine import engine as engine_mod
from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_model import FakeRunner  # noqa: E402


def _run(engine: Engine, params: SamplingParams, prompts) -> list:
    outs = {}
    for i, prompt in enumerate(prompts):
        outs[i] = []

        def emit(ev, i=i):
            if ev.kind == "token":
                outs[i].append((ev.token_id, round(ev.logprob, 5), ev.top_logprobs))

        engine.submit(Request(f"r{i}", list(prompt), params, emit))
    while engine.has_unfinished():
        engine.step()
    return [outs[i] for i in range(len(prompts))]


def test_it_draws_with_every_option_then_leaves_no_trace(monkeypatch):
    calls, tops = [], []
    real_sample, real_top = engine_mod.sample, engine_mod.top_logprobs_launch

    def sample(logits, params, generators, raw_logits=None):
        calls.append((len(params), raw_logits is not None, sum(g is not None for g in generators)))
        return real_sample(logits, params, generators, raw_logits)

    def top(logits, k):
        tops.append(k)
        return real_top(logits, k)

    monkeypatch.setattr(engine_mod, "sample", sample)
    monkeypatch.setattr(engine_mod, "top_logprobs_launch", top)
    warmed = Engine(FakeRunner(), eos_ids=[3])
    assert calls == []  # a CPU engine does not warm up on its own
    warmed.warm_up_sampling()
    # greedy alone (no processor change); then greedy, sampled and seeded together, the processor's logits changed
    assert calls == [(1, False, 0), (3, True, 1)] and tops == [2]
    assert warmed.processor.rows_in_use == 0 and not warmed.has_unfinished()
    monkeypatch.setattr(engine_mod, "sample", real_sample)
    monkeypatch.setattr(engine_mod, "top_logprobs_launch", real_top)
    fresh = Engine(FakeRunner(), eos_ids=[3])
    prompts = [[1, 2, 5], [7], [4, 4, 9, 2]]
    for params in (SamplingParams(max_new_tokens=6, ignore_eos=True),
                   SamplingParams(max_new_tokens=6, temperature=0.9, top_k=5, seed=11, presence_penalty=0.5,
                                  logit_bias={2: 1.5}, min_tokens=3, top_logprobs=2)):  # fmt: skip
        assert _run(warmed, params, prompts) == _run(fresh, params, prompts)


@pytest.mark.parametrize("device, warms", [("cpu", False), ("cuda", True)])
def test_a_cuda_engine_warms_up_at_construction(monkeypatch, device, warms):
    seen = []
    monkeypatch.setattr(Engine, "warm_up_sampling", lambda self: seen.append(self))
    runner = FakeRunner()
    runner.device = torch.device(device)  # nothing is allocated there: the warm-up itself is replaced
    engine = Engine(runner, eos_ids=[])
    assert seen == ([engine] if warms else [])


def test_it_runs_on_a_model_without_eos():
    """No token to hold back for ``min_tokens``, the bias on the last id: nothing raises, nothing is left."""
    engine = Engine(FakeRunner(), eos_ids=[])
    engine.warm_up_sampling()
    assert engine.processor.capacity >= 2 and engine.processor.rows_in_use == 0


def test_with_mtp_it_also_chooses_drafts_and_runs_the_acceptance(monkeypatch):
    from types import SimpleNamespace

    from lightllm.engine.spec_decode import SpecDecoder

    reads, real = [], SpecDecoder._read

    def read(self, batch, drafts, logits, chooser, want):
        reads.append((len(batch), tuple(drafts.shape), tuple(logits.shape), len(chooser.q), want))
        rows = real(self, batch, drafts, logits, chooser, want)
        width = 3 + 3 + 2 + 2 * 3 * 2  # T tokens, T logprobs, N going-on flags, T x want top ids and values
        assert len(rows) == len(batch) and all(len(r) == width for r in rows)
        return rows

    monkeypatch.setattr(SpecDecoder, "_read", read)
    runner = FakeRunner()
    runner.mtp = SimpleNamespace(step=2)  # two drafts a step: the verify reads three positions
    engine = Engine(runner, eos_ids=[3])
    assert engine.spec is not None
    engine.warm_up_sampling()
    # the sampled and seeded requests drew their drafts from q at both draft steps
    assert reads == [(3, (3, 2), (3, 3, runner.config.vocab_size), 2, 2)]
    assert engine.processor.rows_in_use == 0
