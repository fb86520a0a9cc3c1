"""Qwen3.5 folders: the config read through transformers (text and ConditionalGeneration folders), the weights
checked against transformers' state dict, and one-line errors for what the forward does not implement."""

import dataclasses
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightllm.layers.attention import AttentionBackend, make_pool
from lightllm.layers.infer_state import InferState
from lightllm.models.hf_config import ModelLoadError
from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig
from lightllm.models.qwen3_5.weights import load_qwen3_5_weights
from lightllm.models.registry import read_model_config
from lightllm.tools.make_tiny_model import make_tiny_qwen3, make_tiny_qwen3_5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "model", seed=1)


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def language_model_names(tensors: dict) -> dict:
    """A text checkpoint's tensors named as a ``Qwen3_5ForConditionalGeneration`` one's: ``model.`` becomes
    ``model.language_model.``."""
    return {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
            for k, v in tensors.items()}  # fmt: skip


def conditional_generation_folder(text_dir, out, tie=False):
    """The text model as a ``Qwen3_5ForConditionalGeneration`` checkpoint: nested ``text_config``, weights under
    ``model.language_model.``, plus a vision tensor and an MTP tensor the loader must skip."""
    shutil.copytree(text_dir, out)
    text = json.loads((text_dir / "config.json").read_text())
    text.pop("architectures")
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                 "model_type": "qwen3_5", "text_config": text,
                                                 "tie_word_embeddings": tie}))  # fmt: skip
    renamed = language_model_names(load_file(out / "model.safetensors"))
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    renamed["model.visual.blocks.0.norm1.weight"] = torch.zeros(4)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    if tie:
        renamed.pop("lm_head.weight")
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_config_matches_transformers(tiny_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_dir)
    family, c = read_model_config(tiny_dir)
    assert family.name == "Qwen3.5" and c.layer_types == tuple(hf.layer_types)
    assert c.num_kv_layers == 2 and c.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (
        hf.linear_num_key_heads,
        hf.linear_num_value_heads,
        hf.linear_key_head_dim,
        hf.linear_value_head_dim,
    )
    assert c.linear_conv_dim == 2 * 2 * 16 + 4 * 8 and c.weight_prefix == "model." and not c.multimodal


def test_weights_equal_transformers_state_dict(tiny_dir):
    from transformers import Qwen3_5ForCausalLM

    c = Qwen3_5ModelConfig.from_model_dir(tiny_dir)
    w = load_qwen3_5_weights(tiny_dir, c, torch.float32)
    sd = Qwen3_5ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    lin, full = w.layers[0], w.layers[1]
    assert lin.kind == "linear_attention" and full.kind == "full_attention" and lin.q_proj is None
    assert torch.equal(lin.conv1d, sd["model.layers.0.linear_attn.conv1d.weight"][:, 0])
    assert torch.equal(lin.A_log, sd["model.layers.0.linear_attn.A_log"])
    assert torch.equal(lin.norm, sd["model.layers.0.linear_attn.norm.weight"])  # the gated norm: plain weight
    assert torch.equal(lin.input_norm, 1 + sd["model.layers.0.input_layernorm.weight"])  # zero-centred: 1 + w
    assert torch.equal(full.q_norm, 1 + sd["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(full.q_proj, sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(w.final_norm, 1 + sd["model.norm.weight"]) and torch.equal(w.lm_head, sd["lm_head.weight"])


def test_projections_are_fused_at_load(tiny_dir):
    """One weight (one GEMM) per input: gated attention's [q (with gate); k; v], gated DeltaNet's [qkv; z; b; a],
    the MLP's [gate; up]. The checkpoint's names are views of their rows, not copies."""
    from transformers import Qwen3_5ForCausalLM

    c = Qwen3_5ModelConfig.from_model_dir(tiny_dir)
    w = load_qwen3_5_weights(tiny_dir, c, torch.float32)
    sd = Qwen3_5ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    parts = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                         "linear_attn.in_proj_a"),
             "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip
    for i, layer in enumerate(w.layers):
        fused = ("qkv_proj" if layer.kind == "full_attention" else "in_proj", "gate_up_proj")
        for target in fused:
            hf = torch.cat([sd[f"model.layers.{i}.{name}.weight"] for name in parts[target]])
            assert torch.equal(getattr(layer, target), hf) and getattr(layer, target).is_contiguous(), (i, target)
        for name in parts[fused[0]] + parts["gate_up_proj"]:
            view = getattr(layer, name.split(".")[1])
            assert torch.equal(view, sd[f"model.layers.{i}.{name}.weight"]), (i, name)
            assert view.untyped_storage().data_ptr() == getattr(layer, fused[0] if "mlp" not in name
                                                                else "gate_up_proj").data_ptr()  # fmt: skip
        unfused = {"q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "gate_proj",
                   "up_proj"}  # fmt: skip
        assert not unfused & set(vars(layer)), i
        check_transposed_views(layer)


def check_transposed_views(layer):
    """The layer's linears also as ``[in, out]`` views (for ``torch.mm``), not copies; None for the other kind's."""
    mixer = ("qkv", "o") if layer.kind == "full_attention" else ("in", "out")
    other = ("in", "out") if layer.kind == "full_attention" else ("qkv", "o")
    for name in (*mixer, "gate_up", "down"):
        weight, transposed = getattr(layer, f"{name}_proj"), getattr(layer, f"{name}_t")
        assert transposed.data_ptr() == weight.data_ptr() and torch.equal(transposed, weight.t()), name
    assert all(getattr(layer, f"{name}_t") is None for name in other)


def test_conditional_generation_folder_loads_its_text_model(tiny_dir, tmp_path, caplog):
    cg = conditional_generation_folder(tiny_dir, tmp_path / "cg")
    family, c = read_model_config(cg)
    assert family.name == "Qwen3.5" and c.multimodal and c.weight_prefix == "model.language_model."
    assert dataclasses.replace(c, weight_prefix="model.", multimodal=False) == read_model_config(tiny_dir)[1]
    with caplog.at_level(logging.INFO, logger="lightllm.models.qwen3_5.weights"):
        model = family.build(cg, c, torch.float32, torch.device("cpu"), 0, 1)
    visual = [r.getMessage() for r in caplog.records if "model.visual." in r.getMessage()]
    assert len(visual) == 1 and "skipping 2 model.visual.* tensors" in visual[0]
    assert any("skipping 1 mtp.* tensors" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = family.build(tiny_dir, *read_model_config(tiny_dir)[1:], torch.float32, torch.device("cpu"), 0, 1)
    ids = torch.tensor([3, 9, 27, 81, 5])
    assert torch.equal(logits(model, ids), logits(text, ids))


def test_conditional_generation_ties_through_its_top_level_field(tiny_dir, tmp_path):
    cg = conditional_generation_folder(tiny_dir, tmp_path / "cg", tie=True)
    c = Qwen3_5ModelConfig.from_model_dir(cg)
    assert c.tie_word_embeddings
    w = load_qwen3_5_weights(cg, c, torch.float32)
    assert w.lm_head is w.embed


@pytest.mark.parametrize("stored", ["equal", "different"])
@pytest.mark.parametrize("kind", ["text", "conditional generation"])
def test_tied_config_with_a_stored_lm_head(tiny_dir, tmp_path, caplog, kind, stored):
    """tie_word_embeddings with an lm_head.weight in the files: one shared tensor when it equals the embedding;
    else the stored head (as transformers loads it; tests/engine compares the tokens), with one warning, on every
    tensor-parallel rank alike."""
    make = shutil.copytree if kind == "text" else conditional_generation_folder
    folder = make(tiny_dir, tmp_path / "model")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    embed = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    if stored == "equal":
        tensors["lm_head.weight"] = embed.clone()
        save_file(tensors, path, metadata={"format": "pt"})
    edit_config(folder, tie_word_embeddings=True)
    family, c = read_model_config(folder)
    assert c.tie_word_embeddings
    for rank, tp in ((0, 1), (0, 2), (1, 2)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightllm.models.qwen3_5.weights"):
            w = family.build(folder, c, torch.float32, torch.device("cpu"), rank, tp).w
        assert torch.equal(w.lm_head, tensors["lm_head.weight"])
        if stored == "equal":
            assert w.lm_head is w.embed and not caplog.records
        else:
            assert not torch.equal(w.lm_head, embed)
            [record] = caplog.records
            assert "tie_word_embeddings" in record.getMessage() and "lm_head.weight" in record.getMessage()


def test_conditional_generation_reads_special_ids_at_the_top_level_first(tiny_dir, tmp_path):
    """eos/bos at config.json's top level (no generation_config.json): transformers' generate reads them there first,
    then what text_config sets for what the top level leaves unset."""
    from transformers import AutoConfig, GenerationConfig

    cg = conditional_generation_folder(tiny_dir, tmp_path / "cg")
    (cg / "generation_config.json").unlink()
    data = json.loads((cg / "config.json").read_text())
    for field in ("eos_token_id", "bos_token_id"):
        data["text_config"].pop(field)
    (cg / "config.json").write_text(json.dumps({**data, "eos_token_id": [7, 9], "bos_token_id": 5}))
    c = Qwen3_5ModelConfig.from_model_dir(cg)
    want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(cg))
    assert (list(c.eos_token_ids), c.bos_token_id) == (want.eos_token_id, want.bos_token_id) == ([7, 9], 5)
    (cg / "config.json").write_text(json.dumps({**data, "eos_token_id": 512}))
    with pytest.raises(ModelLoadError, match=r"config.json: field 'eos_token_id' \[512\] out of range for vocab_size "
                                             r"512$"):  # fmt: skip
        Qwen3_5ModelConfig.from_model_dir(cg)
    # both levels set: the top level's win, as transformers' generate reads them
    both = {
        **data,
        "eos_token_id": 11,
        "bos_token_id": 5,
        "text_config": {**data["text_config"], "eos_token_id": [3, 4], "bos_token_id": 6},
    }
    (cg / "config.json").write_text(json.dumps(both))
    c = Qwen3_5ModelConfig.from_model_dir(cg)
    want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(cg))
    assert (list(c.eos_token_ids), c.bos_token_id) == ([want.eos_token_id], want.bos_token_id) == ([11], 5)
    (cg / "config.json").write_text(json.dumps({**data, "bos_token_id": [1, 2]}))  # transformers takes it up there
    with pytest.raises(ModelLoadError, match=r"config.json: field 'bos_token_id' must be one token id, got \[1, 2\]$"):
        Qwen3_5ModelConfig.from_model_dir(cg)


def logits(model, ids):
    """One prefill of ``ids`` through a fresh fp32 KV pool and one state slot."""
    c = model.config
    model.alloc_request_state(1, torch.float32)
    pool = make_pool("None", len(ids), c.num_kv_layers, model.kv_heads, c.head_dim, torch.float32, "cpu")
    model.set_attention(AttentionBackend(pool, "triton", torch.device("cpu")))
    n = len(ids)
    i32 = dict(dtype=torch.int32)
    state = InferState(is_prefill=True, b_req_idx=torch.zeros(1, **i32), req_to_token=torch.arange(n, **i32)[None],
                       b_seq_len=torch.tensor([n], **i32), out_token_idx=torch.arange(n), positions=torch.arange(n),
                       max_len_in_batch=n, b_q_start=torch.zeros(1, **i32), b_q_len=torch.tensor([n], **i32),
                       max_q_len=n)  # fmt: skip
    return model.forward(ids, state)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
         "layer_types"),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "partial_rotary_factor": 0.01},
         "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
         "rope_parameters.partial_rotary_factor"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
    ids=["layer type", "no full attention", "rope type", "top-level rotary dims", "rotary dims", "value heads",
         "conv width", "bias", "act"],
)  # fmt: skip
def test_config_errors_are_one_line_naming_the_field(model_copy, changes, field):
    edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError) as err:
        Qwen3_5ModelConfig.from_model_dir(model_copy)
    msg = str(err.value)
    assert "\n" not in msg and str(model_copy / "config.json") in msg and f"'{field}'" in msg


def test_nested_config_errors_name_the_text_config_field(tiny_dir, tmp_path):
    cg = conditional_generation_folder(tiny_dir, tmp_path / "cg")
    data = json.loads((cg / "config.json").read_text())
    data["text_config"]["layer_types"][0] = "sliding_attention"
    (cg / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"field 'text_config.layer_types' has 'sliding_attention'; supported: "
                                             r"linear_attention, full_attention$"):  # fmt: skip
        read_model_config(cg)


def test_nested_rope_errors_name_the_keys_the_file_sets(tiny_dir, tmp_path):
    cg = conditional_generation_folder(tiny_dir, tmp_path / "cg")
    data = json.loads((cg / "config.json").read_text())
    data["text_config"]["rope_parameters"].update(rope_type="linear", factor=2.0)
    (cg / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError) as err:
        read_model_config(cg)
    assert str(err.value) == (f"{cg / 'config.json'}: field 'text_config.rope_parameters.rope_type' is \"linear\" "
                              "(and 'text_config.rope_parameters.factor'); only plain rope is supported: rope_type "
                              "'default' with mrope_interleaved, mrope_section, partial_rotary_factor, "
                              "rope_theta")  # fmt: skip


@pytest.mark.parametrize("archs, model_type, expected", [
    (["Qwen3_5ForCausalLM"], "qwen3", "'qwen3', expected 'qwen3_5_text' for Qwen3_5ForCausalLM"),
    (["Qwen3_5ForCausalLM"], "qwen3_5", "'qwen3_5', expected 'qwen3_5_text' for Qwen3_5ForCausalLM"),
    (["Qwen3_5ForConditionalGeneration"], "qwen3_5_text",
     "'qwen3_5_text', expected 'qwen3_5' for Qwen3_5ForConditionalGeneration"),
], ids=["qwen3", "multimodal type", "text type"])  # fmt: skip
def test_model_type_must_be_the_architectures(model_copy, archs, model_type, expected):
    """Another model_type gives transformers' config class of that type, without the Qwen3.5 fields."""
    edit_config(model_copy, architectures=archs, model_type=model_type)
    with pytest.raises(ModelLoadError) as err:
        read_model_config(model_copy)
    assert str(err.value) == f"{model_copy / 'config.json'}: field 'model_type' is {expected}"


def test_a_qwen3_config_named_qwen3_5_is_refused(tmp_path):
    model_dir = make_tiny_qwen3(tmp_path / "qwen3")
    edit_config(model_dir, architectures=["Qwen3_5ForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"config.json: field 'model_type' is 'qwen3', expected 'qwen3_5_text' "
                                             r"for Qwen3_5ForCausalLM$"):  # fmt: skip
        read_model_config(model_dir)


def test_an_out_of_range_generation_eos_id_names_generation_config(model_copy):
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 512]}))
    with pytest.raises(ModelLoadError) as err:
        read_model_config(model_copy)
    assert str(err.value) == (f"{model_copy / 'generation_config.json'}: field 'eos_token_id' [2, 512] out of range "
                              "for config.json's vocab_size 512")  # fmt: skip


def test_missing_sizes_as_docs_engine_md_says(model_copy):
    """A missing head_dim is transformers' default (256), not hidden_size / heads as for Qwen3; the KV heads must
    be given."""
    edit_config(model_copy, head_dim=None)
    assert Qwen3_5ModelConfig.from_model_dir(model_copy).head_dim == 256
    edit_config(model_copy, num_key_value_heads=None)
    with pytest.raises(ModelLoadError, match=r"field 'num_key_value_heads' is missing$"):
        Qwen3_5ModelConfig.from_model_dir(model_copy)


def test_missing_and_misshapen_tensors(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    tensors.pop("model.layers.2.linear_attn.dt_bias")
    tensors["model.layers.0.linear_attn.in_proj_b.weight"] = torch.zeros(3, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    c = Qwen3_5ModelConfig.from_model_dir(model_copy)
    with pytest.raises(ModelLoadError, match=r"in_proj_b.weight has shape \[3, 64\], expected \[4, 64\]"):
        load_qwen3_5_weights(model_copy, c)
    tensors["model.layers.0.linear_attn.in_proj_b.weight"] = torch.zeros(4, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.2.linear_attn.dt_bias is missing"):
        load_qwen3_5_weights(model_copy, c)
    tensors["model.layers.2.linear_attn.dtbias"] = torch.zeros(1)  # a misnamed one: shown with the missing one
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"dt_bias is missing .*; the files have unknown tensors: "
                       r"model\.layers\.2\.linear_attn\.dtbias$"):  # fmt: skip
        load_qwen3_5_weights(model_copy, c)


def test_tensor_parallel_rank_reads_its_heads(tiny_dir):
    family, c = read_model_config(tiny_dir)
    full = load_qwen3_5_weights(tiny_dir, c, torch.float32)
    model = family.build(tiny_dir, c, torch.float32, torch.device("cpu"), tp_rank=1, tp=2)
    lin, att = model.w.layers[0], model.w.layers[1]
    assert (model.heads, model.kv_heads, family.kv_heads(c, 2)) == (2, 1, 1)
    kd, vd = 2 * 16, 4 * 8  # key and value widths of the conv input
    want = torch.cat([full.layers[0].in_proj_qkv[16:32], full.layers[0].in_proj_qkv[kd + 16 : 2 * kd],
                      full.layers[0].in_proj_qkv[2 * kd + vd // 2 :]])  # fmt: skip
    assert torch.equal(lin.in_proj_qkv, want)  # rank 1's key head of q and of k, its two value heads of v
    assert torch.equal(lin.conv1d, torch.cat([full.layers[0].conv1d[16:32], full.layers[0].conv1d[kd + 16 : 2 * kd],
                                              full.layers[0].conv1d[2 * kd + vd // 2 :]]))  # fmt: skip
    assert torch.equal(lin.A_log, full.layers[0].A_log[2:]) and torch.equal(
        lin.out_proj, full.layers[0].out_proj[:, 16:]
    )
    assert torch.equal(att.q_proj, full.layers[1].q_proj[64:])  # heads 2 and 3, each [query | gate]
    # each part sharded by heads first, then the rank's parts fused: [its q; its k; its v], [its qkv; z; b; a]
    assert torch.equal(att.qkv_proj, torch.cat([full.layers[1].q_proj[64:], full.layers[1].k_proj[16:],
                                                full.layers[1].v_proj[16:]]))  # fmt: skip
    assert torch.equal(lin.in_proj, torch.cat([want, full.layers[0].in_proj_z[16:], full.layers[0].in_proj_b[2:],
                                               full.layers[0].in_proj_a[2:]]))  # fmt: skip
    assert torch.equal(lin.gate_up_proj, torch.cat([full.layers[0].gate_proj[64:], full.layers[0].up_proj[64:]]))
    assert torch.equal(att.o_proj, full.layers[1].o_proj[:, 32:]) and torch.equal(lin.norm, full.layers[0].norm)
    for layer in (lin, att):  # the rank's [in, out] views are of its own shards
        check_transposed_views(layer)


def test_tensor_parallel_must_divide_the_heads(tiny_dir):
    family, c = read_model_config(tiny_dir)
    c = dataclasses.replace(c, num_key_value_heads=4)  # the attention heads divide: the linear ones do not
    with pytest.raises(ValueError, match=r"^--tp 4: the model's linear_num_key_heads \(2\) is not divisible by it$"):
        family.check_tp(c, 4)


def test_a_quantization_config_in_text_config_is_refused_by_name(tiny_dir, tmp_path):
    cg = conditional_generation_folder(tiny_dir, tmp_path / "cg")
    data = json.loads((cg / "config.json").read_text())
    data["text_config"]["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (cg / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError) as err:
        read_model_config(cg)
    assert str(err.value) == (f"{cg / 'config.json'}: field 'text_config.quantization_config' (quant_method 'awq'): "
                              "quantized checkpoints are not supported; only unquantized F16, BF16 or F32 weights "
                              "load")  # fmt: skip
