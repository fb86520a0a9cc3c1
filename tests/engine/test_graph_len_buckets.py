"""Decode graphs per KV length bucket (``--graph_len_buckets``): capture order and launch length per bucket, the
pick, the per-bucket cost report, the flag's checks, and greedy tokens through bucketed graphs on the CPU."""

import contextlib
import logging
import re

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, current_warmup_kernel_type
from lightllm.common.cuda_graph import DecodeGraphs, describe_costs
from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.sampler import SamplingParams
from lightllm.kernels.attention.decode.tuning import (
    decode_attn_autotune_seq_lens,
    decode_attn_run_key_lens,
    served_floor,
)
from lightllm.models.qwen3.model import Qwen3Model
from lightllm.server.args import parse_args
from lightllm.tools.make_tiny_model import make_tiny_qwen3
from tests.engine.test_scheduler import run_all
from tests.engine.test_startup import FakeGraphAPI

DA = AutotuneKernelType.DECODE_ATTENTION
MIB = 2**20


class MeteredGraphAPI(FakeGraphAPI):
    """The ordering fake, whose memory reading a captured forward can raise."""

    used = 0

    def memory_used(self):
        return self.used


def test_buckets_are_captured_longest_first_each_after_a_warmup_launched_for_it():
    log = []
    api = MeteredGraphAPI(log)

    def run_decode(bs, graph_len):
        log.append((bs, graph_len, current_warmup_kernel_type(), api.capturing))
        if api.capturing:
            api.used += graph_len * MIB // 16  # a longer bucket's graph holds more
        return torch.full((bs,), float(graph_len))

    ticks = iter([10.0, 11.0, 11.0, 13.5])
    graphs = DecodeGraphs([4, 1], [64, 16], api).capture_all(run_decode, clock=lambda: next(ticks))
    forwards = [e for e in log if len(e) == 4]  # (bs, graph_len, scope, capturing)
    assert forwards == [(4, 64, DA, False), (4, 64, None, True), (1, 64, DA, False), (1, 64, None, True),
                        (4, 16, DA, False), (4, 16, None, True), (1, 16, DA, False), (1, 16, None, True)]  # fmt: skip
    assert api.pools == [None, "shared-pool", "shared-pool", "shared-pool"]  # one pool for every bucket
    assert graphs.costs == {64: (2, 1.0, 8 * MIB), 16: (2, 2.5, 2 * MIB)} and graphs.memory_bytes == 10 * MIB
    assert describe_costs(graphs.costs) == "<=16: 2 in 2.5 s, 2.0 MiB; <=64: 2 in 1.0 s, 8.0 MiB"
    assert torch.equal(graphs.replay((16, 1)), torch.full((1,), 16.0))


def test_every_bucket_s_graph_of_a_batch_size_returns_one_shared_output():
    """The shorter buckets' graphs copy their outputs (here a tensor and a tuple, as MTP's graphs return) into the
    longest bucket's as their last step: one output per batch size whatever the buckets, each written by the graph
    that replays."""
    for tupled in (False, True):

        def run_decode(bs, graph_len):
            out = torch.full((bs, 3), float(graph_len))
            return (out, out[:, :1] + 1) if tupled else out

        graphs = DecodeGraphs([1, 2], [16, 64, 256], FakeGraphAPI([])).capture_all(run_decode)
        for bs in (1, 2):
            outs = [graphs.graphs[(n, bs)][1] for n in (16, 64, 256)]
            top = outs[-1][0] if tupled else outs[-1]
            assert all((o[0] if tupled else o) is top for o in outs)  # the very tensor, not an equal one
            assert torch.equal(top, torch.full((bs, 3), 16.0))  # the last capture (the 16 bucket) wrote it
    says = "TypeError: decode graph outputs expected a tensor or a tuple of tensors, like the longest bucket's " \
           "Tensor, got list"  # fmt: skip
    with pytest.raises(RuntimeError, match=re.escape(says)):
        DecodeGraphs([1], [16, 64], FakeGraphAPI([])).capture_all(
            lambda bs, n: torch.zeros(bs) if n == 64 else [torch.zeros(bs)]
        )


def test_pick_takes_the_smallest_bucket_then_the_smallest_batch_and_falls_back_to_eager():
    graphs = DecodeGraphs([1, 4], [16, 64], FakeGraphAPI([])).capture_all(lambda bs, n: torch.zeros(bs))
    picks = {(b, n): graphs.pick(b, n) for b, n in [(1, 1), (2, 16), (4, 17), (1, 64), (3, 40)]}
    assert picks == {(1, 1): (16, 1), (2, 16): (16, 4), (4, 17): (64, 4), (1, 64): (64, 1), (3, 40): (64, 4)}
    assert graphs.pick(5, 1) is None and graphs.pick(1, 65) is None  # past the largest batch, the longest bucket


# ---- the flag ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, got",
    [([-1], "-1 in [-1]"), ([0, 4096], "0 in [0, 4096]"), ([1024, 1024], "duplicates in [1024, 1024]"),
     (["4k"], "'4k' in ['4k']"), ([True], "True in [True]"), ("4096", "'4096'")],
    ids=["negative", "zero-beside-others", "duplicate", "string", "bool", "not-a-list"],
)  # fmt: skip
def test_bad_buckets_name_the_flag_and_what_is_allowed(value, got):
    allowed = "distinct positive integers (KV lengths), or none / a lone 0 for one bucket per batch size"
    with pytest.raises(ValueError, match=f"^{re.escape(f'--graph_len_buckets expected {allowed}, got {got}')}$"):
        EngineArgs(graph_len_buckets=value, device="cpu").normalize()


@pytest.mark.parametrize("value", [(), [], [0], 0], ids=["empty-tuple", "empty-list", "lone-zero", "zero"])
def test_no_bucket_is_one_graph_per_batch_size(value):
    args = EngineArgs(graph_len_buckets=value, graph_max_len_in_batch=4096, max_req_total_len=8192, device="cpu")
    assert args.normalize().fit_to_model(8192, 128).graph_lens() == [4096]


def test_buckets_not_below_the_graph_maximum_are_dropped_with_one_line(caplog):
    args = EngineArgs(graph_len_buckets=[8192, 1024, 4096], graph_max_len_in_batch=4096, max_req_total_len=8192,
                      device="cpu").normalize()  # fmt: skip
    assert args.graph_len_buckets == (1024, 4096, 8192)
    assert EngineArgs(device="cpu").normalize().graph_len_buckets == ()  # the default: one bucket
    with caplog.at_level(logging.INFO, logger="lightllm.engine.args"):
        args.fit_to_model(8192, 128)
        args.fit_to_model(8192, 128)  # the runner fits again after the server: nothing more to drop
    assert args.graph_lens() == [1024, 4096]
    notes = [r.getMessage() for r in caplog.records if "graph_len_buckets" in r.getMessage()]
    assert notes == ["graph_len_buckets: 4096, 8192 dropped, not below --graph_max_len_in_batch 4096 (its own bucket)"]
    caplog.clear()  # the default past a short graph maximum is simply one bucket, quietly
    with caplog.at_level(logging.INFO, logger="lightllm.engine.args"):
        short = EngineArgs(max_req_total_len=2048, device="cpu").normalize().fit_to_model(8192, 128)
    assert short.graph_lens() == [2048] and not [r for r in caplog.records if "graph_len_buckets" in r.getMessage()]


def test_mtp_buckets_hold_a_verify_step():
    with pytest.raises(ValueError, match=r"^--graph_len_buckets expected lengths of at least 4 with --mtp_step 3 "
                                         r"\(a verify step's tokens\), got 2$"):  # fmt: skip
        EngineArgs(mtp_mode="eagle_with_att", mtp_step=3, graph_len_buckets=[2, 64], device="cpu").normalize()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2, seed=5))


def test_server_flag_takes_a_list_and_alone_means_one_bucket(tiny_dir, capsys):
    base = ["--model_dir", tiny_dir, "--device", "cpu", "--max_req_total_len", "128"]
    assert parse_args(base + ["--graph_len_buckets", "64", "16"])[1].graph_lens() == [16, 64, 128]
    assert parse_args(base + ["--graph_len_buckets"])[1].graph_lens() == [128]
    assert parse_args(base)[1].graph_len_buckets == ()  # the default: one bucket
    for bad, says in ((["4k"], "argument --graph_len_buckets: invalid int value: '4k'"),
                      (["16", "0"], "--graph_len_buckets expected distinct positive integers")):  # fmt: skip
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            parse_args(base + ["--graph_len_buckets", *bad])
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.count("\n") == 1 and says in err, err


# ---- the runner ------------------------------------------------------------------------------------------------


class BucketReplayAPI:
    """CPU stand-in for CUDA graphs: a replay re-runs the captured decode forward over the runner's static buffers,
    launched for the graph's bucket, and writes the captured output. A replay whose live batch holds a request
    longer than the graph's bucket fails: a real graph's kernels would skip the keys past it."""

    def __init__(self):
        self.runner, self.replayed = None, []

    def new_graph(self):
        return {}

    def capture(self, graph, pool):
        return contextlib.nullcontext()

    def pool(self, graph):
        return "pool"

    def memory_used(self):
        return 0

    def replay(self, graph):
        r = self.runner
        (graph_len, bs), (_, out) = next((k, v) for k, v in r.graphs.graphs.items() if v[0] is graph)
        longest = int(r._buf["b_seq_len"][:bs].max())
        assert longest <= graph_len, f"a {longest}-token request replayed the <= {graph_len} graph"
        self.replayed.append((graph_len, bs))
        out.copy_(r._graph_decode(bs, graph_len))


def test_bucketed_graphs_give_the_eager_tokens(tiny_dir, monkeypatch, caplog):
    """Graphs of 1, 2, 4 rows for KV lengths up to 16 and up to 40: each warm-up forward launched for its bucket in
    the decode-attention scope; steps cross from the short bucket into the long one and then run eagerly (past 40),
    and the tokens are those of a runner without graphs."""
    launches, ladders = [], {}
    real = Qwen3Model.forward

    def forward(self, input_ids, state):
        if not state.is_prefill and current_warmup_kernel_type() is DA:
            n = state.launch_max_len
            launches.append((state.batch_size, n))
            ladders[n] = (decode_attn_autotune_seq_lens(n), decode_attn_run_key_lens(n))
        return real(self, input_ids, state)

    monkeypatch.setattr(Qwen3Model, "forward", forward)
    opts = dict(
        model_dir=tiny_dir,
        data_type="fp32",
        device="cpu",
        batch_max_tokens=64,
        max_req_total_len=64,
        running_max_req_size=4,
        graph_max_batch_size=4,
        graph_split_batch_size=2,
        graph_grow_step_size=2,
    )
    prompts = [[5, 17, 42], list(range(100, 111)), [20, 21]]
    params = {i: SamplingParams(max_new_tokens=n, ignore_eos=True) for i, n in enumerate((40, 8, 20))}
    want, _ = run_all(Engine(ModelRunner(EngineArgs(**opts, disable_cudagraph=True)), eos_ids=[]), prompts,
                      params=params)  # fmt: skip
    api = BucketReplayAPI()
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        runner = ModelRunner(EngineArgs(**opts, graph_max_len_in_batch=40, graph_len_buckets=[16]), graph_api=api)
    api.runner = runner
    assert launches == [(4, 40), (2, 40), (1, 40), (4, 16), (2, 16), (1, 16)]
    # the <= 40 graph tunes on, and keys by, the lengths it serves (above 16); the <= 16 one on its own ladder
    assert ladders == {40: ([40, 25, 16], (512, 16)), 16: ([16], (512,))}
    assert "decode attention tunes at 16; 40 down to 16 (from" in caplog.text
    assert served_floor(64) == 40  # an eager launch past the graphs: the longest graph below it
    ModelRunner(EngineArgs(**opts, graph_max_len_in_batch=40), graph_api=BucketReplayAPI())  # one bucket
    assert served_floor(64) == 0  # declares none: ladders and run keys as without graphs
    got, _ = run_all(Engine(runner, eos_ids=[]), prompts, params=params)
    assert got == want
    assert {n for n, _ in api.replayed} == {16, 40} and {bs for _, bs in api.replayed} >= {1, 4}
    assert sorted(runner.decode_graph_costs) == [16, 40]
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:"))
    assert ready.startswith("ready: 6 decode graphs (0.0 MiB; per KV length bucket <=16: 3 in ")
    assert ", 0.0 MiB; <=40: 3 in " in ready
