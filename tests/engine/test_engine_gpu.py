"""Engine start-up and CUDA-graph decode on the GPU (tiny model): ordering, phases, reuse, exact replay."""

import pytest
import torch

from lightllm.common.autotuner import current_warmup_kernel_type, tuner
from lightllm.common.cuda_graph import TorchGraphAPI
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.tools.make_tiny_model import BUILTIN_SHAPE, QWEN3_5_GPU_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # the built-in model's shape: head_dim 64, the smallest the decode kernels take
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=1, **BUILTIN_SHAPE))


def engine_args(model_dir, **kw):
    base = dict(model_dir=model_dir, data_type="bf16", running_max_req_size=4, max_req_total_len=1024,
                batch_max_tokens=256, graph_max_batch_size=4, graph_split_batch_size=2, graph_grow_step_size=2,
                graph_max_len_in_batch=1024, max_total_token_num=8192)  # fmt: skip
    return EngineArgs(**{**base, **kw})


class LoggingGraphAPI(TorchGraphAPI):
    def __init__(self, log):
        self.log = log

    def capture(self, graph, pool):
        self.log.append(("capture", current_warmup_kernel_type()))
        return super().capture(graph, pool)


def test_startup_order_phases_and_reuse(tiny_dir, monkeypatch):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "2048")
    log, searches = [], []
    real_search = tuner.Autotuner._search

    def spy(self, *args, **kwargs):
        searches.append((self.kernel_name, self.kernel_type, current_warmup_kernel_type()))
        return real_search(self, *args, **kwargs)

    monkeypatch.setattr(tuner.Autotuner, "_search", spy)
    real_graph_decode = ModelRunner._graph_decode

    def graph_decode(self, bs, graph_len):
        log.append(("forward", bs, current_warmup_kernel_type()))
        return real_graph_decode(self, bs, graph_len)

    monkeypatch.setattr(ModelRunner, "_graph_decode", graph_decode)
    ModelRunner(engine_args(tiny_dir), graph_api=LoggingGraphAPI(log))
    sizes = [e[1] for e in log if e[0] == "forward"][::2]
    assert sizes == [4, 2, 1]
    decode, prefill = log[:9], log[9:]
    for i in range(0, len(decode), 3):  # per size: eager forward in the decode scope, capture, captured forward
        assert log[i][0] == "forward" and log[i][2] is not None and log[i][2].name == "DECODE_ATTENTION"
        assert log[i + 1] == ("capture", None) and log[i + 2][2] is None
    assert prefill == [("capture", None)] * 10  # then prefill graphs, buckets 16..256 with and without a prefix
    assert searches, "level 1 from an empty config dir must search"
    for name, kind, phase in searches:
        assert kind is phase, f"{name} ({kind.name}) searched in the {phase} scope"
    general = {"rmsnorm", "add_rmsnorm", "qk_norm_rope", "silu_mul", "context_attention"}
    assert {n for n, _, _ in searches} >= general | {"gqa_flash_decode"}

    searches.clear()  # a second start over the same config dir searches nothing
    log.clear()
    tuner.clear_all_caches()  # as a new process would: only the files remain
    ModelRunner(engine_args(tiny_dir), graph_api=LoggingGraphAPI(log))
    assert searches == []


def test_graph_replay_equals_eager_decode(tiny_dir):
    runner = ModelRunner(engine_args(tiny_dir))
    slots = [runner.kv.add_request() for _ in range(3)]
    runner.prefill(slots, [[5, 6, 7], list(range(40)), [9] * 300])
    replayed = runner.decode(slots, [11, 12, 13]).clone()  # pads to the size-4 graph
    assert runner.graphs.pick(3, 301) == (1024, 4)  # one KV length bucket (4096 is past the graphs' 1024)
    eager = runner._graph_decode(4, 1024)[:3]  # the captured function, run eagerly on the same buffers
    assert torch.equal(replayed, eager)
    assert replayed.isfinite().all()


def test_each_length_bucket_replays_what_its_captured_forward_computes(tiny_dir):
    """Graphs up to 64 and up to 1024 KV tokens (--graph_len_buckets 64): a short batch replays the 64 bucket, one
    with a 301-token request the 1024 one, each equal to its captured function run eagerly on the same buffers."""
    runner = ModelRunner(engine_args(tiny_dir, graph_len_buckets=[64]))
    assert sorted(runner.decode_graph_costs) == [64, 1024]
    for longest, key in ((40, (64, 4)), (300, (1024, 4))):
        prompts = [[5, 6, 7], [9] * longest, [8] * 10]
        slots = [runner.add_request() for _ in prompts]
        runner.prefill(slots, prompts)
        replayed = runner.decode(slots, [11, 12, 13]).clone()
        assert runner.graphs.pick(3, longest + 1) == key
        eager = runner._graph_decode(key[1], key[0])[:3]
        assert torch.equal(replayed, eager) and replayed.isfinite().all()
        for slot in slots:
            runner.free(slot)


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5"), seed=2, **QWEN3_5_GPU_SHAPE))


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_pdl_launches_replay_what_they_capture_and_compute_what_plain_launches_do(family, request):
    """Programmatic dependent launch (kernels/pdl.py) through start-up, capture and replay: two graph decode steps
    give the logits of an engine without PDL bit for bit (the same kernels, waiting for each other in the kernel
    instead of on the launch). Qwen3.5 adds its gated DeltaNet chain (conv, delta rule, gated norm: state updated in
    place, so a kernel starting early would change the second step) and the attention output gate."""
    from lightllm.kernels import direct_launch

    tiny_dir = request.getfixturevalue("tiny_dir" if family == "qwen3" else "tiny_qwen3_5_dir")
    prompts, steps = [[5, 6, 7], list(range(40)), [9] * 300], [[11, 12, 13], [14, 15, 16]]

    def two_steps():
        runner = ModelRunner(engine_args(tiny_dir))
        slots = [runner.kv.add_request() for _ in prompts]
        runner.prefill(slots, prompts)
        return runner, [runner.decode(slots, tokens).clone() for tokens in steps]

    expected = two_steps()[1]  # its runner is freed before the next one starts
    previous = direct_launch.set_pdl(True)
    try:
        runner, logits = two_steps()
        if family == "qwen3":  # a replay of the same inputs rewrites the same KV: it must give the same logits
            assert torch.equal(runner._graph_decode(4, 1024)[:3], logits[-1])
    finally:
        direct_launch.set_pdl(previous)
    for got, want in zip(logits, expected):
        assert torch.equal(got, want) and got.isfinite().all()
