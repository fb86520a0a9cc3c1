import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3ForCausalLM

from lightllm.models.hf_config import ModelLoadError
from lightllm.models.qwen3.config import Qwen3ModelConfig
from lightllm.models.qwen3.weights import load_qwen3_weights
from lightllm.models.registry import read_model_config
from lightllm.tools.make_tiny_model import make_tiny_qwen3

HF_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_DELETE = object()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Unequal sizes everywhere so a transposed or swapped tensor cannot pass the shape checks by accident.
    return make_tiny_qwen3(
        tmp_path_factory.mktemp("qwen3") / "model",
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
    )


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(tiny_dir, out)
    return out


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def edit_tensors(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_config_matches_transformers(tiny_dir):
    ours = Qwen3ModelConfig.from_model_dir(tiny_dir)
    hf = AutoConfig.from_pretrained(tiny_dir)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert ours.torch_dtype == "float32"


def test_config_of_older_transformers_and_defaults(model_copy):
    # Pre-v5 layout: rope_theta and torch_dtype at the top level, rope_scaling null, eos a list, no head_dim.
    edit_config(
        model_copy,
        rope_parameters=_DELETE,
        rope_theta=1000000.0,
        rope_scaling=None,
        dtype=_DELETE,
        torch_dtype="bfloat16",
        eos_token_id=[2, 0],
        head_dim=_DELETE,
        rms_norm_eps=_DELETE,
    )
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    assert cfg.rope_theta == 1000000.0
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.eos_token_ids == (2, 0)
    assert cfg.head_dim == 48 // 4
    assert cfg.rms_norm_eps == 1e-6


def test_generation_config_adds_eos_ids(model_copy):
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert Qwen3ModelConfig.from_model_dir(model_copy).eos_token_ids == (2, 7, 9)


def test_an_out_of_range_generation_eos_id_names_generation_config(model_copy):
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99999]}))
    with pytest.raises(ModelLoadError) as err:
        Qwen3ModelConfig.from_model_dir(model_copy)
    assert str(err.value) == (f"{model_copy / 'generation_config.json'}: field 'eos_token_id' [2, 99999] out of range "
                              "for config.json's vocab_size 512")  # fmt: skip


def test_weights_equal_transformers_state_dict(tiny_dir):
    cfg = Qwen3ModelConfig.from_model_dir(tiny_dir)
    weights = load_qwen3_weights(tiny_dir, cfg, dtype=torch.float32)
    state = Qwen3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    assert torch.equal(weights.embed, state["model.embed_tokens.weight"])
    assert torch.equal(weights.final_norm, state["model.norm.weight"])
    assert torch.equal(weights.lm_head, state["lm_head.weight"])
    assert weights.lm_head is not weights.embed
    assert len(weights.layers) == cfg.num_hidden_layers
    for i, layer in enumerate(weights.layers):
        for field, name in HF_NAMES.items():
            tensor = getattr(layer, field)
            assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            assert torch.equal(tensor, state[f"model.layers.{i}.{name}"]), (i, field)


def test_qkv_and_gate_up_are_fused_at_load(tiny_dir):
    """One [q; k; v] and one [gate; up] weight per layer (one GEMM each); the per-projection names are views of
    them, not copies."""
    cfg = Qwen3ModelConfig.from_model_dir(tiny_dir)
    weights = load_qwen3_weights(tiny_dir, cfg, dtype=torch.float32)
    state = Qwen3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    for i, layer in enumerate(weights.layers):
        hf = lambda field: state[f"model.layers.{i}.{HF_NAMES[field]}"]  # noqa: E731
        assert torch.equal(layer.qkv_proj, torch.cat([hf("q_proj"), hf("k_proj"), hf("v_proj")]))
        assert torch.equal(layer.gate_up_proj, torch.cat([hf("gate_proj"), hf("up_proj")]))
        assert layer.qkv_proj.is_contiguous() and layer.gate_up_proj.is_contiguous()
        for part, fused in (("q_proj", "qkv_proj"), ("v_proj", "qkv_proj"), ("up_proj", "gate_up_proj")):
            assert getattr(layer, part).untyped_storage().data_ptr() == getattr(layer, fused).data_ptr(), part
        assert sorted(vars(layer)) == sorted(["input_norm", "qkv_proj", "o_proj", "q_norm", "k_norm", "post_norm",
                                              "gate_up_proj", "down_proj", "qkv_t", "o_t", "gate_up_t",
                                              "down_t"])  # fmt: skip
        for name in ("qkv", "o", "gate_up", "down"):  # the [in, out] views for torch.mm: no copies either
            weight, transposed = getattr(layer, f"{name}_proj"), getattr(layer, f"{name}_t")
            assert transposed.data_ptr() == weight.data_ptr() and torch.equal(transposed, weight.t()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dtype_cast(tiny_dir, dtype):
    cfg = Qwen3ModelConfig.from_model_dir(tiny_dir)
    full = load_qwen3_weights(tiny_dir, cfg, dtype=torch.float32)
    cast = load_qwen3_weights(tiny_dir, cfg, dtype=dtype)
    assert cast.embed.dtype == dtype and cast.layers[1].down_proj.dtype == dtype
    assert torch.equal(cast.layers[0].q_proj, full.layers[0].q_proj.to(dtype))


def test_tied_embeddings(tmp_path):
    model_dir = make_tiny_qwen3(tmp_path / "tied", num_hidden_layers=1, tie_word_embeddings=True)
    cfg = Qwen3ModelConfig.from_model_dir(model_dir)
    assert cfg.tie_word_embeddings
    weights = load_qwen3_weights(model_dir, cfg, dtype=torch.float32)
    assert weights.lm_head is weights.embed
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert torch.equal(weights.lm_head, hf.lm_head.weight)


@pytest.mark.parametrize("stored", ["equal", "different"])
def test_tied_config_with_a_stored_lm_head(model_copy, caplog, stored):
    """tie_word_embeddings with an lm_head.weight in the files: one shared tensor when it equals the embedding;
    else the stored head, as transformers loads it, with one warning (every tensor-parallel rank alike)."""
    from lightllm.models.qwen3.tensor_parallel import shard_spec

    if stored == "equal":
        edit_tensors(model_copy, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    edit_config(model_copy, tie_word_embeddings=True)
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    hf = Qwen3ForCausalLM.from_pretrained(model_copy, dtype=torch.float32).lm_head.weight
    for shard in (None, shard_spec(cfg, 0, 2), shard_spec(cfg, 1, 2)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightllm.models.qwen3.weights"):
            weights = load_qwen3_weights(model_copy, cfg, dtype=torch.float32, shard=shard)
        assert torch.equal(weights.lm_head, hf)
        if stored == "equal":
            assert weights.lm_head is weights.embed and not caplog.records
        else:
            assert not torch.equal(weights.lm_head, weights.embed)
            [record] = caplog.records
            assert "tie_word_embeddings" in record.getMessage() and "lm_head.weight" in record.getMessage()


def test_tied_config_checks_a_stored_lm_head_shape(model_copy):
    edit_tensors(model_copy, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:, :8].contiguous()}))
    edit_config(model_copy, tie_word_embeddings=True)
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight has shape \[512, 8\], expected \[512, 48\]"):
        load_qwen3_weights(model_copy, Qwen3ModelConfig.from_model_dir(model_copy))


def test_sharded_checkpoint(model_copy, tiny_dir):
    tensors = load_file(model_copy / "model.safetensors")
    (model_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, model_copy / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in shard_names})
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    sharded = load_qwen3_weights(model_copy, cfg, dtype=torch.float32)
    single = load_qwen3_weights(tiny_dir, cfg, dtype=torch.float32)
    assert torch.equal(sharded.lm_head, single.lm_head)
    assert torch.equal(sharded.layers[1].v_proj, single.layers[1].v_proj)

    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_qwen3_weights(model_copy, cfg)


@pytest.mark.parametrize("name", [3, None, "..", "../model.safetensors", "sub/model.safetensors",
                                  "sub\\model.safetensors"])  # fmt: skip
def test_weight_map_entries_must_be_shard_file_names(model_copy, name):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "model.safetensors",
                                                "model.norm.weight": name}}))  # fmt: skip
    with pytest.raises(ModelLoadError) as err:
        load_qwen3_weights(model_copy, cfg)
    assert str(err.value) == (f"{index}: field 'weight_map' entry 'model.norm.weight' is {name!r}, expected the file "
                              "name of a shard in the model folder")  # fmt: skip


def test_a_missing_shard_is_named_as_the_index_writes_it(model_copy):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-1.safetensors "}}))
    with pytest.raises(ModelLoadError) as err:
        load_qwen3_weights(model_copy, cfg)
    assert str(err.value) == f"{index}: shard 'model-1.safetensors ' is listed but not found in {model_copy}"


def test_extra_tensors_warn(model_copy, caplog):
    def add_biases(tensors):
        for i in range(2):
            for proj in ("q", "k", "v", "o"):
                tensors[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.zeros(4)

    edit_tensors(model_copy, add_biases)
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    with caplog.at_level(logging.WARNING, logger="lightllm.models.qwen3.weights"):
        load_qwen3_weights(model_copy, cfg)
    [record] = caplog.records
    assert "8 tensors" in record.getMessage() and "and 3 more" in record.getMessage()
    assert "model.layers.0.self_attn.k_proj.bias" in record.getMessage()


# ---- config errors: each names the file and the field ----


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"hidden_size": _DELETE}, "hidden_size"),
        ({"num_hidden_layers": "two"}, "num_hidden_layers"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling.type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
        ({"eos_token_id": 100000}, "eos_token_id"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_config_errors(model_copy, changes, field):
    edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError) as err:
        Qwen3ModelConfig.from_model_dir(model_copy)
    msg = str(err.value)
    assert "\n" not in msg
    assert str(model_copy / "config.json") in msg and f"'{field}'" in msg


@pytest.mark.parametrize("changes, expected", [
    ({"partial_rotary_factor": 0.5}, "field 'partial_rotary_factor' is 0.5;"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "factor": 4.0}},
     "field 'rope_parameters.factor' is 4.0;"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "field 'rope_parameters.rope_type' is \"yarn\" (and 'rope_parameters.factor');"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "scaling.factor": 4.0}},
     "field 'rope_parameters.scaling.factor' is 4.0;"),
], ids=["top-level partial_rotary_factor", "extra key", "rope type", "a key with a dot"])  # fmt: skip
def test_rope_errors_name_the_keys_the_file_sets(model_copy, changes, expected):
    """transformers folds top-level rope fields into rope_parameters; the error names the one the file sets."""
    edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError) as err:
        Qwen3ModelConfig.from_model_dir(model_copy)
    assert str(err.value) == (f"{model_copy / 'config.json'}: {expected} only plain rope is supported: rope_type "
                              "'default' with rope_theta")  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_scaling": {}},
        {"rope_scaling": {"type": "default"}},
        {"rope_scaling": {"rope_type": "default"}},
        {"rope_parameters": {"type": "default", "rope_theta": 1e6}},
    ],
    ids=["empty rope_scaling", "old type key in rope_scaling", "rope_type key", "old type key in rope_parameters"],
)
def test_plain_rope_in_every_spelling_transformers_reads_is_plain_rope(model_copy, changes):
    """transformers reads each as plain rope (the old ``type`` key included): so does the engine, same theta."""
    from transformers import AutoConfig

    edit_config(model_copy, **changes)
    theta = AutoConfig.from_pretrained(model_copy).rope_parameters["rope_theta"]
    assert Qwen3ModelConfig.from_model_dir(model_copy).rope_theta == theta


@pytest.mark.parametrize("changes, expected", [
    ({"layer_types": ["full_attention"]}, "`num_hidden_layers` (2) must be equal to the number of `layer_types` (1)"),
    ({"model_type": "zzz"}, "has model type `zzz` but Transformers does not recognize this architecture."),
    ({"rms_norm_eps": "small"}, "Field 'rms_norm_eps' expected float, got str (value: 'small')"),
], ids=["layer_types length", "model_type", "rms_norm_eps type"])  # fmt: skip
def test_transformers_reads_the_config_and_its_errors_are_one_line(model_copy, changes, expected):
    """AutoConfig's own checks apply (they caught what ours let through); its multi-line errors become one line."""
    edit_config(model_copy, **changes)
    with pytest.raises(ModelLoadError) as err:
        Qwen3ModelConfig.from_model_dir(model_copy)
    msg = str(err.value)
    assert msg.startswith(f"{model_copy / 'config.json'}: transformers cannot read it: ") and "\n" not in msg
    assert expected in msg


def test_wrong_architecture_says_what_is_supported(model_copy):
    edit_config(model_copy, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM.*supported: Qwen3ForCausalLM"):
        Qwen3ModelConfig.from_model_dir(model_copy)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "llama"])
def test_model_type_must_be_qwen3(model_copy, model_type):
    """A Qwen3.5 (or any other) config named Qwen3ForCausalLM is refused naming model_type, not a later field."""
    edit_config(model_copy, model_type=model_type)
    with pytest.raises(ModelLoadError) as err:
        Qwen3ModelConfig.from_model_dir(model_copy)
    assert str(err.value) == (f"{model_copy / 'config.json'}: field 'model_type' is {model_type!r}, expected 'qwen3' "
                              "for Qwen3ForCausalLM")  # fmt: skip


def test_bad_json_and_missing_files(model_copy, tmp_path):
    with pytest.raises(ModelLoadError, match="model folder not found"):
        Qwen3ModelConfig.from_model_dir(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="config.json: is a file, not a model folder"):
        Qwen3ModelConfig.from_model_dir(model_copy / "config.json")
    (model_copy / "config.json").write_text('{"vocab_size": 512,')
    with pytest.raises(ModelLoadError, match=r"config\.json: invalid JSON"):
        Qwen3ModelConfig.from_model_dir(model_copy)
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        Qwen3ModelConfig.from_model_dir(model_copy)


# ---- weight errors: each names the tensor ----


def test_missing_tensor(model_copy):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    edit_tensors(model_copy, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight is missing"):
        load_qwen3_weights(model_copy, cfg)


def test_missing_tensor_names_the_unknown_ones(model_copy):
    """A misnamed tensor is the likely cause of a missing one: the error shows the names the model did not use."""
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)

    def misname(tensors):
        for i in range(4):
            tensors[f"z.{i}"] = torch.zeros(1)
        tensors["model.layers.0.self_attn.qproj.weight"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")

    edit_tensors(model_copy, misname)
    with pytest.raises(ModelLoadError) as err:
        load_qwen3_weights(model_copy, cfg)
    assert str(err.value) == (
        f"{model_copy}: tensor model.layers.0.self_attn.q_proj.weight is missing from the safetensors files; the "
        "files have unknown tensors: model.layers.0.self_attn.qproj.weight, z.0, z.1 (and 2 more)"
    )


def test_missing_lm_head_when_untied(model_copy):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    edit_tensors(model_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight is missing"):
        load_qwen3_weights(model_copy, cfg)


def test_shape_mismatch(model_copy):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)

    def transpose(tensors):
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name].t().contiguous()

    edit_tensors(model_copy, transpose)
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight has shape \[80, 48\], expected \[48, 80\]"):
        load_qwen3_weights(model_copy, cfg)


def test_quantized_checkpoint_is_refused(model_copy):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)

    def quantize(tensors):
        name = "model.layers.0.mlp.up_proj.weight"
        tensors[name] = tensors[name].to(torch.int8)

    edit_tensors(model_copy, quantize)
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight has dtype I8"):
        load_qwen3_weights(model_copy, cfg)


@pytest.mark.parametrize("quant", [{"quant_method": "gptq", "bits": 4}, {"quant_method": "fp8"}, "bnb"])
def test_a_quantization_config_is_refused_by_name(model_copy, quant):
    """Before the tensors: GPTQ's qweight/scales would say a tensor is missing, bitsandbytes' packed bytes a shape."""
    edit_config(model_copy, quantization_config=quant)
    with pytest.raises(ModelLoadError) as err:
        read_model_config(model_copy)
    method = f" (quant_method {quant['quant_method']!r})" if isinstance(quant, dict) else ""
    assert str(err.value) == (f"{model_copy / 'config.json'}: field 'quantization_config'{method}: quantized "
                              "checkpoints are not supported; only unquantized F16, BF16 or F32 weights "
                              "load")  # fmt: skip


def test_no_safetensors_and_bad_dtype(model_copy):
    cfg = Qwen3ModelConfig.from_model_dir(model_copy)
    with pytest.raises(ModelLoadError, match="int8"):
        load_qwen3_weights(model_copy, cfg, dtype=torch.int8)
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")  # not a real .bin: never opened
    with pytest.raises(ModelLoadError) as err:
        load_qwen3_weights(model_copy, cfg)
    assert str(err.value) == (f"{model_copy}: no *.safetensors files found (found PyTorch weights pytorch_model.bin, "
                              "which are not read: convert them to safetensors, e.g. with transformers' "
                              "save_pretrained)")  # fmt: skip
    (model_copy / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files found$"):
        load_qwen3_weights(model_copy, cfg)


def test_tensor_parallel_rank_reads_only_its_part(tiny_dir):
    from lightllm.models.qwen3.tensor_parallel import shard_spec

    tp = 2

    cfg = Qwen3ModelConfig.from_model_dir(tiny_dir)
    full = load_qwen3_weights(tiny_dir, cfg, dtype=torch.float32)
    d = cfg.head_dim
    q, kv, mlp = cfg.num_attention_heads * d // tp, cfg.num_key_value_heads * d // tp, cfg.intermediate_size // tp
    for rank in range(tp):
        part = load_qwen3_weights(tiny_dir, cfg, dtype=torch.float32, shard=shard_spec(cfg, rank, tp))
        for lf, lp in zip(full.layers, part.layers):
            rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
            for name, n in rows.items():
                assert torch.equal(getattr(lp, name), getattr(lf, name)[rank * n : (rank + 1) * n]), name
            # split by heads first, then fused: [this rank's q; its k; its v]
            shards = [getattr(lf, name)[rank * n : (rank + 1) * n] for name, n in rows.items()]
            assert torch.equal(lp.qkv_proj, torch.cat(shards[:3])) and torch.equal(
                lp.gate_up_proj, torch.cat(shards[3:])
            )
            assert torch.equal(lp.o_proj, lf.o_proj[:, rank * q : (rank + 1) * q])
            assert torch.equal(lp.down_proj, lf.down_proj[:, rank * mlp : (rank + 1) * mlp])
            for name in ("input_norm", "q_norm", "k_norm", "post_norm"):  # replicated
                assert torch.equal(getattr(lp, name), getattr(lf, name))
            assert all(t.is_contiguous() for name, t in vars(lp).items() if not name.endswith("_t"))  # _t: views
        assert torch.equal(part.embed, full.embed) and torch.equal(part.lm_head, full.lm_head)
    assert shard_spec(cfg, 0, 1) is None
