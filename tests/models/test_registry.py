"""The registry maps config.json's ``architectures`` to a model family; the engine and the server start-up ask it."""

import json
import shutil

import pytest
import torch

from lightllm.models.hf_config import ModelLoadError
from lightllm.models.registry import SUPPORTED_ARCHITECTURES, family_for, model_family, read_model_config
from lightllm.server.args import parse_args
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "model", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def test_qwen3_architecture_finds_the_qwen3_family(tiny_dir):
    family, config = read_model_config(tiny_dir)
    assert family is family_for("Qwen3ForCausalLM") and family.name == "Qwen3"
    assert "Qwen3ForCausalLM" in SUPPORTED_ARCHITECTURES
    assert (config.max_position_embeddings, config.head_dim, config.num_hidden_layers) == (4096, 16, 2)
    assert family.kv_heads(config, 1) == 2 and family.kv_heads(config, 2) == 1


def test_family_builds_a_forward_module_for_its_rank(tiny_dir):
    family, config = read_model_config(tiny_dir)
    model = family.build(tiny_dir, config, torch.float32, torch.device("cpu"), tp_rank=1, tp=2)
    assert model.kv_heads == family.kv_heads(config, 2)
    assert model.w.layers[0].k_proj.shape == (config.head_dim, config.hidden_size)  # rank 1's one KV head
    with pytest.raises(RuntimeError, match="set_attention"):
        model.forward(torch.tensor([1]), None)


def test_first_supported_name_wins_and_model_type_stands_in(model_copy):
    edit_config(model_copy, architectures=["SomethingElse", "Qwen3ForCausalLM"])
    assert model_family(model_copy).name == "Qwen3"
    edit_config(model_copy, architectures=None)
    assert model_family(model_copy).name == "Qwen3"  # model_type "qwen3"


@pytest.mark.parametrize("archs, expected", [
    (["LlamaForCausalLM"], "field 'architectures' is ['LlamaForCausalLM'], not supported; supported: Qwen3ForCausalLM, "
                           "Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration"),
    ("Qwen3ForCausalLM", "field 'architectures' expected a list of names such as 'Qwen3ForCausalLM', got "
                         "'Qwen3ForCausalLM'"),
    ([], "field 'architectures' expected a list of names such as 'Qwen3ForCausalLM', got []"),
], ids=["unknown", "not a list", "empty"])  # fmt: skip
def test_unsupported_architecture_is_one_line_naming_it(model_copy, archs, expected):
    edit_config(model_copy, architectures=archs, model_type="llama")
    with pytest.raises(ModelLoadError) as err:
        model_family(model_copy)
    assert str(err.value) == f"{model_copy / 'config.json'}: {expected}"


def test_unknown_architecture_name():
    with pytest.raises(ModelLoadError, match=r"^architecture 'Qwen9ForCausalLM' is not supported; supported: Qwen3"):
        family_for("Qwen9ForCausalLM")


def test_server_start_up_asks_the_registry(model_copy, capsys):
    edit_config(model_copy, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(SystemExit) as done:
        parse_args(["--model_dir", str(model_copy), "--device", "cpu"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --model_dir expected a Hugging Face model folder of a supported architecture: ")
    assert "'LlamaForCausalLM'" in err and "supported: Qwen3ForCausalLM" in err
