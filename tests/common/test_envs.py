import os
import re
from pathlib import Path

import pytest

from lightllm.common import envs


def test_defaults():
    assert envs.get_triton_autotune_level() == 0
    assert envs.get_decode_attn_autotune_seq_len() == 32768
    assert envs.get_autotune_max_seconds_per_search() == 30.0
    envs.validate_all()


def test_default_config_dir(monkeypatch):
    monkeypatch.delenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR")
    assert envs.get_autotune_config_dir() == Path.home() / ".cache" / "lightllm" / "autotune"


def test_the_config_dir_and_the_level_are_read_without_surrounding_spaces(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", f"  {tmp_path} ")
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", " 1 ")
    assert envs.get_autotune_config_dir() == tmp_path and envs.get_triton_autotune_level() == 1


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "4", r"LIGHTLLM_TRITON_AUTOTUNE_LEVEL='4' is not allowed; use one of 0"),
        (
            "LIGHTLLM_TRITON_AUTOTUNE_LEVEL",
            "fast",
            r"LIGHTLLM_TRITON_AUTOTUNE_LEVEL='fast' is not allowed; use one of 0",
        ),
        ("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1.0", r"LIGHTLLM_TRITON_AUTOTUNE_LEVEL='1.0' is not allowed; use one of 0"),
        ("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "\u0662", r"LIGHTLLM_TRITON_AUTOTUNE_LEVEL='\u0662' is not allowed"),
        ("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "0", r"LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN='0' must be a positive"),
        (
            "LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN",
            "-8",
            r"LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN='-8' must be a positive",
        ),
        (
            "LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN",
            "32k",
            r"LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN='32k' is not an integer",
        ),
        (
            "LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN",
            "1.5",
            r"LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN='1.5' is not an integer",
        ),
        # int() and float() take these; the level's parser already did not
        ("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "32_768", r"AUTOTUNE_SEQ_LEN='32_768' is not an integer"),
        ("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "+4096", r"AUTOTUNE_SEQ_LEN='\+4096' is not an integer"),
        ("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "\u0663\u0662", r"AUTOTUNE_SEQ_LEN='\u0663\u0662' is not an integer"),
        ("LIGHTLLM_AUTOTUNE_COMPILE_THREADS", "1_6", r"LIGHTLLM_AUTOTUNE_COMPILE_THREADS='1_6' is not an integer"),
        ("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "1_0", r"LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH='1_0' is not a"),
        ("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "\u0663", r"LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH='\u0663' is"),
        ("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "0", r"LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH='0' must be"),
        ("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "nan", r"LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH='nan' must be"),
        ("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "x", r"LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH='x' is not a"),
        (
            "LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED",
            "rmsnorm;silu_mul",
            r"LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED='rmsnorm;silu_mul' is",
        ),
        ("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", "RMSNorm", r"LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED='RMSNorm' is not allowed"),
        ("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", "all,rmsnorm", r"IGNORE_SHIPPED='all,rmsnorm' is not allowed; use tuned"),
    ],
)
def test_bad_values_name_variable_and_value(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        envs.validate_all()


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "32k", "use a positive integer"),
        ("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "30s", "use a positive, finite number of seconds"),
    ],
)
def test_a_value_that_does_not_parse_says_what_is_allowed(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        envs.validate_all()
    assert str(e.value).startswith(f"{name}={value!r} ") and allowed in str(e.value) and "\n" not in str(e.value)


def test_config_dir_must_not_be_a_file(monkeypatch, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", str(f))
    with pytest.raises(ValueError, match="LIGHTLLM_AUTOTUNE_CONFIG_DIR=.* is not a directory"):
        envs.validate_all()


@pytest.mark.parametrize("name", ["LIGHTLLM_AUTOTUNE_CONFIG_DIR", "LIGHTLLM_TINY_MODEL_DIR"])
@pytest.mark.parametrize("where", ["under a file", "an unknown user's home", "a file"])
def test_path_variables_must_name_a_folder_that_can_be_created(monkeypatch, tmp_path, name, where):
    f = tmp_path / "file"
    f.write_text("x")
    value, why = {
        "under a file": (f"{f}/sub", f"{f} is a file"),
        "an unknown user's home": ("~lightllm-no-such-user/x", "Could not determine home directory"),
        "a file": (str(f), None),
    }[where]
    monkeypatch.setenv(name, value)
    problem = f"must be a folder that can be created and written: {why}" if why else "exists and is not a directory"
    message = f"{name}={value!r} {problem}"
    with pytest.raises(ValueError, match=re.escape(message)):
        envs.validate_all()


def test_tiny_model_dir_is_read_without_surrounding_spaces(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTLLM_TINY_MODEL_DIR", f"  {tmp_path / 'new' / 'tiny'} ")
    assert envs.get_tiny_model_dir() == tmp_path / "new" / "tiny"


def test_valid_values_parse(monkeypatch):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", " 2 ")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "8192")
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH", "2.5")
    assert envs.get_triton_autotune_level() == 2
    assert envs.get_decode_attn_autotune_seq_len() == 8192
    assert envs.get_autotune_max_seconds_per_search() == 2.5


def test_ignored_shipped_kernels_are_a_comma_separated_set(monkeypatch):
    assert envs.get_autotune_ignore_shipped() == frozenset()
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", " gqa_flash_decode_int8kv, gqa_flash_decode_int4kv ,")
    assert envs.get_autotune_ignore_shipped() == {"gqa_flash_decode_int8kv", "gqa_flash_decode_int4kv"}
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", "all")
    assert envs.get_autotune_ignore_shipped() == {"all"}


def test_all_names_every_variable():
    defined = {v for k, v in vars(envs).items() if k.isupper() and isinstance(v, str) and v.startswith("LIGHTLLM_")}
    assert set(envs.ALL) == defined and len(envs.ALL) == len(defined)


def test_tests_start_from_a_clean_environment(isolated_autotune, tiny_model_home):
    """Whatever the caller exported (e.g. LIGHTLLM_AUTOTUNE_CHOICE_RULE=tuning_len), every variable is unset here but
    the two roots the fixture points into temporary folders; and the search budget cannot run out."""
    from lightllm.common.autotuner import tuner

    assert {name: os.environ.get(name) for name in envs.ALL} == {
        **dict.fromkeys(envs.ALL),
        envs.AUTOTUNE_CONFIG_DIR: str(isolated_autotune),
        envs.TINY_MODEL_DIR: str(tiny_model_home),
    }
    assert tuner.search_clock() == tuner.search_clock() == 0.0


def test_ignored_shipped_kernels_must_ship_configs(monkeypatch, isolated_autotune):
    """A typo ignores nothing (the kernel meant keeps its shipped configs): start-up stops naming it."""
    from lightllm.common.autotuner import store

    (store.SHIPPED_ROOT / "triton_3.6.0" / "NVIDIA_H200" / "gqa_flash_decode_int8kv").mkdir(parents=True)
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", "gqa_flash_decode_int8kv")
    envs.validate_all()
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", "gqa_flash_decode_int8,gqa_flash_decode_int8kv")
    with pytest.raises(ValueError) as e:
        envs.validate_all()
    assert str(e.value) == ("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED='gqa_flash_decode_int8,gqa_flash_decode_int8kv' is not "
                            "allowed: no configs ship for gqa_flash_decode_int8; use all or kernels that have some "
                            "(gqa_flash_decode_int8kv)")  # fmt: skip
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", "all")
    envs.validate_all()
