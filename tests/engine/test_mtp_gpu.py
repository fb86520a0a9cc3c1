"""MTP on the GPU (bf16, the Triton kernels: diverse attention and the linear-attention verify kernels; FA3 where
it can run): greedy output equals MTP off, token for token, and the agreeing head is accepted."""

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import QWEN3_5_GPU_SHAPE, make_tiny_qwen3_5

from tests.engine.test_scheduler import run_all

pytestmark = pytest.mark.gpu

GEN = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(3, 400, (n,), generator=GEN).tolist() for n in (1, 6, 300, 13)]
PARAMS = {i: SamplingParams(max_new_tokens=n, ignore_eos=True) for i, n in enumerate((9, 24, 5, 17))}


@pytest.fixture(scope="module", params=["random", "agree"])
def model_dir(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(f"mtp-{request.param}")
    return str(make_tiny_qwen3_5(out, mtp=request.param, seed=7, dtype="bfloat16", **QWEN3_5_GPU_SHAPE))


def engine(model_dir, **opts):
    args = dict(model_dir=model_dir, data_type="bf16", batch_max_tokens=128, max_req_total_len=512,
                running_max_req_size=4, graph_max_batch_size=4, max_total_token_num=4096)  # fmt: skip
    return Engine(ModelRunner(EngineArgs(**{**args, **opts})), eos_ids=[])


@pytest.mark.parametrize("backend", ["triton", "auto"])  # auto: FA3 on a Hopper GPU with it installed
@pytest.mark.parametrize("step", [1, 3])
def test_greedy_bf16_is_the_same_with_mtp_off_and_on(model_dir, backend, step):
    want, _ = run_all(engine(model_dir, llm_decode_att_backend=backend), PROMPTS, params=PARAMS)
    for graphs in (True, False):  # MTP's verify and draft graphs, and eager
        on = engine(model_dir, llm_decode_att_backend=backend, mtp_mode="eagle_with_att", mtp_step=step,
                    disable_cudagraph=not graphs)  # fmt: skip
        assert (on.runner.mtp.graphs is not None) == graphs
        got, _ = run_all(on, PROMPTS, params=PARAMS)
        assert got == want, f"graphs {graphs}"


def test_graph_replay_equals_the_eager_verify(model_dir):
    """The verify graph of 4 requests replayed for 3 (one padding row) gives the eager verify's logits."""
    eng = engine(model_dir, mtp_mode="eagle_with_att", mtp_step=3, graph_split_batch_size=1, graph_grow_step_size=3)
    runner = eng.runner
    assert runner.mtp.graphs.verify.batch_sizes == [1, 4]
    slots = [runner.add_request() for _ in range(3)]
    lasts = [int(t) for t in runner.prefill(slots, [PROMPTS[1], PROMPTS[3], PROMPTS[0]]).argmax(-1)]
    drafts = runner.mtp.draft(slots, lasts, lambda k, logits: logits.argmax(-1))
    state = runner.model.linear.state
    before = [state.conv.clone(), state.ssm.clone()]  # a verify overwrites its source slot (slot 0 here)
    graphed = runner.mtp.verify(slots, lasts, drafts).clone()
    state.conv.copy_(before[0])  # the same verify again, eagerly, from the same states and KV rows
    state.ssm.copy_(before[1])
    graphs, runner.mtp.graphs = runner.mtp.graphs, None
    eager = runner.mtp.verify(slots, lasts, drafts)
    runner.mtp.graphs = graphs
    torch.testing.assert_close(graphed, eager, atol=2e-2, rtol=0)
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))


EXTRAS = {
    "greedy": [{}] * 3,
    "sampled": [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=20, seed=5), {}],
    "processed": [dict(repetition_penalty=1.2, top_logprobs=2), dict(temperature=0.8, frequency_penalty=0.5, seed=5),
                  dict(min_tokens=4, stop_token_ids=[7], logit_bias={5: 1.0})],
}  # fmt: skip


@pytest.mark.parametrize("kind", list(EXTRAS))
@pytest.mark.parametrize("graphs", [True, False])
def test_an_mtp_step_waits_for_the_gpu_twice(model_dir, graphs, kind):
    """Draft, verify and acceptance (greedy; sampled with temperature, top-k, top-p, one of them seeded; or with
    penalties, bias, min_tokens and top logprobs) stage every input through pinned memory and decide every verify
    position on the device, so the host waits for the GPU only where it reads: every position's tokens, logprobs,
    acceptances and top logprobs (one copy), and the drafts again in ``accept`` (the GPU is idle by then). CUDA's
    sync debug mode warns at each wait."""
    import warnings

    eng = engine(model_dir, mtp_mode="eagle_with_att", mtp_step=3, disable_cudagraph=not graphs)
    extra = EXTRAS[kind]
    for i, p in enumerate(PROMPTS[:3]):
        params = SamplingParams(max_new_tokens=40, ignore_eos=True, **extra[i])
        eng.submit(Request(str(i), p, params, lambda ev: None))
    assert eng.step()
    while eng.scheduler.waiting or eng.scheduler.prefilling:  # every request prefilled: the next steps decode
        assert eng.step()
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                assert eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # one warning per wait; the once-per-process "prototype feature" notice is not a wait
        waits = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        assert len(waits) == 2, waits


def test_mtp_decode_steps_of_plain_greedy_requests_report_their_gpu_time(model_dir, monkeypatch):
    """With an observer that takes GPU time, every MTP decode step of plain greedy requests reports it (here every
    step is timed): more than nothing, and no more than the step's wall time."""
    import lightllm.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "GPU_TIME_EVERY", 1)

    class Observer:
        def __init__(self):
            self.wall, self.gpu = [], []

        def on_queues(self, *a): ...

        def on_token(self, *a): ...

        def on_spec(self, *a): ...

        def on_step(self, kind, batch_size, seconds):
            self.wall.append((kind, seconds))

        def on_step_gpu(self, kind, seconds):
            self.gpu.append((kind, seconds))

    eng = engine(model_dir, mtp_mode="eagle_with_att", mtp_step=3)
    observer = Observer()
    eng.set_observer(observer)
    got, _ = run_all(eng, PROMPTS, params=PARAMS)
    decode_wall = [s for k, s in observer.wall if k == "decode"]
    decode_gpu = [s for k, s in observer.gpu if k == "decode"]
    assert len(decode_gpu) == len(decode_wall) > 0
    assert all(0 < g <= w for g, w in zip(decode_gpu, decode_wall)), (decode_gpu, decode_wall)
