"""MTP on the GPU (bf16, the Triton kernels: diverse attention and the linear-attention verify kernels; FA3 where
it can run): greedy output equals MTP off, token for token, and the agreeing head is accepted."""

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
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
    on = engine(model_dir, llm_decode_att_backend=backend, mtp_mode="eagle_with_att", mtp_step=step)
    assert on.runner.graphs is None  # MTP decodes eagerly today
    got, _ = run_all(on, PROMPTS, params=PARAMS)
    assert got == want
