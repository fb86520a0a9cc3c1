import json

import pytest

from lightllm.common.autotuner import __main__ as cli
from lightllm.common.autotuner import store
from lightllm.common.autotuner.keys import freeze


def _save(kernel, static, entries):
    return store.ConfigStore(kernel).save(static, freeze(static), entries)


@pytest.fixture
def two_kernels(isolated_autotune):
    _save("decode_a", {"d": 128}, {8: ({"BLOCK_N": 64}, {"best_ms": 0.05, "default_ms": 0.1, "candidates": 9})})
    _save("decode_a", {"d": 256}, {8: (None, {"best_ms": 0.2, "default_ms": 0.2, "candidates": 9})})
    _save("prefill_b", {"d": 128}, {1024: ({"BLOCK_M": 128}, {"best_ms": 1.0, "default_ms": 1.0, "candidates": 3})})
    shipped = store.ConfigStore("decode_a").path(store.SHIPPED_ROOT, freeze({"d": 64}))
    shipped.parent.mkdir(parents=True)
    shipped.write_text(json.dumps({"version": 1, "configs": {"1": {"BLOCK_N": 16}}}))
    return isolated_autotune


def test_list(two_kernels, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]): line.split()[-2:] for line in out[1:]}
    assert rows == {
        ("decode_a", "shipped"): ["1", "1"],
        ("decode_a", "user"): ["2", "2"],
        ("prefill_b", "user"): ["1", "1"],
    }


def test_list_empty(capsys):
    assert cli.main(["list"]) == 0
    assert "no autotune configs" in capsys.readouterr().out


def test_show(two_kernels, capsys):
    assert cli.main(["show", "decode_a"]) == 0
    out = capsys.readouterr().out
    assert "run key 8: {'BLOCK_N': 64}  0.0500 ms, 2.00x over default" in out
    assert "run key 8: default" in out and "[shipped]" in out and "[user]" in out
    assert cli.main(["show", "nope"]) == 1


def test_clear_touches_only_writable_root(two_kernels, capsys):
    assert cli.main(["clear", "decode_a"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "(2 config files)" in out
    assert not list(store.iter_config_files(two_kernels, "decode_a"))
    assert list(store.iter_config_files(two_kernels, "prefill_b"))
    assert list(store.iter_config_files(store.SHIPPED_ROOT, "decode_a"))
    assert cli.main(["clear", "decode_a"]) == 0
    assert "nothing to clear" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["*", "../x", "a/b"])
def test_clear_rejects_globs_and_paths(two_kernels, capsys, name):
    assert cli.main(["clear", name]) == 2
    assert "kernel_name" in capsys.readouterr().err
    assert list(store.iter_config_files(two_kernels))


def test_bad_env_is_one_line(monkeypatch, capsys, tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", str(f))
    assert cli.main(["list"]) == 2
    assert capsys.readouterr().err.startswith("error: LIGHTLLM_AUTOTUNE_CONFIG_DIR=")
