"""Prefill CUDA graphs: bucket choice, the padded static inputs, scratch-slot KV writes and start-up order, on the CPU
through the runner's own graph path with an eager stand-in for the replay; on a GPU, real graphs against eager."""

import contextlib
import logging

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, current_warmup_kernel_type
from lightllm.common.kv_cache.sizing import GpuProfile, describe_gpu_sizing, gpu_kv_bytes
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner, _prefill_graphs_estimate
from lightllm.engine.prefill_graphs import PrefillStaging, bucket_for, prefill_buckets
from lightllm.models.qwen3.model import Qwen3Model
from lightllm.server.args import parse_args
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, QWEN3_5_GPU_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5

LENGTHS = (1, 7, 100, 128, 300)


# ---- buckets and flag -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_tokens, buckets",
    [(512, [16, 32, 64, 128, 256, 512]), (100, [16, 32, 64, 100]), (16, [16]), (8, [8]), (0, [])],
    ids=["512", "not-a-power-of-two", "16", "below-16", "off"],
)
def test_buckets_double_from_16_and_end_at_the_maximum(max_tokens, buckets):
    assert prefill_buckets(max_tokens) == buckets


def test_bucket_for_is_the_smallest_that_holds_the_tokens():
    buckets = prefill_buckets(100)
    picks = {n: bucket_for(buckets, n) for n in (1, 15, 16, 17, 64, 65, 100)}
    assert picks == {1: 16, 15: 16, 16: 16, 17: 32, 64: 64, 65: 100, 100: 100}
    assert bucket_for(buckets, 101) is None and bucket_for(buckets, 0) is None and bucket_for([], 1) is None
    with pytest.raises(ValueError, match=r"max_tokens expected a non-negative integer, got -1"):
        prefill_buckets(-1)


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, r"a non-negative integer \(0 turns prefill graphs off\), got -1"),
        (1.5, r"an integer, got 1.5 \(float\)"),  # the type check of every option comes first
        (True, r"an integer, got True \(bool\)"),
    ],
)
def test_bad_prefill_graph_max_tokens_names_the_flag(value, message):
    with pytest.raises(ValueError, match=rf"^--prefill_graph_max_tokens expected {message}$"):
        EngineArgs(prefill_graph_max_tokens=value, device="cpu").normalize()


def test_server_flag_reaches_the_engine_and_is_checked(tmp_path, capsys):
    model = str(make_tiny_qwen3(tmp_path / "m"))
    capsys.readouterr()  # the model maker's progress bar
    _, engine = parse_args(["--model_dir", model, "--device", "cpu", "--prefill_graph_max_tokens", "64"])
    assert engine.prefill_graph_max_tokens == 64
    assert EngineArgs().prefill_graph_max_tokens == 512
    with pytest.raises(SystemExit) as done:
        parse_args(["--model_dir", model, "--device", "cpu", "--prefill_graph_max_tokens", "-3"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "--prefill_graph_max_tokens expected" in err


# ---- the static inputs ----------------------------------------------------------------------------------------


def _views(staging):
    return {name: view.tolist() for name, view in staging.device_views.items()}


def test_staging_puts_the_request_first_and_padding_after():
    staging = PrefillStaging(6, torch.device("cpu"), pad_slot=5, pad_token=99)
    # before any request: the padding request, one new token, no prefix (what the captures run)
    assert _views(staging) == {"input_ids": [0] * 6, "positions": [0] * 6, "out_token_idx": [99] * 6,
                               "b_req_idx": [5], "b_seq_len": [1], "b_q_start": [0], "b_q_len": [1],
                               "b_prefix_len": [0], "state_idx": [5, 5, 5]}  # fmt: skip
    staging.stage(2, 3, [7, 8, 9, 10], torch.tensor([40, 41, 42, 43]))
    assert _views(staging) == {
        "input_ids": [7, 8, 9, 10, 0, 0],
        "positions": [3, 4, 5, 6, 0, 0],
        "out_token_idx": [40, 41, 42, 43, 99, 99],
        "b_req_idx": [2],
        "b_seq_len": [7],
        "b_q_start": [0],
        "b_q_len": [4],
        "b_prefix_len": [3],
        "state_idx": [2, 5, 5],
    }  # the request's linear-attention state, then the padding's (twice: linear_attention._padded_plan)
    staging.stage(1, 0, [11], [50])  # a shorter request: the rows the last one used are padding again
    assert _views(staging) == {"input_ids": [11, 0, 0, 0, 0, 0], "positions": [0] * 6,
                               "out_token_idx": [50, 99, 99, 99, 99, 99], "b_req_idx": [1], "b_seq_len": [1],
                               "b_q_start": [0], "b_q_len": [1], "b_prefix_len": [0],
                               "state_idx": [1, 5, 5]}  # fmt: skip
    for tokens, slots in (([], []), ([1] * 7, list(range(7))), ([1, 2], [3])):
        with pytest.raises(ValueError, match=r"PrefillStaging.stage: expected 1 to 6 new tokens and one KV slot"):
            staging.stage(0, 0, tokens, torch.tensor(slots))


def test_state_launches_for_the_bucket_and_reads_lengths_on_the_device():
    staging = PrefillStaging(8, torch.device("cpu"), pad_slot=3, pad_token=9)
    table = torch.zeros(4, 32, dtype=torch.int32)
    staging.stage(1, 5, [4, 4, 4], [20, 21, 22])
    ids, plain = staging.state(4, False, table, 32)
    assert ids.tolist() == [4, 4, 4, 0] and plain.out_token_idx.tolist() == [20, 21, 22, 9]
    assert (plain.max_q_len, plain.max_prefix_len, plain.batch_size) == (4, 0, 1)
    assert plain.b_q_len.tolist() == [3] and plain.req_to_token is table
    ids, prefixed = staging.state(8, True, table, 32)
    assert ids.shape == (8,) and prefixed.max_q_len == 8 and prefixed.max_prefix_len == 32
    assert prefixed.b_prefix_len.tolist() == [5] and prefixed.positions.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]


# ---- the runner, with an eager stand-in for graph replay -----------------------------------------------------


class EagerReplayAPI:
    """CPU stand-in for CUDA graphs: a replay re-runs the forward its graph captured, over the same static inputs,
    and writes the captured output tensor in place, as a CUDA graph replay does. Logs captures and replays."""

    def __init__(self, log=None):
        self.runner, self.log, self.replayed = None, log if log is not None else [], []

    def new_graph(self):
        return {}

    def capture(self, graph, pool):
        self.log.append(("capture", current_warmup_kernel_type()))
        return contextlib.nullcontext()

    def pool(self, graph):
        return "pool"

    def replay(self, graph):
        r = self.runner
        for key, (g, out) in r.prefill_graphs.graphs.graphs.items():
            if g is graph:
                self.replayed.append(key)
                out.copy_(r.prefill_graphs.run_key(key))
                return
        (graph_len, bs), (_, out) = next((k, v) for k, v in r.graphs.graphs.items() if v[0] is graph)
        out.copy_(r._graph_decode(bs, graph_len))

    def memory_used(self):
        return 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=3))


def cpu_args(model_dir, **kw):
    base = dict(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=512, max_req_total_len=512,
                running_max_req_size=3, graph_max_batch_size=2, graph_split_batch_size=2)  # fmt: skip
    return EngineArgs(**{**base, **kw})


def graph_runner(model_dir, log=None, memory_api=None, **kw):
    api = EagerReplayAPI(log)
    runner = ModelRunner(cpu_args(model_dir, **kw), graph_api=api, memory_api=memory_api)
    api.runner = runner
    return runner, api


def _prompt(n, seed):
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv_rows(runner, slot):
    idx = runner.kv.table[slot, : runner.kv.seq_len(slot)].long()
    return torch.stack([runner.attn.pool.k[:, idx], runner.attn.pool.v[:, idx]])


@pytest.fixture(scope="module")
def runners(tiny_dir):
    graphed, api = graph_runner(tiny_dir)
    return graphed, api, ModelRunner(cpu_args(tiny_dir, disable_cudagraph=True))


@pytest.mark.parametrize("prefix_len", [0, 40], ids=["fresh", "chunk-after-40"])
@pytest.mark.parametrize("n", LENGTHS)
def test_graph_prefill_equals_eager_and_writes_only_its_own_kv_and_the_scratch_token(runners, n, prefix_len):
    graphed, api, eager = runners
    assert graphed.prefill_graphs.buckets == [16, 32, 64, 128, 256, 512] and graphed.prefill_graphs.prefixed
    assert eager.prefill_graphs is None
    other_prompt, first, prompt = _prompt(50, 1), _prompt(prefix_len, 2), _prompt(n, 3)
    out = {}
    for runner in (graphed, eager):
        other = runner.add_request()  # another request's KV, which the padded prefill must leave alone
        runner.prefill([other], [other_prompt])
        slot = runner.add_request()
        if prefix_len:  # the earlier chunk of a chunked prefill
            runner.prefill([slot], [first])
        for cache in (runner.attn.pool.k, runner.attn.pool.v):  # NaN: a write to the scratch token shows
            cache[:, runner.pad_token] = float("nan")
        pool_before = torch.stack([runner.attn.pool.k, runner.attn.pool.v]).clone()
        api.replayed.clear()
        logits = runner.prefill([slot], [prompt]).clone()
        pool_after = torch.stack([runner.attn.pool.k, runner.attn.pool.v])
        out[runner] = (logits, _kv_rows(runner, slot))
        if runner is graphed:
            assert api.replayed == [(bucket_for(graphed.prefill_graphs.buckets, n), prefix_len > 0)]
            differs = ~((pool_after == pool_before) | (pool_after.isnan() & pool_before.isnan()))
            changed = set(differs.flatten(0, 1).any(-1).any(-1).any(0).nonzero().flatten().tolist())
            new = set(runner.kv.table[slot, prefix_len : prefix_len + n].tolist())
            pads = {runner.pad_token} if n < api.replayed[0][0] else set()
            # only the request's new tokens and, with padding rows, the scratch token: the other request's are not
            assert changed == new | pads and not changed & set(runner.kv.table[other, :50].tolist())
        runner.free(slot)
        runner.free(other)
    (g_logits, g_kv), (e_logits, e_kv) = out[graphed], out[eager]
    assert g_logits.shape == e_logits.shape == (1, 512)
    torch.testing.assert_close(g_logits, e_logits, rtol=1e-5, atol=1e-5)
    assert g_logits.argmax() == e_logits.argmax()
    torch.testing.assert_close(g_kv, e_kv, rtol=1e-5, atol=1e-5)


def test_prefix_cache_hit_replays_the_prefixed_graph(runners):
    graphed, api, eager = runners
    prompt = _prompt(90, 5)
    got = {}
    for runner in (graphed, eager):
        first = runner.add_request()
        runner.prefill([first], [prompt[:60]])
        runner.free(first)  # its KV goes to the prefix cache
        assert runner.kv.match_prefix(prompt[:60])[0] == 60
        slot = runner.add_request(prompt[:60])
        api.replayed.clear()
        got[runner] = runner.prefill([slot], [prompt[60:]]).clone()
        runner.free(slot)
        runner.kv.prefix.clear()
        if runner is graphed:
            assert api.replayed == [(32, True)]
    torch.testing.assert_close(got[graphed], got[eager], rtol=1e-5, atol=1e-5)


def test_batches_and_long_prompts_run_eagerly(runners):
    graphed, api, _ = runners
    api.replayed.clear()
    slots = [graphed.add_request() for _ in range(2)]
    graphed.prefill(slots, [_prompt(5, 1), _prompt(6, 2)])  # two requests: no graph
    graphed.free(slots[1])
    graphed.prefill([slots[0]], [_prompt(500, 3)])  # 505 tokens: fits the 512 bucket, prefixed
    graphed.free(slots[0])
    long = graphed.add_request()
    with pytest.raises(ValueError, match="n expected <= 512"):  # the request limit is the KV manager's, as before
        graphed.prefill([long], [_prompt(513, 4)])
    graphed.free(long)
    assert api.replayed == [(512, True)]


def test_quantized_pool_graphs_only_prefix_free_prefills(tiny_dir):
    runner, api = graph_runner(tiny_dir, llm_kv_type="int8kv", prefill_graph_max_tokens=64)
    eager = ModelRunner(cpu_args(tiny_dir, llm_kv_type="int8kv", disable_cudagraph=True))
    assert runner.prefill_graphs.buckets == [16, 32, 64] and not runner.prefill_graphs.prefixed
    got = {}
    for r in (runner, eager):
        slot = r.add_request()
        got[r] = [r.prefill([slot], [_prompt(20, 1)]).clone(), r.prefill([slot], [_prompt(9, 2)]).clone()]
        r.free(slot)
    assert api.replayed == [(32, False)]  # the continuation (a prefix) ran eagerly
    for a, b in zip(got[runner], got[eager]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_cpu_start_without_graphs_warms_up_with_one_small_prefill(tiny_dir, monkeypatch):
    """On the CPU the torch references run: nothing compiles or tunes, so the GENERAL warm-up is one prefill at the
    smallest size (the forward runs before the first request), not the ladder up to a step's tokens."""
    log = []
    real = Qwen3Model.forward

    def forward(self, input_ids, state):
        log.append((state.is_prefill, input_ids.shape[0], current_warmup_kernel_type()))
        return real(self, input_ids, state)

    monkeypatch.setattr(Qwen3Model, "forward", forward)
    ModelRunner(cpu_args(tiny_dir, disable_cudagraph=True, batch_max_tokens=64))
    assert [n for prefill, n, kind in log if prefill and kind is AutotuneKernelType.GENERAL] == [16]


def test_startup_captures_after_the_decode_graphs_each_after_an_eager_forward(tiny_dir, caplog, monkeypatch):
    log = []
    real = Qwen3Model.forward

    def forward(self, input_ids, state):
        log.append(("prefill" if state.is_prefill else "decode", input_ids.shape[0], current_warmup_kernel_type()))
        return real(self, input_ids, state)

    monkeypatch.setattr(Qwen3Model, "forward", forward)
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        runner, _ = graph_runner(tiny_dir, log, prefill_graph_max_tokens=24, batch_max_tokens=64)
    warmup = [e[1] for e in log if e[0] == "prefill" and e[2] is AutotuneKernelType.GENERAL]
    assert warmup == [16, 24, 32, 64]  # the bucket 24 is a warm-up length too, so its keys are tuned before capture
    decode_end = max(i for i, e in enumerate(log) if e[0] == "decode")
    assert log[decode_end - 5 : decode_end + 1] == [("decode", 2, AutotuneKernelType.DECODE_ATTENTION),
                                                    ("capture", None), ("decode", 2, None),
                                                    ("decode", 1, AutotuneKernelType.DECODE_ATTENTION),
                                                    ("capture", None), ("decode", 1, None)]  # fmt: skip
    # largest first, cached-prefix graph before the plain one; outside any tuning scope, one eager forward first
    assert log[decode_end + 1 :] == [("prefill", 24, None), ("capture", None), ("prefill", 24, None)] * 2 + [
        ("prefill", 16, None), ("capture", None), ("prefill", 16, None)] * 2  # fmt: skip
    assert sorted(runner.prefill_graphs.graphs.graphs) == [(16, False), (16, True), (24, False), (24, True)]
    assert "prefill graphs" in runner.startup_seconds
    messages = [r.getMessage() for r in caplog.records]
    line = next(m for m in messages if m.startswith("prefill graphs: "))
    assert line.startswith("prefill graphs: 4 captured (buckets 16, 24 tokens, with and without a cached prefix) in ")
    assert line.endswith(" s, 0.0 MiB in the decode graphs' pool")
    ready = next(m for m in messages if m.startswith("ready:"))
    assert ready.startswith("ready: 2 decode graphs (0.0 MiB), 4 prefill graphs (0.0 MiB), ")


def test_failed_warmup_forward_names_the_bucket_and_the_flag(tiny_dir, monkeypatch):
    real = Qwen3Model.forward

    def forward(self, input_ids, state):
        if state.is_prefill and input_ids.shape[0] == 16 and current_warmup_kernel_type() is None:
            raise RuntimeError("out of memory")
        return real(self, input_ids, state)

    monkeypatch.setattr(Qwen3Model, "forward", forward)
    with pytest.raises(RuntimeError, match=r"^prefill warmup forward before capturing the 16-token prefixed graph "
                       r"failed \(RuntimeError: out of memory\); nothing was captured for it. Fix the cause or start "
                       r"with --prefill_graph_max_tokens 0$"):  # fmt: skip
        graph_runner(tiny_dir, prefill_graph_max_tokens=16)


@pytest.mark.parametrize("opts", [dict(prefill_graph_max_tokens=0), dict(disable_cudagraph=True)], ids=["0", "off"])
def test_no_prefill_graphs_when_turned_off(tiny_dir, opts):
    runner, _ = graph_runner(tiny_dir, **opts)
    assert runner.prefill_graphs is None


# ---- Qwen3.5: the padding rows are a sequence of their own for linear attention ---------------------------


@pytest.fixture(scope="module")
def qwen3_5_runners(tmp_path_factory):
    """Buckets of the token-by-token kernel alone (CHUNKED_GRAPH_MAX_TOKENS 0, read when the graphs are made)."""
    from lightllm.layers import linear_attention

    model = str(make_tiny_qwen3_5(tmp_path_factory.mktemp("q35"), seed=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_attention, "CHUNKED_GRAPH_MAX_TOKENS", 0)
        graphed, api = graph_runner(model)
    return graphed, api, ModelRunner(cpu_args(model, disable_cudagraph=True))


@pytest.mark.parametrize("prefix_len", [0, 40], ids=["fresh", "chunk-after-40"])
@pytest.mark.parametrize("n", [1, 7, 16, 50, 64])
def test_qwen3_5_graph_prefill_equals_eager_and_leaves_other_states_alone(qwen3_5_runners, n, prefix_len):
    """Without chunked graphs the buckets stop at RECURRENT_MAX_TOKENS; the replay gives eager's logits, and the
    request's conv and recurrent states after it are eager's (the padding rows did not advance them); another
    request's states are untouched."""
    graphed, api, eager = qwen3_5_runners
    assert graphed.prefill_graphs.buckets == [16, 32, 64] and graphed.prefill_graphs.prefixed
    other_prompt, first, prompt = _prompt(30, 1), _prompt(prefix_len, 2), _prompt(n, 3)
    out = {}
    for runner in (graphed, eager):
        state = runner.model.linear.state
        other = runner.add_request()
        runner.prefill([other], [other_prompt])
        other_before = (state.conv[:, other].clone(), state.ssm[:, other].clone())
        slot = runner.add_request()
        if prefix_len:
            runner.prefill([slot], [first])
        api.replayed.clear()
        logits = runner.prefill([slot], [prompt]).clone()
        out[runner] = (logits, state.conv[:, slot].clone(), state.ssm[:, slot].clone(), _kv_rows(runner, slot))
        if runner is graphed:
            assert api.replayed == [(bucket_for(graphed.prefill_graphs.buckets, n), prefix_len > 0)]
        assert torch.equal(state.conv[:, other], other_before[0]) and torch.equal(state.ssm[:, other], other_before[1])
        runner.free(slot)
        runner.free(other)
    for g, e in zip(out[graphed], out[eager]):
        assert g.abs().sum() > 0  # written: a fresh state or logits of zeros would pass by accident
        # fp32 GEMMs over 16 padded rows sum in another order than over 7 (the CPU's BLAS picks its kernels by shape
        # and instruction set): up to 1.2e-5 apart on logits of about 5 on an AVX-512 machine; a padding row leaking
        # into the request moves them by far more
        torch.testing.assert_close(g, e, rtol=1e-5, atol=5e-5)


def test_qwen3_5_longer_prefills_and_a_prefix_cache_hit(qwen3_5_runners):
    """Past the last bucket the prefill runs eagerly; a prefix-cache hit (its state from a checkpoint) replays the
    prefixed graph and gives eager's logits and greedy continuation."""
    graphed, api, eager = qwen3_5_runners
    prompt = _prompt(100, 7)
    got = {}
    for runner in (graphed, eager):
        api.replayed.clear()
        first = runner.add_request()
        runner.prefill([first], [prompt[:65]])  # 65 tokens: above the 64 bucket, eager
        runner.free(first)
        assert runner.kv.match_prefix(prompt[:65])[0] == 65
        slot = runner.add_request(prompt[:65])
        logits = [runner.prefill([slot], [prompt[65:]]).clone()]
        for _ in range(3):
            logits.append(runner.decode([slot], [int(logits[-1].argmax())]).clone())
        got[runner] = logits
        runner.free(slot)
        runner.kv.prefix.clear()
        if runner is graphed:
            assert api.replayed == [(64, True)]
    for g, e in zip(got[graphed], got[eager]):  # float32 rounding: the padded and unpadded orders of summation
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert g.argmax() == e.argmax()


@pytest.mark.parametrize("prefix_len", [0, 40], ids=["fresh", "chunk-after-40"])
def test_qwen3_5_chunked_graph_buckets_equal_eager(tmp_path, prefix_len):
    """By default (CHUNKED_GRAPH_MAX_TOKENS 512) the buckets reach 512 (fla's chunked kernels past 64 on a GPU;
    here the references through the same padded plan, three sequences): 65 to 128 new tokens replay the 128 graph,
    and 300 the 512 one, and give eager's logits and states."""
    model = str(make_tiny_qwen3_5(tmp_path / "q35", seed=0))
    graphed, api = graph_runner(model)
    eager = ModelRunner(cpu_args(model, disable_cudagraph=True))
    assert graphed.prefill_graphs.buckets == [16, 32, 64, 128, 256, 512]
    for n in (65, 100, 128, 300):
        out = {}
        for runner in (graphed, eager):
            state = runner.model.linear.state
            slot = runner.add_request()
            if prefix_len:
                runner.prefill([slot], [_prompt(prefix_len, 2)])
            api.replayed.clear()
            logits = runner.prefill([slot], [_prompt(n, 3)]).clone()
            out[runner] = (logits, state.conv[:, slot].clone(), state.ssm[:, slot].clone())
            if runner is graphed:
                assert api.replayed == [(bucket_for(graphed.prefill_graphs.buckets, n), prefix_len > 0)]
            runner.free(slot)
            runner.kv.prefix.clear()
        for g, e in zip(out[graphed], out[eager]):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_qwen3_5_opts_out_without_the_token_by_token_path(tmp_path, caplog, monkeypatch):
    from lightllm.layers import linear_attention

    monkeypatch.setattr(linear_attention, "RECURRENT_MAX_TOKENS", 0)
    monkeypatch.setattr(linear_attention, "CHUNKED_GRAPH_MAX_TOKENS", 0)
    model = str(make_tiny_qwen3_5(tmp_path / "q35", seed=0))
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        runner, _ = graph_runner(model, batch_max_tokens=32, max_req_total_len=32)
    assert runner.prefill_graphs is None and runner.graphs is not None
    assert (
        "prefill graphs off: the model's linear attention: RECURRENT_MAX_TOKENS and CHUNKED_GRAPH_MAX_TOKENS "
        "are 0 (no kernel of its prefill runs from bounds on the device)"
    ) in [r.getMessage() for r in caplog.records]


# ---- memory ---------------------------------------------------------------------------------------------------


def test_prefill_graph_memory_is_counted_before_the_kv_pool():
    # a 4096-token profiled prefill peaking at 8 MiB: the 512-token graph about 1 MiB, plus 12 logits rows
    estimate = _prefill_graphs_estimate(8 * 2**20, 4096, prefill_buckets(512), vocab=1000)
    assert estimate == 2**20 + 12 * 1000 * 4 and _prefill_graphs_estimate(8 * 2**20, 4096, [], 1000) == 0
    p = GpuProfile(total=16 * 2**30, used=4 * 2**30, torch_allocated=3 * 2**30, activation_peak=2**30,
                   graph_estimate=2**30, prefill_graph_estimate=2**30)  # fmt: skip
    assert gpu_kv_bytes(p, 0.75) == (12 - 4 - 1 - 1 - 1) * 2**30
    assert ", decode graphs (estimate) 1.00 GiB, prefill graphs (estimate) 1.00 GiB = KV 5.00 GiB;" in (
        describe_gpu_sizing(p, 0.75, 512, 1)
    )


class FakeDeviceMemory:
    """A device whose profiling forwards peak at the given bytes (prefill, then decode) above a fixed base."""

    profiles = True

    def __init__(self, total, used, peaks):
        self.total, self.used, self.peaks = total, used, list(peaks)

    def allocated(self):
        return 0

    def reset_peak(self):
        pass

    def peak_allocated(self):
        return self.peaks.pop(0)

    def used_and_total(self):
        return self.used, self.total


def test_gpu_sizing_keeps_room_for_the_prefill_graphs(tiny_dir, caplog):
    """The profiled 512-token prefill peaks at 64 MiB: the graphs of buckets up to 128 tokens take a quarter of that
    plus their logits rows (8 graphs x 512 vocab x 4 B) out of the KV cache's share."""
    mib, tokens = 2**20, {}
    for max_tokens in (0, 128):
        mem = FakeDeviceMemory(total=1024 * mib, used=256 * mib, peaks=[64 * mib, 8 * mib])
        with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
            runner, _ = graph_runner(tiny_dir, memory_api=mem, prefill_graph_max_tokens=max_tokens, mem_fraction=0.75)
        tokens[max_tokens] = runner.kv.num_tokens
    assert tokens[0] - tokens[128] == (16 * mib + 8 * 512 * 4) // 512
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache sizing:")]
    assert "prefill graphs" not in lines[0] and ", prefill graphs (estimate) 0.02 GiB = KV " in lines[1]


# ---- GPU ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("gpu-tiny"), seed=1, **BUILTIN_SHAPE))


def _gpu_runner(model_dir, **kw):
    base = dict(model_dir=model_dir, data_type="bf16", running_max_req_size=4, max_req_total_len=1024,
                batch_max_tokens=512, graph_max_batch_size=4, graph_split_batch_size=2, graph_grow_step_size=2,
                max_total_token_num=8192)  # fmt: skip
    return ModelRunner(EngineArgs(**{**base, **kw}))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_type", ["None", "int8kv"])
def test_gpu_prefill_graphs_equal_eager(gpu_dir, kv_type):
    """Per prompt length, with and without a cached prefix (an earlier chunk): the replay equals the captured
    forward run eagerly over the same static inputs bit for bit (same kernels, same configs) and the unpadded eager
    prefill up to bf16 rounding (other GEMM shapes); the greedy token is the eager one up to that rounding; the
    request's KV matches eager and every other request's KV is untouched."""
    runner = _gpu_runner(gpu_dir, llm_kv_type=kv_type)
    graphs = runner.prefill_graphs
    assert graphs.buckets == [16, 32, 64, 128, 256, 512] and graphs.prefixed == (kv_type == "None")
    other = runner.add_request()
    runner.prefill([other], [_prompt(333, 9)])
    other_kv = _kv_rows(runner, other).clone()
    for prefix_len in (0, 40):
        for n in LENGTHS:
            first, prompt = _prompt(prefix_len, n), _prompt(n, n + 1)
            results = []
            for use_graphs in (True, False):
                runner.prefill_graphs = graphs if use_graphs else None
                slot = runner.add_request()
                if prefix_len:
                    runner.prefill([slot], [first])
                logits = runner.prefill([slot], [prompt]).clone()
                results.append((logits, _kv_rows(runner, slot).clone()))
                if use_graphs:
                    key = graphs.pick(n, prefix_len)
                    assert key == ((bucket_for(graphs.buckets, n), prefix_len > 0) if graphs.prefixed or not prefix_len
                                   else None)  # fmt: skip
                    if key is not None:  # the captured forward, eagerly, on the same static inputs
                        assert torch.equal(logits, graphs.run_key(key).clone()), (n, prefix_len)
                runner.free(slot)
                runner.kv.prefix.clear()
            (g, g_kv), (e, e_kv) = results
            assert g.isfinite().all()
            torch.testing.assert_close(g, e, rtol=0.05, atol=0.05)
            assert e[0, g.argmax()] >= e.max() - 0.05, (n, prefix_len)  # the same greedy token, up to ties
            if kv_type == "None":
                torch.testing.assert_close(g_kv, e_kv, rtol=0.02, atol=0.02)
            else:
                assert (g_kv.float() - e_kv.float()).abs().max() <= 1  # int8: one quantization step at most
            assert torch.equal(_kv_rows(runner, other), other_kv), (n, prefix_len)


@pytest.fixture(scope="module")
def gpu_qwen3_5_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("gpu-q35"), seed=2, **QWEN3_5_GPU_SHAPE))


def _qwen3_5_graphs_equal_eager(runner, lengths):
    """Per prompt length, fresh and after an earlier chunk: the replay equals the captured forward run eagerly from
    the same states over the same static inputs bit for bit, logits and the request's conv and recurrent states;
    against the unpadded eager prefill up to bf16 rounding, with the same greedy token; another request's KV and
    states are untouched."""
    graphs, state = runner.prefill_graphs, runner.model.linear.state
    other = runner.add_request()
    runner.prefill([other], [_prompt(333, 9)])
    other_before = [t.clone() for t in (_kv_rows(runner, other), state.conv[:, other], state.ssm[:, other])]
    for prefix_len in (0, 40):
        for n in lengths:
            first, prompt = _prompt(prefix_len, n), _prompt(n, n + 1)
            results = []
            for use_graphs in (True, False):
                runner.prefill_graphs = graphs if use_graphs else None
                slot = runner.add_request()
                if prefix_len:
                    runner.prefill([slot], [first])
                before = state.conv[:, slot].clone(), state.ssm[:, slot].clone()
                logits = runner.prefill([slot], [prompt]).clone()
                after = state.conv[:, slot].clone(), state.ssm[:, slot].clone()
                results.append((logits, *after))
                if use_graphs:
                    key = graphs.pick(n, prefix_len)
                    assert key == (bucket_for(graphs.buckets, n), prefix_len > 0)
                    state.conv[:, slot], state.ssm[:, slot] = before  # the captured forward, from the same states
                    assert torch.equal(logits, graphs.run_key(key).clone()), (n, prefix_len)
                    assert torch.equal(state.conv[:, slot], after[0]) and torch.equal(state.ssm[:, slot], after[1])
                runner.free(slot)
                runner.kv.prefix.clear()
            (g, g_conv, g_ssm), (e, e_conv, e_ssm) = results
            assert g.isfinite().all() and g_ssm.abs().sum() > 0
            torch.testing.assert_close(g, e, rtol=0.05, atol=0.05)
            assert e[0, g.argmax()] >= e.max() - 0.05, (n, prefix_len)  # the same greedy token, up to ties
            torch.testing.assert_close(g_conv.float(), e_conv.float(), rtol=0.02, atol=0.02)
            torch.testing.assert_close(g_ssm.float(), e_ssm.float(), rtol=0.02, atol=0.02)
            now = (_kv_rows(runner, other), state.conv[:, other], state.ssm[:, other])
            assert all(torch.equal(a, b) for a, b in zip(now, other_before)), (n, prefix_len)
    runner.free(other)


@pytest.mark.gpu
def test_gpu_qwen3_5_prefill_graphs_equal_eager(gpu_qwen3_5_dir, monkeypatch):
    """Qwen3.5 (bf16), fla's token-by-token kernel for up to 64 tokens, alone (chunked graphs off): see
    ``_qwen3_5_graphs_equal_eager``."""
    from lightllm.layers import linear_attention

    monkeypatch.setattr(linear_attention, "CHUNKED_GRAPH_MAX_TOKENS", 0)
    runner = _gpu_runner(gpu_qwen3_5_dir)
    assert runner.prefill_graphs.buckets == [16, 32, 64] and runner.prefill_graphs.prefixed
    _qwen3_5_graphs_equal_eager(runner, (1, 7, 16, 50, 64))


@pytest.mark.gpu
def test_gpu_qwen3_5_chunked_prefill_graphs_equal_eager(gpu_qwen3_5_dir):
    """The default buckets past 64 (CHUNKED_GRAPH_MAX_TOKENS 512): fla-core's chunked kernels captured with chunk
    indices made on the device, buckets up to 512 (see ``_qwen3_5_graphs_equal_eager``)."""
    runner = _gpu_runner(gpu_qwen3_5_dir)
    assert runner.prefill_graphs.buckets == [16, 32, 64, 128, 256, 512] and runner.prefill_graphs.prefixed
    _qwen3_5_graphs_equal_eager(runner, (65, 128, 200, 256, 511, 512))
