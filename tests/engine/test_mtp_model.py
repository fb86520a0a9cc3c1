"""Qwen3.5's MTP head: the tiny folders write it in the real checkpoint's names, the loader reads it only when MTP
is on, and its logits match a head assembled from transformers' own Qwen3.5 modules (the oracle)."""

import json
import logging

import pytest
import torch
from safetensors import safe_open

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.models.hf_config import ModelLoadError
from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig
from lightllm.models.qwen3_5.weights import load_qwen3_5_weights
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5
from tests.models.test_qwen3_5_loading import check_transposed_views
from tests.models.test_qwen3_layer_ops import OpCounter

HEAD = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
MTP_NAMES = HEAD | {
    f"mtp.layers.0.{n}.weight"
    for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
              "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj")
}  # fmt: skip


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-mtp"), mtp=True, seed=5)


def tensor_names(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_tiny_folder_holds_the_mtp_head_in_the_checkpoint_names(mtp_dir):
    assert {n for n in tensor_names(mtp_dir) if n.startswith("mtp.")} == MTP_NAMES
    assert json.loads((mtp_dir / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    assert Qwen3_5ModelConfig.from_model_dir(mtp_dir).mtp_num_hidden_layers == 1


def test_loader_skips_the_head_unless_asked_and_reads_it_when_asked(mtp_dir, caplog):
    config = Qwen3_5ModelConfig.from_model_dir(mtp_dir)
    with caplog.at_level(logging.INFO):
        assert load_qwen3_5_weights(mtp_dir, config, torch.float32).mtp is None
    assert f"skipping {len(MTP_NAMES)} mtp.* tensors (MTP head: --mtp_mode is off)" in caplog.text
    head = load_qwen3_5_weights(mtp_dir, config, torch.float32, mtp=True).mtp
    with safe_open(str(mtp_dir / "model.safetensors"), framework="pt") as f:
        torch.testing.assert_close(head.fc, f.get_tensor("mtp.fc.weight"))
        torch.testing.assert_close(head.final_norm, 1 + f.get_tensor("mtp.norm.weight"))  # zero-centred
        torch.testing.assert_close(head.layer.k_proj, f.get_tensor("mtp.layers.0.self_attn.k_proj.weight"))
    # the [in, out] views the head's GEMMs take (torch.mm), made at load, not copies
    assert head.fc_t.data_ptr() == head.fc.data_ptr() and torch.equal(head.fc_t, head.fc.t())
    check_transposed_views(head.layer)


def test_the_head_loads_from_a_folder_of_its_own(mtp_dir, tmp_path, caplog):
    """--mtp_draft_model_dir: the main folder without ``mtp.*`` weights, the head in two shards beside a tensor it
    does not use (ignored, one line): the same weights as from the folder that holds both."""
    from lightllm.tools.tiny_mtp import split_mtp_head

    split_mtp_head(mtp_dir, tmp_path / "main", tmp_path / "head", extra={"model.norm.weight": torch.ones(4)})
    assert len(list((tmp_path / "head").glob("*.safetensors"))) == 2 and not any(
        n.startswith("mtp.") for n in tensor_names(tmp_path / "main")
    )
    config = Qwen3_5ModelConfig.from_model_dir(mtp_dir)
    want = load_qwen3_5_weights(mtp_dir, config, torch.float32, mtp=True)
    with caplog.at_level(logging.INFO):
        got = load_qwen3_5_weights(tmp_path / "main", config, torch.float32, mtp=True, mtp_dir=tmp_path / "head")
    assert f"{tmp_path / 'head'}: skipping 1 tensors (not mtp.*: only the MTP head is read from here)" in caplog.text
    for field in ("fc", "norm_embedding", "norm_hidden", "final_norm"):
        torch.testing.assert_close(getattr(got.mtp, field), getattr(want.mtp, field), rtol=0, atol=0)
    for field in ("qkv_proj", "o_proj", "q_norm", "k_norm", "gate_up_proj", "down_proj", "input_norm", "post_norm"):
        torch.testing.assert_close(getattr(got.mtp.layer, field), getattr(want.mtp.layer, field), rtol=0, atol=0)
    torch.testing.assert_close(got.final_norm, want.final_norm, rtol=0, atol=0)  # not the head folder's stray one
    with pytest.raises(ModelLoadError, match=r"main: tensor mtp\.\S+ is missing .*--mtp_mode needs"):
        load_qwen3_5_weights(mtp_dir, config, torch.float32, mtp=True, mtp_dir=tmp_path / "main")


def test_a_folder_without_the_head_is_a_one_line_error_naming_the_tensor(tmp_path):
    plain = make_tiny_qwen3_5(tmp_path, seed=5)
    with pytest.raises(
        ModelLoadError, match=r"tensor mtp\.\S+ is missing .*--mtp_mode needs the checkpoint's MTP head"
    ):
        load_qwen3_5_weights(plain, Qwen3_5ModelConfig.from_model_dir(plain), torch.float32, mtp=True)


def transformers_head_logits(model_dir, tokens):
    """The MTP head over ``tokens`` from transformers' modules: the main model's final-normed hidden state of
    position ``i`` and token ``i + 1``, through ``fc``, a Qwen3.5 full-attention decoder layer (causal, rope at
    position ``i``), ``mtp.norm`` and the shared ``lm_head``; logits of the last position ``[vocab]``."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    hf = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = hf.config
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        w = {n: f.get_tensor(n).float() for n in MTP_NAMES}
    layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict({n[len("mtp.layers.0.") :]: t for n, t in w.items() if n.startswith("mtp.layers.0.")})

    def norm(name, x):
        module = Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        module.weight.data.copy_(w[name])
        return module(x)

    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = hf.model(ids).last_hidden_state[:, :-1]
        embedded = hf.model.embed_tokens(ids[:, 1:])
        x = torch.cat([norm("mtp.pre_fc_norm_embedding.weight", embedded),
                       norm("mtp.pre_fc_norm_hidden.weight", hidden)], dim=-1) @ w["mtp.fc.weight"].T  # fmt: skip
        positions = torch.arange(len(tokens) - 1)[None]
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=None,
                  position_ids=positions)  # fmt: skip
        return hf.lm_head(norm("mtp.norm.weight", x))[0, -1]


def _greedy_draft_logits(runner, prompt):
    """Prefill ``prompt`` in a new slot, draft greedily from its first token: (first token, each draft's logits)."""
    slot = runner.add_request()
    first = int(runner.prefill([slot], [prompt]).argmax())
    seen = []

    def choose(k, logits):
        seen.append(logits[0].clone())
        return logits.argmax(-1)

    runner.mtp.draft([slot], [first], choose)
    return first, seen


@pytest.mark.parametrize("mtp_step", [1, 3])
def test_first_draft_logits_match_the_transformers_head(mtp_dir, mtp_step):
    prompt = [7, 91, 3, 250, 18, 44, 120, 9, 61]
    runner = ModelRunner(EngineArgs(model_dir=str(mtp_dir), data_type="fp32", device="cpu", max_req_total_len=64,
                                    running_max_req_size=2, mtp_mode="eagle_with_att", mtp_step=mtp_step))  # fmt: skip
    first, seen = _greedy_draft_logits(runner, prompt)
    want = transformers_head_logits(mtp_dir, prompt + [first])
    assert len(seen) == mtp_step
    assert (seen[0] - want).abs().max() <= 1e-4


def test_the_head_on_the_kernel_path_matches_the_reference_path(mtp_dir, monkeypatch):
    """The head on the kernel path (interpreted here: the two input norms write the halves of fc's input, no
    concatenation; the q/k norm + rotary launch also writes the head's K/V into its pool layer, after the main
    model's) drafts what the torch references draft, and leaves the same K/V in every pool layer."""
    prompt = [7, 91, 3, 250, 18, 44, 120, 9, 61]
    runs, head_ops = [], OpCounter()
    for kernels in (False, True):
        runner = ModelRunner(EngineArgs(model_dir=str(mtp_dir), data_type="fp32", device="cpu", max_req_total_len=64,
                                        running_max_req_size=2, mtp_mode="eagle_with_att", mtp_step=2))  # fmt: skip
        runner.model.use_kernels = kernels
        if kernels:
            head_forward = runner.model.mtp.forward

            def counted(*args, **kwargs):
                with head_ops:
                    return head_forward(*args, **kwargs)

            monkeypatch.setattr(runner.model.mtp, "forward", counted)
            for name in ("prefill", "decode"):  # attention's CPU reference is not the head's own work
                monkeypatch.setattr(runner.attn, name, uncounted(head_ops, getattr(runner.attn, name)))
        runs.append((*_greedy_draft_logits(runner, prompt), runner.attn.pool))
    (first_ref, seen_ref, pool_ref), (first, seen, pool) = runs
    assert first == first_ref and len(seen) == len(seen_ref) == 2
    assert head_ops.ops["mm"] > 0 and "cat" not in head_ops.ops, head_ops.ops
    for got, want in zip(seen, seen_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    head = pool.k.shape[0] - 1  # the head's layer, after the main model's
    assert pool_ref.k[head].abs().sum() > 0  # the head wrote its K there
    torch.testing.assert_close(pool.k, pool_ref.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.v, pool_ref.v, rtol=1e-5, atol=1e-5)


def uncounted(counter, fn):
    def run(*args, **kwargs):
        counter.active = False
        try:
            return fn(*args, **kwargs)
        finally:
            counter.active = True

    return run
