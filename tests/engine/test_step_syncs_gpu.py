"""Nothing of a decode step's own host code waits for the GPU: an eager decode step (its inputs staged in one copy,
the new KV slots written into the table from that copy), the logits processor and the sampler send their small
host lists without a synchronizing copy. torch's sync debug mode raises on any synchronizing copy or wait."""

from contextlib import contextmanager

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.logits_processor import LogitsProcessor
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams, sample
from lightllm.tools.make_tiny_model import make_tiny_qwen3

pytestmark = pytest.mark.gpu


@contextmanager
def no_syncs():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_an_eager_decode_step_never_synchronizes(tmp_path):
    model_dir = make_tiny_qwen3(tmp_path / "tiny", num_hidden_layers=2, head_dim=64, seed=1)
    runner = ModelRunner(EngineArgs(model_dir=str(model_dir), data_type="bf16", device="cuda", batch_max_tokens=64,
                                    max_req_total_len=64, running_max_req_size=4, disable_cudagraph=True))  # fmt: skip
    slots = [runner.add_request() for _ in range(2)]
    runner.prefill(slots, [[5, 17, 42], [11, 12]])
    runner.decode(slots, [1, 2])  # each kernel's first launch (compile, bind) outside the check
    with no_syncs():
        logits = runner.decode(slots, [3, 4])
    assert logits.shape[0] == 2
    for slot in slots:  # the staged table write put each step's slot at its position
        n = runner.kv.seq_len(slot)
        assert int(runner.kv.table[slot, n - 1]) >= 0 and n == {slots[0]: 5, slots[1]: 4}[slot]


def test_penalties_and_sampling_never_synchronize():
    # the draw too: exponential clocks, not torch.multinomial (whose input check reads the device)
    dev, vocab = torch.device("cuda"), 64
    params = [SamplingParams(max_new_tokens=8, presence_penalty=1.5, temperature=0.7, top_k=5),
              SamplingParams(max_new_tokens=8, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=8, temperature=1.1, top_p=0.8, seed=7)]  # fmt: skip
    reqs = [Request(str(i), [1, 2, 5 + i], p, lambda ev: None) for i, p in enumerate(params)]
    proc = LogitsProcessor(vocab, dev, [3])
    generators = [None, None, torch.Generator(dev).manual_seed(7)]
    proc.apply(torch.randn(3, vocab, device=dev), reqs)  # each request's first draw fills its table rows
    for _ in range(2):
        raw = torch.randn(3, vocab, device=dev)
        with no_syncs():
            logits = proc.apply(raw, reqs)
            tokens, logprobs = sample(logits, params, generators, raw_logits=raw)
            proc.record(reqs, tokens)
        assert tokens.shape == (3,) and torch.isfinite(logprobs).all()
