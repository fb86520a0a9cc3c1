"""The start-up's unaligned warm-up batches, on the CPU: which prefills they run, in which tuning scope, and that they
leave the KV pool and the request slots as they found them."""

import pytest

from lightllm.common.autotuner import current_warmup_kernel_type
from lightllm.engine import model_runner
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import UNALIGNED_WARMUP_BATCHES, ModelRunner
from lightllm.layers import linear_attention
from lightllm.models.qwen3.model import Qwen3Model
from lightllm.tools.make_tiny_model import make_tiny_qwen3


def test_the_batches_cover_the_lengths_the_ladder_never_runs():
    """The ladder's prompts are multiples of 16: each batch holds a request that is not, one is a single token (a
    prefix-cache hit's prefill), and one runs past Qwen3.5's fused recurrent limit at a total that is not a multiple
    of 16 (its chunked kernels)."""
    assert all(any(n % 16 for n in sizes) for sizes in UNALIGNED_WARMUP_BATCHES)
    assert (1,) in UNALIGNED_WARMUP_BATCHES
    assert any(sum(b) > linear_attention.RECURRENT_MAX_TOKENS and sum(b) % 16 for b in UNALIGNED_WARMUP_BATCHES)


@pytest.mark.parametrize(
    "running_max_req_size, max_req_total_len, batch_max_tokens, chunks, expected",
    [
        # every batch, each as two chunks; then the 256-token bucket's 128 + 127 (a request holds two 128 chunks)
        (4, 256, 256, 2, [1, 1, 17, 17, 32, 32, 34, 34, 97, 97, 130, 130, 255, 255]),
        (4, 256, 256, 1, [1, 17, 32, 34, 97, 130, 255]),  # no chunked prefill: one prefill each
        (1, 256, 256, 1, [1, 17, 97, 255]),  # one request slot: the single-request batches
        # requests of at most 64 tokens hold two chunks of up to 32: 4 x 32 - 1 is below the fixed batches
        (4, 64, 256, 2, [1, 1, 17, 17, 32, 32]),
        # one token short of every bucket past the fixed batches, up to a prefill step's 1000 tokens
        (4, 1024, 1000, 1, [1, 17, 32, 34, 97, 130, 255, 511, 999]),
    ],
)
def test_each_batch_that_fits_prefills_outside_any_tuning_scope(
    tmp_path, monkeypatch, running_max_req_size, max_req_total_len, batch_max_tokens, chunks, expected
):
    args = EngineArgs(model_dir=str(make_tiny_qwen3(tmp_path / "m", seed=0)), data_type="fp32", device="cpu",
                      batch_max_tokens=batch_max_tokens, max_req_total_len=max_req_total_len,
                      max_total_token_num=2048, running_max_req_size=running_max_req_size)  # fmt: skip
    runner = ModelRunner(args)
    log, real = [], Qwen3Model.forward

    def forward(self, input_ids, state):
        log.append((input_ids.shape[0], current_warmup_kernel_type()))
        return real(self, input_ids, state)

    monkeypatch.setattr(Qwen3Model, "forward", forward)
    monkeypatch.setattr(ModelRunner, "_warmup_chunks", lambda self: chunks)
    free_tokens, free_slots = runner.kv.num_free_tokens, runner.kv.num_free_slots
    runner._warmup_unaligned()
    assert log == [(n, None) for n in expected]
    assert (runner.kv.num_free_tokens, runner.kv.num_free_slots) == (free_tokens, free_slots)


def test_a_cpu_start_runs_none_of_them(tmp_path, monkeypatch):
    """On the CPU without graphs the torch references run: nothing compiles, so the start-up skips them."""
    called = []
    monkeypatch.setattr(model_runner.ModelRunner, "_warmup_unaligned", lambda self: called.append(True))
    ModelRunner(EngineArgs(model_dir=str(make_tiny_qwen3(tmp_path / "m", seed=0)), data_type="fp32", device="cpu",
                           max_req_total_len=64, max_total_token_num=512, running_max_req_size=2))  # fmt: skip
    assert called == []
