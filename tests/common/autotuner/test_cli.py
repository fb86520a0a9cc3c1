import json
import shutil

import pytest
from filelock import FileLock, Timeout

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


def test_list_empty_names_only_roots_that_exist(isolated_autotune, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no autotune configs: no config folder exists yet")
    assert str(store.SHIPPED_ROOT) not in out
    isolated_autotune.mkdir()
    assert cli.main(["list"]) == 0
    assert capsys.readouterr().out == f"no autotune configs under {isolated_autotune}\n"


def _write(root, kernel, name, payload, triton="triton_9.9.9", gpu="gpu_a"):
    path = root / triton / gpu / kernel / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


def test_list_counts_only_regular_files(isolated_autotune, capsys):
    _write(isolated_autotune, "k", "a.json", {"version": 1, "configs": {"1": None, "2": {"B": 1}}})
    (isolated_autotune / "triton_9.9.9" / "gpu_a" / "k" / "x.json").mkdir()
    _write(isolated_autotune, ".hidden", "a.json", {"version": 1, "configs": {"1": None}})  # no kernel's folder
    assert cli.main(["list"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert row.split() == ["k", "user", "triton_9.9.9", "gpu_a", "1", "2"]


def test_show_prints_only_times_the_store_accepts(isolated_autotune, capsys):
    timings = {
        "1": {"best_ms": 0.05, "default_ms": 0.1},
        "2": [0.05, 0.1],
        "3": {"best_ms": "fast", "default_ms": 0.1},
        "4": {"best_ms": -1, "default_ms": 0.1},
        "5": {"best_ms": 0.05, "default_ms": -1},
        "6": {"best_ms": 0.05, "default_ms": 0},
        "7": {"best_ms": True, "default_ms": 0.1},
        "9": {"best_ms": 0.05, "default_ms": 0.1, "cut": 1},
    }
    configs = {rk: {"B": int(rk)} for rk in timings}
    payload = json.dumps({"version": 1, "configs": configs, "timings": timings})
    _write(isolated_autotune, "k", "a.json", payload.replace('"default_ms": 0}', '"default_ms": Infinity}'))
    _write(isolated_autotune, "k", "b.json", {"version": 1, "configs": {"8": None}, "timings": [1, 2]})
    assert cli.main(["show", "k"]) == 0
    lines = [ln.strip() for ln in capsys.readouterr().out.splitlines() if "run key" in ln]
    assert lines == [
        "run key 1: {'B': 1}  0.0500 ms, 2.00x over default",
        "run key 2: {'B': 2}",
        "run key 3: {'B': 3}",
        "run key 4: {'B': 4}",
        "run key 5: {'B': 5}  0.0500 ms",
        "run key 6: {'B': 6}  0.0500 ms",
        "run key 7: {'B': 7}",
        "run key 9: {'B': 9}  0.0500 ms, 2.00x over default  (search cut short by the time budget: 1 in a row)",
        "run key 8: default",
    ]


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
    hint = ("decode_a also has 1 shipped config file, still read; to search their keys again, start at "
            "level 1 with LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED=decode_a")  # fmt: skip
    assert hint in out  # else a level-1 start after clear would search nothing
    assert cli.main(["clear", "decode_a"]) == 0
    out = capsys.readouterr().out
    assert "nothing to clear" in out and hint in out
    assert cli.main(["clear", "prefill_b"]) == 0
    assert "shipped config" not in capsys.readouterr().out


def test_clear_removes_every_folder_of_the_kernel_and_nothing_else(isolated_autotune, capsys, tmp_path):
    root = isolated_autotune
    _write(root, "k", "a.json", "{}")
    _write(root, "k", "b.json", "{}")
    (root / "triton_9.9.9" / "gpu_a" / "k" / "x.json").mkdir()  # a folder, not a config file
    _write(root, "k", "a.json", "{}", triton="triton_1.0.0", gpu="gpu_b")
    keep = [
        _write(root, "k2", "a.json", "{}"),
        _write(root, "k", "a.json", "{}", triton="not_triton"),
        _write(root, "gpu_c", "k", "{}"),  # a file named like the kernel: triton_9.9.9/gpu_c/k
        _write(tmp_path / "elsewhere", "k", "a.json", "{}"),
    ]
    (root / "triton_9.9.9" / "gpu_d").mkdir()
    (root / "triton_9.9.9" / "gpu_d" / "k").symlink_to(tmp_path / "elsewhere" / "triton_9.9.9" / "gpu_a" / "k")
    assert cli.main(["clear", "k"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"removed {root / 'triton_1.0.0' / 'gpu_b' / 'k'} (1 config files)",
        f"removed {root / 'triton_9.9.9' / 'gpu_a' / 'k'} (2 config files)",
        f"skipped {root / 'triton_9.9.9' / 'gpu_d' / 'k'}: reached through a link, not a folder of the config root; "
        "remove it yourself",
    ]
    assert all(path.read_text() == "{}" for path in keep)
    assert not (root / "triton_9.9.9" / "gpu_a" / "k").exists() and not (root / "triton_1.0.0" / "gpu_b" / "k").exists()


def test_clear_never_removes_through_a_linked_folder_above_the_kernel(isolated_autotune, capsys, tmp_path):
    """A triton_* or GPU folder that is a link (to elsewhere, or into the shipped configs): its kernel folders are
    outside the config root."""
    root = isolated_autotune
    elsewhere = _write(tmp_path / "elsewhere", "k", "a.json", "{}")
    shipped = _write(store.SHIPPED_ROOT, "k", "a.json", "{}", gpu="gpu_s")
    root.mkdir()
    (root / "triton_9.9.9").symlink_to(tmp_path / "elsewhere" / "triton_9.9.9")
    (root / "triton_1.0.0").mkdir()
    (root / "triton_1.0.0" / "gpu_s").symlink_to(shipped.parent.parent)
    assert cli.main(["clear", "k"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 2 and "removed" not in out
    assert elsewhere.read_text() == "{}" and shipped.read_text() == "{}"


def test_clear_refuses_a_user_root_inside_the_shipped_configs(monkeypatch, capsys):
    shipped = _write(store.SHIPPED_ROOT, "k", "a.json", "{}")
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", str(store.SHIPPED_ROOT))
    assert cli.main(["clear", "k"]) == 2
    assert capsys.readouterr().err.startswith("error: LIGHTLLM_AUTOTUNE_CONFIG_DIR=")
    assert shipped.exists()


def _all_files(*roots):
    return sorted(str(p) for root in roots for p in root.rglob("*"))


@pytest.mark.parametrize("command", ["clear", "show"])
@pytest.mark.parametrize("name", [".", "..", "../x", "a/b", "/abs", ".hidden", "*", "dec*", "k?", "[ab]", "a\\b", ""])
def test_names_that_are_not_one_kernel_folder_exit_2(two_kernels, capsys, command, name):
    before = _all_files(two_kernels, store.SHIPPED_ROOT)
    assert cli.main([command, name]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: autotune kernel_name {name!r} is not allowed;")
    assert captured.err.count("\n") == 1
    assert _all_files(two_kernels, store.SHIPPED_ROOT) == before


def test_store_refuses_the_same_names():
    for name in (".", "..", "a/b", ".x", "k*"):
        with pytest.raises(ValueError, match="kernel_name"):
            store.ConfigStore(name)
        with pytest.raises(ValueError, match="kernel_name"):
            list(store.iter_config_files(store.SHIPPED_ROOT, name))


def test_bad_env_is_one_line(monkeypatch, capsys, tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", str(f))
    assert cli.main(["list"]) == 2
    assert capsys.readouterr().err.startswith("error: LIGHTLLM_AUTOTUNE_CONFIG_DIR=")


def test_export_writes_the_shipped_layout_and_merges(two_kernels, tmp_path, capsys, monkeypatch):
    dest = tmp_path / "ship"
    rel = store.ConfigStore("decode_a").path(two_kernels, freeze({"d": 128})).relative_to(two_kernels)
    (dest / rel).parent.mkdir(parents=True)
    (dest / rel).write_text(json.dumps({"version": 1, "configs": {"8": {"BLOCK_N": 16}, "16": {"BLOCK_N": 32}}}))
    assert cli.main(["export", str(dest), "--kernel", "decode_a"]) == 0
    assert "exported 2 config files (2 run keys)" in capsys.readouterr().out
    merged = store.read_config_file(dest / rel)
    assert merged["configs"] == {"16": {"BLOCK_N": 32}, "8": {"BLOCK_N": 64}}  # the exported key wins, others kept
    assert merged["timings"]["8"]["best_ms"] == 0.05
    assert not list(dest.glob("**/prefill_b"))  # --kernel filters
    # what export wrote is what the store reads when dest is the shipped root (and the user root is gone)
    shutil.rmtree(two_kernels)
    monkeypatch.setattr(store, "SHIPPED_ROOT", dest)
    config, path = store.ConfigStore("decode_a").load_entries(freeze({"d": 256}))[8]
    assert config is None and dest in path.parents


def test_export_leaves_a_destination_file_it_cannot_read_as_it_is(two_kernels, tmp_path, capsys):
    """Merging into a file the store cannot read would drop its keys: that file is left alone, the others are
    exported, and the exit status is 1."""
    dest = tmp_path / "ship"
    rel = store.ConfigStore("decode_a").path(two_kernels, freeze({"d": 128})).relative_to(two_kernels)
    (dest / rel).parent.mkdir(parents=True)
    bad = json.dumps({"version": 1, "configs": {"1": {"BLOCK_N": 16}, "7": {"BLOCK_N": [1]}}})
    (dest / rel).write_text(bad)
    assert cli.main(["export", str(dest), "--kernel", "decode_a"]) == 1
    captured = capsys.readouterr()
    assert f"error: {dest / rel} exists and cannot be read" in captured.err
    assert "exported 1 config files (1 run keys)" in captured.out
    assert (dest / rel).read_text() == bad


def test_export_replaces_a_key_the_destination_spelled_otherwise(two_kernels, tmp_path, capsys):
    dest = tmp_path / "ship"
    rel = store.ConfigStore("decode_a").path(two_kernels, freeze({"d": 128})).relative_to(two_kernels)
    (dest / rel).parent.mkdir(parents=True)
    (dest / rel).write_text(json.dumps({"version": 1, "configs": {"8.0": {"BLOCK_N": 16}, "2": {"BLOCK_N": 16}}}))
    assert cli.main(["export", str(dest), "--kernel", "decode_a"]) == 0
    assert store.read_config_file(dest / rel)["configs"] == {"2": {"BLOCK_N": 16}, "8": {"BLOCK_N": 64}}


def test_export_refuses_the_writable_root_and_an_empty_export(isolated_autotune, capsys):
    assert cli.main(["export", str(isolated_autotune)]) == 2
    assert "is the writable root itself" in capsys.readouterr().err
    assert cli.main(["export", str(isolated_autotune.parent / "x")]) == 1
    assert "nothing to export" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["empty", "a file", "under a file"])
def test_export_refuses_a_dir_that_is_no_folder(two_kernels, tmp_path, capsys, monkeypatch, where):
    """An empty DIR (an unset shell variable) would export into the current folder; a file, or a path under one,
    cannot hold the layout. Each is one error line naming DIR, status 2, nothing written."""
    f = tmp_path / "f"
    f.write_text("x")
    monkeypatch.chdir(tmp_path)
    arg = {"empty": "", "a file": str(f), "under a file": str(f / "sub")}[where]
    assert cli.main(["export", arg]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: export DIR {arg!r} ") and len(captured.err.splitlines()) == 1
    assert "expected a folder" in captured.err and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["autotune", "f", "shipped"] and f.read_text() == "x"


def test_export_merges_under_the_lock_the_store_writers_take(two_kernels, tmp_path, capsys, monkeypatch):
    """Two exports into one folder, or one into a folder that is a server's config root, must not drop each other's
    keys: the read-merge-write of each file holds ``FILE.lock``, as the store's own writers do."""
    dest = tmp_path / "ship"
    seen = []
    merged = cli._merged

    def merged_and_checked(path, src):
        try:
            with FileLock(str(path) + ".lock", timeout=0):  # another open of the lock file: refused while held
                seen.append("free")
        except Timeout:
            seen.append("held")
        return merged(path, src)

    monkeypatch.setattr(cli, "_merged", merged_and_checked)
    assert cli.main(["export", str(dest), "--kernel", "decode_a"]) == 0
    assert seen == ["held", "held"]


def test_export_skips_a_file_another_writer_keeps_locked(two_kernels, tmp_path, capsys, monkeypatch):
    dest = tmp_path / "ship"
    rel = store.ConfigStore("decode_a").path(two_kernels, freeze({"d": 128})).relative_to(two_kernels)
    (dest / rel).parent.mkdir(parents=True)
    monkeypatch.setattr(store, "LOCK_TIMEOUT_S", 0.0)
    with FileLock(str(dest / rel) + ".lock"):
        assert cli.main(["export", str(dest), "--kernel", "decode_a"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {dest / rel} stayed locked for 0 s") and len(captured.err.splitlines()) == 1
    assert "exported 1 config files (1 run keys)" in captured.out and not (dest / rel).exists()
