import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightllm.common import proc
from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, store

GENERAL = AutotuneKernelType.GENERAL
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run_python(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    # no search may run out of budget on a busy machine
    env = {**os.environ, "LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH": "1e9", **env_extra, "PYTHONPATH": REPO}
    return proc.run([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=proc.HANG_TIMEOUT_S)


_TUNE_SCRIPT = """
    import json, torch
    from lightllm.common.autotuner import AutotuneKernelType, autotune, autotune_warmup, set_bench_func

    timed = []
    @autotune("persist_test", lambda: [{"ms": 0.4}, {"ms": 0.1}], lambda x: x.shape[1], lambda x: x.shape[0])
    def k(x, run_config=None):
        k.last = run_config
        return x * 2

    def bench(run):
        run()
        timed.append(k.last)
        return 1.0 if k.last is None else k.last["ms"]

    set_bench_func(bench)
    with autotune_warmup(AutotuneKernelType.GENERAL):
        k(torch.ones(8, 4))
    print(json.dumps({"timed": len(timed), "used": k.last}))
"""


def test_configs_persist_across_processes(isolated_autotune):
    env = {"LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(isolated_autotune), "LIGHTLLM_TRITON_AUTOTUNE_LEVEL": "1"}
    first = _run_python(_TUNE_SCRIPT, env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1]) == {"timed": 6, "used": {"ms": 0.1}}
    second = _run_python(_TUNE_SCRIPT, env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.splitlines()[-1]) == {"timed": 0, "used": {"ms": 0.1}}


_WRITER_SCRIPT = """
    import sys
    from lightllm.common.autotuner.keys import freeze
    from lightllm.common.autotuner.store import ConfigStore

    worker, count = int(sys.argv[1]), int(sys.argv[2])
    s = ConfigStore("concurrent_test")
    static = {"d": 128}
    for i in range(count):
        path = s.save(static, freeze(static), {(worker, i): ({"BLOCK": i, "w": worker}, {"best_ms": 0.1})})
        assert path is not None
"""


def test_many_processes_writing_one_kernel_lose_nothing(isolated_autotune):
    workers, count = 4, 25
    env = {**os.environ, "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(isolated_autotune), "PYTHONPATH": REPO}
    cmds = [[sys.executable, "-c", textwrap.dedent(_WRITER_SCRIPT), str(w), str(count)] for w in range(workers)]
    for code, out in proc.run_all(cmds, env=env):
        assert code == 0, out
    files = list(store.iter_config_files(isolated_autotune, "concurrent_test"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())  # valid JSON
    expected = {
        json.dumps([w, i], separators=(",", ":")): {"BLOCK": i, "w": w} for w in range(workers) for i in range(count)
    }
    assert data["configs"] == expected
    assert not [p for p in files[0].parent.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "\xff\xfe garbage",
        "[1, 2, 3]",
        '{"version": 99, "configs": {}}',
        '{"version": 1, "configs": []}',
        '{"version": 1, "configs": {"8": [1, 2]}}',
        '{"version": 1, "configs": {"not json": {}}}',
        '{"version": 1, "configs": {"8": {"BLOCK": {"nested": 1}}}}',
        '{"version": 1, "configs": {}, "timings": ' + "[" * 100000 + "]" * 100000 + "}",  # RecursionError
        '{"version": 1, "configs": {"' + "9" * 5000 + '": null}}',  # an int past Python's 4300-digit limit
        '{"version": 1, "configs": {"8": {"ms": ' + "1" * 5000 + "}}}",
    ],
    ids=["not-json", "not-utf8", "a-list", "version", "configs-list", "config-list", "key-not-json", "nested",
         "deep", "huge-key", "huge-value"],  # fmt: skip
)
def test_corrupt_file_is_a_warning_and_a_miss(toy, monkeypatch, caplog, isolated_autotune, content):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    t = toy()
    path = store.ConfigStore(t.name).path(isolated_autotune, (("alpha", 2.0), ("dtype", "torch.float32")))
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("utf-8", "surrogateescape") if "\xff" not in content else b"\xff\xfe garbage")
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        t(n=8)  # level 1 outside warmup: a cache miss, launcher default
        assert t.configs_used() == [None]
        with autotune_warmup(GENERAL):
            t(n=8)  # searches, then overwrites the bad file with a good one
    warnings = [r for r in caplog.records if "ignored" in r.getMessage() and str(path) in r.getMessage()]
    assert len(warnings) == 1
    assert json.loads(path.read_text())["configs"] == {"8": {"ms": 0.2}}


def test_a_malformed_entry_is_left_out_and_the_files_other_entries_kept(caplog, isolated_autotune):
    """One bad entry (a hand edit, a truncated key) costs only its own run key: the other entries load, one warning
    names the bad one (shortened), and the next save writes the good ones back without it."""
    s = store.ConfigStore("k")
    frozen = (("d", 1),)
    path = s.path(isolated_autotune, frozen)
    path.parent.mkdir(parents=True)
    huge = "9" * 5000
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "configs": {"4": {"B": 1}, "8": [1, 2], "16": {"B": 2}, "x": None},
                "timings": {"4": {"best_ms": 1.0}, "8": {"best_ms": 1.0}},
            }
        ).replace('"x"', f'"{huge}"')
    )
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        assert s.load(frozen) == {4: {"B": 1}, 16: {"B": 2}}
        assert s.load(frozen) == {4: {"B": 1}, 16: {"B": 2}}
    warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warnings) == 1 and "2 of its 4 entries ignored" in warnings[0], warnings
    assert "8: not an object" in warnings[0] and "(5000 characters)" in warnings[0] and huge not in warnings[0]
    s.save({"d": 1}, frozen, {32: ({"B": 3}, {"best_ms": 0.5})})
    data = json.loads(path.read_text())
    assert data["configs"] == {"16": {"B": 2}, "32": {"B": 3}, "4": {"B": 1}}
    assert set(data["timings"]) == {"4", "32"}


def test_run_keys_and_times_beyond_a_float_are_left_out(caplog, tmp_path):
    """A hand-edited number too large for a float (valid JSON, under Python's digit limit) or not finite: its entry
    is a malformed one (nearest-key distances are floats and would overflow on it while serving), and such a time
    is dropped by ``read_timings`` (``show`` and the benchmarks read it), as a negative one is."""
    huge = "1" + "0" * 400
    path = tmp_path / "k.json"
    keys = {"8": {"B": 1}, f"[8, {huge}]": {"B": 2}, f"{huge}.5": {"B": 3}, "NaN": {"B": 4}, "[1, -Infinity]": {"B": 5}}
    timings = {"8": {"best_ms": int(huge), "default_ms": 2.0}}
    path.write_text(json.dumps({"version": 1, "configs": keys, "timings": timings}))
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        data = store.read_config_file(path)
    assert data["configs"] == {"8": {"B": 1}}
    (warning,) = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert "4 of its 5 entries ignored" in warning and "not a finite float" in warning
    assert store.read_timings(data) == {"8": {"default_ms": 2.0}}


def test_a_new_search_replaces_its_key_however_the_file_spelled_it(isolated_autotune):
    """A hand-written "4.0" is run key 4: the search's "4" replaces it (both in the file, the sorted-later "4.0"
    would win at load)."""
    s = store.ConfigStore("k")
    frozen = (("d", 1),)
    path = s.path(isolated_autotune, frozen)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "configs": {"4.0": {"B": 1}, "8": {"B": 1}},
                                "timings": {"4.0": {"best_ms": 1.0}, "8": {"best_ms": 1.0}}}))  # fmt: skip
    s.save({"d": 1}, frozen, {4: ({"B": 2}, {"best_ms": 0.5})})
    data = json.loads(path.read_text())
    assert data["configs"] == {"4": {"B": 2}, "8": {"B": 1}} and set(data["timings"]) == {"4", "8"}
    assert s.load(frozen) == {4: {"B": 2}, 8: {"B": 1}}


def _shipped_and_user_configs(toy, user_root):
    """A toy kernel with configs for run keys 4 and 8 shipped and for 8 in the user root: (toy, store, frozen key)."""
    t = toy()
    frozen = (("alpha", 2.0), ("dtype", "torch.float32"))
    s = store.ConfigStore(t.name)
    for root, configs in ((store.SHIPPED_ROOT, {"4": {"ms": 0.5}, "8": {"ms": 0.9}}), (user_root, {"8": {"ms": 0.2}})):
        p = s.path(root, frozen)
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps({"version": 1, "configs": configs}))
    return t, s, frozen


def test_shipped_configs_are_read_and_user_root_wins(toy, isolated_autotune, tmp_path):
    t, _, _ = _shipped_and_user_configs(toy, isolated_autotune)
    t(n=4)
    t(n=8)
    assert t.configs_used() == [{"ms": 0.5}, {"ms": 0.2}]


@pytest.mark.parametrize("ignored", ["all", "other_kernel,{name}"])
def test_ignored_shipped_configs_are_searched_again_at_level_1(toy, monkeypatch, isolated_autotune, ignored):
    """LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED naming the kernel (or all): its shipped keys are misses, so level 1 searches
    them (a re-tune after a kernel change) and the user root's configs are still read."""
    t, s, frozen = _shipped_and_user_configs(toy, isolated_autotune)
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED", ignored.format(name=t.name))
    assert s.load(frozen) == {8: {"ms": 0.2}}
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    with autotune_warmup(GENERAL):
        t(n=4)
    assert {cfg["ms"] for cfg in t.bench.timed if cfg} == {0.2, 0.5, 0.9}  # searched, not read from shipped
    monkeypatch.delenv("LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED")
    assert s.load(frozen) == {4: {"ms": 0.2}, 8: {"ms": 0.2}}  # the search's config over the shipped one


def test_writes_go_only_to_user_root(toy, monkeypatch, isolated_autotune):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    t = toy()
    with autotune_warmup(GENERAL):
        t(n=4)
    assert list(store.iter_config_files(isolated_autotune, t.name))
    assert not list(store.iter_config_files(store.SHIPPED_ROOT, t.name))


def test_unwritable_path_keeps_config_in_memory(toy, monkeypatch, caplog, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(store, "triton_dir_name", lambda: "blocker")  # mkdir below a file fails for root too
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    t = toy()
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        with autotune_warmup(GENERAL):
            t(n=4)
            t(n=4)
    assert t.configs_used()[-2:] == [{"ms": 0.2}] * 2
    assert any("could not write" in r.getMessage() for r in caplog.records)


def test_file_layout_and_names(isolated_autotune):
    s = store.ConfigStore("layout_test")
    static = {"head_dim": 128, "dtype": torch.bfloat16}
    from lightllm.common.autotuner.keys import freeze

    path = s.save(static, freeze(static), {(8, 32768): ({"BLOCK_N": 64}, {"best_ms": 0.01})})
    rel = path.relative_to(isolated_autotune).parts
    assert rel[0].startswith("triton_") and rel[1] == store.device_dir_name() and rel[2] == "layout_test"
    assert rel[3] == "dtype=torch.bfloat16,head_dim=128.json"
    data = json.loads(path.read_text())
    assert data["configs"] == {"[8,32768]": {"BLOCK_N": 64}} and data["static_key"]["head_dim"] == 128
    assert s.load(freeze(static)) == {(8, 32768): {"BLOCK_N": 64}}
    long_key = {f"k{i}": "v" * 20 for i in range(20)}
    name = store.static_key_file_name(freeze(long_key))
    assert len(name) <= 170 and name.endswith(".json")
    assert name != store.static_key_file_name(freeze({**long_key, "k19": "w" * 20}))


def test_save_removes_stale_temp_files_of_its_own_file_only(isolated_autotune):
    """Writers make temp files only under the file's lock, so those found under it were left by dead writers.
    Other config files' temp files in the folder go too, unless their lock is held (a live writer)."""
    from filelock import FileLock

    from lightllm.common.autotuner.keys import freeze

    s = store.ConfigStore("stale_tmp")
    static = {"head_dim": 128}
    path = s.path(isolated_autotune, freeze(static))
    path.parent.mkdir(parents=True)
    stale = [path.parent / f".{path.name}.{rand}.tmp" for rand in ("a1b2c3d4", "zz_9y8x7", "q0w9e8r7")]
    dead_other = path.parent / ".head_dim=32.json.k9j8h7g6.tmp"  # its static key is never written again
    live_other = path.parent / ".head_dim=64.json.a1b2c3d4.tmp"
    for p in stale + [dead_other, live_other]:
        p.write_text('{"version": 1, "configs": {"1": {"BLOCK_N": 16}}')  # a half-written file
    with FileLock(str(path.parent / "head_dim=64.json.lock")):  # its writer is alive, writing it now
        assert s.save(static, freeze(static), {8: ({"BLOCK_N": 64}, {"best_ms": 0.01})}) == path
    assert sorted(p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")) == [live_other.name]
    assert json.loads(path.read_text())["configs"] == {"8": {"BLOCK_N": 64}}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_config_files_get_the_mode_of_a_plain_write(isolated_autotune, tmp_path, umask):
    """Written through a temp file, a config file still gets what ``open(path, "w")`` gives (0666 less the umask),
    not mkstemp's 0600: another user sharing the config root can read it, rather than find it unreadable (a miss)
    and replace it, losing its entries; an exported (shipped) file is readable by every user of the package."""
    from lightllm.common.autotuner import __main__ as cli
    from lightllm.common.autotuner.keys import freeze

    old = os.umask(umask)
    try:
        path = store.ConfigStore("mode_test").save({"d": 1}, freeze({"d": 1}), {8: ({"BLOCK_N": 64}, {})})
        assert cli.main(["export", str(tmp_path / "ship")]) == 0
    finally:
        os.umask(old)
    exported = tmp_path / "ship" / path.relative_to(isolated_autotune)
    assert [oct(p.stat().st_mode & 0o777) for p in (path, exported)] == [oct(0o666 & ~umask)] * 2
