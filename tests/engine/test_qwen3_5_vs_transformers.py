"""The engine serving Qwen3.5 against transformers' ``Qwen3_5ForCausalLM`` on tiny random hybrid models (every
parameter perturbed): packed prefill logits, greedy tokens and logprobs, decode after prefill, state slots."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightllm import LLM, SamplingParams
from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.server.args import parse_args
from lightllm.tools.make_tiny_model import QWEN3_5_GPU_SHAPE, make_tiny_qwen3_5

from tests.engine.test_graph_len_buckets import BucketReplayAPI
from tests.engine.test_qwen3_vs_transformers import (
    check_gpu_bf16_against_cpu_fp32,
    check_gpu_fa3_prefill,
    forced_scores,
)
from tests.engine.test_scheduler import run_all
from tests.models.test_qwen3_5_loading import language_model_names

GEN = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, 500, (n,), generator=GEN).tolist() for n in (1, 7, 200, 33)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5"), seed=3))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def cpu_runner(model_dir, **opts):
    args = dict(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=256, max_req_total_len=256,
                running_max_req_size=4)  # fmt: skip
    return ModelRunner(EngineArgs(**{**args, **opts}))


def hf_logprobs(model, tokens):
    """transformers' log-softmax over the whole sequence, ``[len, vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)


def test_packed_prefill_logits_match_transformers_per_prompt(tiny_dir, hf_model):
    runner = cpu_runner(tiny_dir)
    slots = [runner.add_request() for _ in PROMPTS]
    got = torch.log_softmax(runner.prefill(slots, PROMPTS), -1)
    for row, prompt in zip(got, PROMPTS):
        assert (row - hf_logprobs(hf_model, prompt)[-1]).abs().max() <= 1e-4


@pytest.mark.parametrize("batch", [[0, 1, 2, 3], [2, 0], [3]], ids=["all four", "long and short", "alone"])
def test_greedy_tokens_and_logprobs_match_transformers_generate(tiny_dir, hf_model, batch):
    llm = LLM(tiny_dir, data_type="fp32", device="cpu", batch_max_tokens=256, max_req_total_len=256,
              running_max_req_size=4)  # fmt: skip
    prompts = [PROMPTS[i] for i in batch]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, logprobs=True, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert out.token_ids == want[0, len(prompt) :].tolist()
        ref = hf_logprobs(hf_model, prompt + out.token_ids)[len(prompt) - 1 : -1]
        ref = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref.tolist())) <= 1e-4
        forced, best = forced_scores(llm.runner, prompt, out.token_ids)  # prefill then decodes, one request
        assert max(abs(a - b) for a, b in zip(out.logprobs, forced)) <= 1e-5 and forced == best


def conditional_generation_folder(text_dir, out, **top_fields):
    """The text model as a ``Qwen3_5ForConditionalGeneration`` folder transformers loads too (a tiny vision config,
    its tower left random): nested ``text_config``, weights under ``model.language_model.``; ``top_fields`` are
    added at config.json's top level."""
    shutil.copytree(text_dir, out)
    text = json.loads((out / "config.json").read_text())
    text.pop("architectures")
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 64}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": vision, "tie_word_embeddings": False, **top_fields}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    renamed = language_model_names(load_file(out / "model.safetensors"))
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


def hf_generate(model_dir, prompt, steps, conditional_generation, **kw):
    """transformers' greedy ``generate`` of the folder's model (the ConditionalGeneration class for such a folder)."""
    from transformers import AutoModelForImageTextToText, Qwen3_5ForCausalLM

    cls = AutoModelForImageTextToText if conditional_generation else Qwen3_5ForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["text", "conditional generation"])
def test_tied_config_with_a_different_stored_lm_head_gives_transformers_tokens(tiny_dir, tmp_path, kind):
    """tie_word_embeddings: true, but the files hold an lm_head.weight unlike the embedding: transformers projects
    with the stored head ("we will NOT tie them"), and so must the engine."""
    cg = kind != "text"
    if cg:
        model_dir = conditional_generation_folder(tiny_dir, tmp_path / "model", tie_word_embeddings=True)
    else:
        model_dir = shutil.copytree(tiny_dir, tmp_path / "model")
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128)
    (out,) = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out.token_ids == hf_generate(model_dir, PROMPTS[1], 6, cg, min_new_tokens=6)


def test_conditional_generation_stops_on_a_top_level_eos_id(tiny_dir, hf_model, tmp_path):
    """A ConditionalGeneration folder with eos_token_id only at config.json's top level and no
    generation_config.json: transformers' generate stops on that id, and so must the engine."""
    prompt = PROMPTS[1]
    with torch.no_grad():
        greedy = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    greedy = greedy[0, len(prompt) :].tolist()
    stop = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # an id first met after two tokens
    model_dir = conditional_generation_folder(tiny_dir, tmp_path / "model", eos_token_id=greedy[stop])
    (model_dir / "generation_config.json").unlink()
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"].pop("eos_token_id")
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128)
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=8))
    assert out.token_ids == hf_generate(model_dir, prompt, 8, True) == greedy[: stop + 1]
    assert out.finish_reason == "stop"


def test_text_folder_with_conditional_generation_weight_names_gives_transformers_tokens(tiny_dir, tmp_path):
    """A Qwen3_5ForCausalLM folder whose weights are named ``model.language_model.*`` (a text model cut out of a
    ConditionalGeneration checkpoint): transformers strips ``language_model.``, and so must the engine."""
    model_dir = shutil.copytree(tiny_dir, tmp_path / "model")
    renamed = language_model_names(load_file(model_dir / "model.safetensors"))
    save_file(renamed, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128)
    (out,) = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    want = hf_generate(model_dir, PROMPTS[1], 6, False, min_new_tokens=6)
    assert out.token_ids == want == hf_generate(tiny_dir, PROMPTS[1], 6, False, min_new_tokens=6)


def test_state_after_prefill_equals_state_after_one_token_decodes(tiny_dir):
    runner = cpu_runner(tiny_dir)
    prompt = PROMPTS[3]
    whole, stepped = runner.add_request(), runner.add_request()
    want = runner.prefill([whole], [prompt])[0]
    got = runner.prefill([stepped], [prompt[:1]])[0]
    for t in prompt[1:]:
        got = runner.decode([stepped], [t])[0]
    state = runner.model.linear.state
    assert state.ssm.abs().amax() > 0 and state.conv.abs().amax() > 0
    assert torch.allclose(state.conv[:, whole], state.conv[:, stepped], rtol=1e-5, atol=1e-5)
    assert torch.allclose(state.ssm[:, whole], state.ssm[:, stepped], rtol=1e-5, atol=1e-5)
    assert torch.allclose(want, got, atol=1e-4)


def test_a_reused_slot_starts_from_zero_state(tiny_dir):
    """A request prefilled into a slot another request left behind gets the same logits as on a fresh runner."""
    fresh = cpu_runner(tiny_dir)
    slot = fresh.add_request()
    want = [fresh.prefill([slot], [PROMPTS[1]])[0], fresh.decode([slot], [5])[0]]
    used = cpu_runner(tiny_dir)
    first = used.add_request()
    used.prefill([first], [PROMPTS[2]])
    used.decode([first], [9])
    used.free(first)
    again = used.add_request()
    assert again == first
    got = [used.prefill([again], [PROMPTS[1]])[0], used.decode([again], [5])[0]]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_interleaved_requests_give_the_tokens_each_gives_alone(tiny_dir):
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]]
    alone = [run_all(Engine(cpu_runner(tiny_dir), eos_ids=[]), [p])[0][0] for p in prompts]
    together, _ = run_all(Engine(cpu_runner(tiny_dir), eos_ids=[]), prompts)
    assert [together[i] for i in range(3)] == alone


def test_preemption_re_prefills_and_keeps_greedy_tokens(tiny_dir):
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35], [40, 41]]
    opts = dict(max_req_total_len=32, batch_max_tokens=64)
    want, _ = run_all(Engine(cpu_runner(tiny_dir, max_total_token_num=512, **opts), eos_ids=[]), prompts)
    tight = Engine(cpu_runner(tiny_dir, max_total_token_num=40, **opts), eos_ids=[])
    preempted = []
    real = tight.scheduler._preempt
    tight.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    got, reasons = run_all(tight, prompts)
    assert preempted, "the cache was meant to run out"
    assert got == want and set(reasons.values()) == {"length"}


def test_decode_through_the_graph_buffers_gives_the_eager_tokens(tiny_dir):
    """State slots are read through the static ``b_req_idx`` buffer; padding rows use the padding slot."""
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]]
    want, _ = run_all(Engine(cpu_runner(tiny_dir, disable_cudagraph=True), eos_ids=[]), prompts)
    api = BucketReplayAPI()
    runner = ModelRunner(EngineArgs(model_dir=tiny_dir, data_type="fp32", device="cpu", batch_max_tokens=256,
                                    max_req_total_len=256, running_max_req_size=4, graph_max_batch_size=4,
                                    graph_split_batch_size=2, graph_grow_step_size=2), graph_api=api)  # fmt: skip
    api.runner = runner
    got, _ = run_all(Engine(runner, eos_ids=[]), prompts)
    assert api.replayed and got == want


def test_int8_kv_and_bf16_state_run_on_the_cpu(tiny_dir):
    opts4 = dict(data_type="fp32", device="cpu", batch_max_tokens=256, max_req_total_len=256, running_max_req_size=4)
    ref = LLM(tiny_dir, **opts4)
    params = SamplingParams(max_new_tokens=6, logprobs=True, ignore_eos=True)
    (want,) = ref.generate([PROMPTS[2]], params)
    for opts in (dict(llm_kv_type="int8kv"), dict(linear_att_ssm_data_type="bfloat16")):
        llm = LLM(tiny_dir, **opts4, **opts)
        if "linear_att_ssm_data_type" in opts:
            assert llm.runner.model.linear.state.ssm.dtype == torch.bfloat16
        (out,) = llm.generate([PROMPTS[2]], params)
        forced, _ = forced_scores(ref.runner, PROMPTS[2], out.token_ids)  # the fp32 engine on the same tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, forced)) <= 0.05, opts


def test_kv_pool_holds_only_full_attention_layers_and_sizing_counts_the_state(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        runner = cpu_runner(tiny_dir)
    assert len(runner.attn.pool.k) == 2  # layers 1 and 3 of 4
    state = runner.model.linear.state
    slots, checkpoints = runner.args.running_max_req_size + 1, runner.args.linear_att_cache_size
    rows = slots + checkpoints  # the request slots, then the prefix cache's state checkpoints
    assert state.conv.shape == (2, rows, 3, 2 * 2 * 16 + 4 * 8) and state.ssm.shape == (2, rows, 4, 16, 8)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache sizing"))
    held = f"{slots} slots + {checkpoints} prefix-cache checkpoints x {state.nbytes // rows} B"
    assert f"request state {state.nbytes / 2**20:.2f} MiB ({held}" in line


def test_bad_ssm_data_type_is_one_line_naming_the_flag(tiny_dir, capsys):
    with pytest.raises(ValueError, match=r"^--linear_att_ssm_data_type expected one of \('float32', 'bfloat16'\), "
                                         r"got 'float16'$"):  # fmt: skip
        LLM(tiny_dir, device="cpu", linear_att_ssm_data_type="float16")
    with pytest.raises(SystemExit) as done:
        parse_args(["--model_dir", tiny_dir, "--device", "cpu", "--linear_att_ssm_data_type", "fp32"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "--linear_att_ssm_data_type" in err
    assert "'float32', 'bfloat16'" in err


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpu_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5-gpu"), seed=3, **QWEN3_5_GPU_SHAPE))


@pytest.mark.gpu
@pytest.mark.parametrize("backend, kv_type, graphs", [("triton", "None", True), ("triton", "None", False),
                                                      ("triton", "int8kv", True), ("fa3", "None", True)])  # fmt: skip
def test_gpu_bf16_greedy_close_to_fp32_reference(tiny_gpu_dir, backend, kv_type, graphs):
    """GPU bf16 (fla-core prefill, Triton linear-attention decode, graphs on/off) against the CPU fp32 engine
    (the torch references, matching transformers above), teacher-forced on the GPU's tokens; the bound is the
    CPU bf16 engine's own error against the same reference (the Qwen3 tests' bound)."""
    check_gpu_bf16_against_cpu_fp32(tiny_gpu_dir, backend, kv_type, f"Qwen3.5 GPU-vs-fp32 graphs={graphs}",
                                    disable_cudagraph=not graphs)  # fmt: skip


@pytest.mark.gpu
def test_gpu_fa3_prefill_close_to_fp32_reference(tiny_gpu_dir):
    """Gated attention (head_dim 256) through FA3 prefill, the prompt in 128-token chunks (the linear-attention
    state carried across them), FA3 decode; the bound of the test above."""
    check_gpu_fa3_prefill(tiny_gpu_dir, "fa3", "Qwen3.5 GPU-vs-fp32 FA3 prefill")


@pytest.mark.gpu
def test_gpu_fp32_follows_transformers(tiny_gpu_dir, monkeypatch):
    """The GPU engine in fp32 (the torch reference's prefill, as fla-core's chunk kernels failed to compile for fp32
    on the H200; Triton decode, graphs), teacher-forced on its greedy tokens, against the CPU fp32 engine
    (transformers' numbers to 1e-5, above): its logprob error stays within that of transformers itself in fp32 on
    the GPU, and each token is the reference's argmax unless its top two are that close. Transformers runs its own
    torch delta rule here: with fla-core installed it would take fla's kernels, which fail the same way in fp32 (on
    the H200 the run sat in fla's autotuner until the test's time ran out)."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn = getattr(hf_qwen3_5, name)
        monkeypatch.setattr(hf_qwen3_5, name, getattr(fn, "__wrapped__", fn))  # the torch function itself
    opts = dict(batch_max_tokens=256, max_req_total_len=256, running_max_req_size=4, max_total_token_num=4096)
    llm = LLM(tiny_gpu_dir, data_type="fp32", graph_max_batch_size=4, **opts)
    ref = LLM(tiny_gpu_dir, data_type="fp32", device="cpu", **opts).runner
    hf = Qwen3_5ForCausalLM.from_pretrained(tiny_gpu_dir, dtype=torch.float32).cuda().eval()
    errors, hf_errors, margins = [], [], []
    for prompt in (PROMPTS[0], PROMPTS[2]):
        (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True))
        forced, best = forced_scores(ref, prompt, out.token_ids)
        with torch.no_grad():
            ids = torch.tensor([prompt + out.token_ids[:-1]], device="cuda")
            scores = hf(ids).logits[0, len(prompt) - 1 :].float().log_softmax(-1)  # the scores of each new token
        hf_forced = [scores[i, t].item() for i, t in enumerate(out.token_ids)]
        errors += [abs(a - b) for a, b in zip(out.logprobs, forced)]
        hf_errors += [abs(a - b) for a, b in zip(hf_forced, forced)]
        margins += [b - a for a, b in zip(forced, best)]
    bound = 1.5 * max(hf_errors) + 2e-3
    print(f"\nQwen3.5 GPU fp32: max logprob error {max(errors):.2e} (transformers on the GPU {max(hf_errors):.2e})")
    assert max(errors) <= bound and max(margins) <= bound, (max(errors), max(margins), bound)


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager_bit_for_bit(tiny_gpu_dir):
    """One decode step replayed from a graph, then the captured function run eagerly on the same buffers from the
    same state: logits and state slots identical (decode advances the state in place, so it is restored first)."""
    llm = LLM(
        tiny_gpu_dir,
        data_type="bf16",
        batch_max_tokens=256,
        max_req_total_len=256,
        running_max_req_size=4,
        graph_max_batch_size=4,
        graph_split_batch_size=2,
        graph_grow_step_size=2,
    )  # graphs of 1, 2 and 4
    runner, state = llm.runner, llm.runner.model.linear.state
    slots = [runner.add_request() for _ in range(3)]
    runner.prefill(slots, [PROMPTS[1], PROMPTS[3], PROMPTS[0]])
    before = (state.conv.clone(), state.ssm.clone())
    replayed = runner.decode(slots, [11, 12, 13]).clone()  # pads to the size-4 graph
    assert runner.graphs.pick(3, 256) == (256, 4)  # one KV length bucket: 256 is --graph_max_len_in_batch
    after = (state.conv.clone(), state.ssm.clone())
    state.conv.copy_(before[0])
    state.ssm.copy_(before[1])
    eager = runner._graph_decode(4, 256)[:3]
    assert torch.equal(replayed, eager) and replayed.isfinite().all()
    assert torch.equal(after[0], state.conv) and torch.equal(after[1], state.ssm)
    assert not torch.equal(before[1][:, slots], after[1][:, slots])  # the step did advance the live slots
