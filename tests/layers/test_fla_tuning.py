"""fla-core's shipped configs: the autotune log they come from, the files fla-core's own lookup reads (in a child
process: fla-core reads ``FLA_CACHE_MODE`` once, when it is imported), and when the process is pointed at them."""

import json
import sys

import pytest

from lightllm.common import proc as procs
from lightllm.layers import fla_tuning

LOG = """\
Triton autotuning for function chunk_fwd_kernel_o,
with key as (16, 48, 128, 128, 64, False, 'torch.bfloat16', 'torch.int64'),
finished after 2.86s,
best config selected: BK: 64, BV: 64, num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None;
some other output
Triton autotuning for function chunk_fwd_kernel_o,
with key as (8, 24, 128, 128, 64, False, 'torch.bfloat16', 'torch.int64'),
finished after 2.01s,
best config selected: BK: 32, BV: 64, num_warps: 8, num_ctas: 1, num_stages: 2, maxnreg: None;
Triton autotuning for function chunk_local_cumsum_scalar_kernel,
with key as (1, 48, 64, True, False, 'torch.float32'),
finished after 0.93s,
best config selected: num_warps: 1, num_ctas: 1, num_stages: 3, maxnreg: None;
"""

LOOKUP = """
import json, os, sys
from fla.ops.utils.cache import AutotuneKey, load_cached_config
for folder, kernel, key in json.loads(sys.argv[1]):
    os.environ["FLA_CONFIG_DIR"] = folder  # read at each lookup
    print(json.dumps(load_cached_config(kernel, AutotuneKey(tuple(key)))))
"""


def fla_lookup(queries, mode="strict"):
    """What fla-core's own lookup returns for each ``(folder, kernel, key)`` with ``FLA_CONFIG_DIR`` = ``folder``,
    in one process (fla-core takes seconds to import)."""
    env = {"FLA_CACHE_MODE": mode, "PATH": "/usr/bin:/bin"}
    queries = [[str(folder), kernel, key] for folder, kernel, key in queries]
    return [json.loads(line) for line in child_output([sys.executable, "-c", LOOKUP, json.dumps(queries)], env)]


def child_output(cmd, env) -> list:
    """``cmd``'s stdout lines; its tree is stopped if it hangs, and a failure shows its stderr."""
    done = procs.run(cmd, timeout=procs.HANG_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_log_becomes_files_fla_core_reads_by_exact_key(tmp_path):
    entries = fla_tuning.parse_autotune_log(LOG)
    assert [len(entries[k]) for k in ("chunk_fwd_kernel_o", "chunk_local_cumsum_scalar_kernel")] == [2, 1]
    fla_tuning.write_configs(entries, tmp_path)
    o = ["chunk_fwd_kernel_o", [16, 48, 128, 128, 64, False, "torch.bfloat16", "torch.int64"]]
    o8 = ["chunk_fwd_kernel_o", [8, 24, 128, 128, 64, False, "torch.bfloat16", "torch.int64"]]
    other = ["chunk_fwd_kernel_o", [32, 48, 128, 128, 64, False, "torch.bfloat16", "torch.int64"]]
    cumsum = ["chunk_local_cumsum_scalar_kernel", [1, 48, 64, True, False, "torch.float32"]]
    missing = ["l2norm_fwd_kernel", [128, 1]]
    got = fla_lookup([(tmp_path, *q) for q in (o, o8, other, cumsum, missing)])
    assert got[0] == {"kwargs": {"BK": 64, "BV": 64}, "num_warps": 4, "num_ctas": 1, "num_stages": 3, "maxnreg": None}
    assert got[1]["kwargs"] == {"BK": 32, "BV": 64} and got[1]["num_warps"] == 8
    assert got[2] is None and got[4] is None  # another key or kernel: fla-core autotunes it as before
    assert got[3] == {"kwargs": {}, "num_warps": 1, "num_ctas": 1, "num_stages": 3, "maxnreg": None}
    # read only when FLA_CACHE_MODE asks: test_fla_core_imported_first_still_reads_them looks up first without it

    # written again: merged, not duplicated
    fla_tuning.write_configs(fla_tuning.parse_autotune_log(LOG), tmp_path)
    assert len(json.loads((tmp_path / "chunk_fwd_kernel_o.json").read_text())["autotune_entries"]) == 2


def test_every_shipped_config_is_what_fla_core_finds_for_its_key():
    folders = [p for p in fla_tuning.SHIPPED_ROOT.glob("triton_*/*") if p.is_dir()]
    queries, want = [], []
    for folder in folders:
        found = len(queries)
        for path in sorted(folder.glob("*.json")):
            for entry in json.loads(path.read_text())["autotune_entries"].values():
                queries.append((folder, path.stem, entry["autotune_key"]))
                want.append(entry["config"])
        assert len(queries) > found, f"{folder} ships no entry"
    assert len(folders) >= 2 and fla_lookup(queries) == want
    assert all(set(c) == {"kwargs", "num_warps", "num_ctas", "num_stages", "maxnreg"} for c in want)


@pytest.mark.parametrize("content, says", [("[1, 2]", r"'autotune_entries'.*got \[1, 2\]"),
                                           ('{"kernel_name": ', "invalid JSON")])  # fmt: skip
def test_a_file_it_cannot_merge_into_is_named(tmp_path, content, says):
    (tmp_path / "chunk_fwd_kernel_o.json").write_text(content)
    with pytest.raises(ValueError, match=rf"chunk_fwd_kernel_o.json expected fla-core's config JSON.*{says}.*fix or"):
        fla_tuning.write_configs(fla_tuning.parse_autotune_log(LOG), tmp_path)
    assert (tmp_path / "chunk_fwd_kernel_o.json").read_text() == content  # left as it was


def test_a_line_it_cannot_read_is_named():
    bad = LOG.replace("num_warps: 4", "num_warps: four")
    with pytest.raises(ValueError, match=r"autotune line of chunk_fwd_kernel_o expected a tuple key .*four"):
        fla_tuning.parse_autotune_log(bad)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not named fla-core's configs yet, whose GPU's shipped folder is ``tmp_path``."""
    monkeypatch.setattr(fla_tuning, "_done", False)
    monkeypatch.setattr(fla_tuning, "shipped_dir", lambda: tmp_path)
    monkeypatch.delitem(sys.modules, "fla.ops.utils.cache", raising=False)
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE"):  # set first, so the teardown removes what the test sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return tmp_path


def test_points_fla_core_at_the_gpus_folder_once(fresh, monkeypatch):
    import os

    assert fla_tuning.use_shipped_configs() == fresh
    assert (os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"]) == (str(fresh), "strict")
    monkeypatch.setenv("FLA_CONFIG_DIR", "/elsewhere")
    assert fla_tuning.use_shipped_configs() is None and os.environ["FLA_CONFIG_DIR"] == "/elsewhere"  # once


@pytest.mark.parametrize("why", ["user dir", "user mode", "no folder"])
def test_leaves_fla_core_alone(fresh, monkeypatch, why):
    import os

    if why == "user dir":
        monkeypatch.setenv("FLA_CONFIG_DIR", "/mine")
    elif why == "user mode":
        monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    else:
        monkeypatch.setattr(fla_tuning, "shipped_dir", lambda: fresh / "none")
    before = (os.environ.get("FLA_CONFIG_DIR"), os.environ.get("FLA_CACHE_MODE"))
    assert fla_tuning.use_shipped_configs() is None
    assert (os.environ.get("FLA_CONFIG_DIR"), os.environ.get("FLA_CACHE_MODE")) == before


IMPORTED_FIRST = """
import json, os, sys
from pathlib import Path
import fla.ops.utils.cache as cache  # first, as transformers' Qwen3.5 model does
from lightllm.layers import fla_tuning
kernel, key = json.loads(sys.argv[2])
os.environ["FLA_CONFIG_DIR"] = sys.argv[1]
before = cache.load_cached_config(kernel, cache.AutotuneKey(tuple(key)))  # the mode fla-core read: disabled
del os.environ["FLA_CONFIG_DIR"]
fla_tuning.shipped_dir = lambda: Path(sys.argv[1])
assert fla_tuning.use_shipped_configs() == Path(sys.argv[1])
print(json.dumps([before, cache.load_cached_config(kernel, cache.AutotuneKey(tuple(key)))]))
"""


def test_fla_core_imported_first_still_reads_them(tmp_path):
    """fla-core read FLA_CACHE_MODE (unset: disabled) when imported, so it reads no folder, even one with the key;
    the shipped folder is still used after."""
    fla_tuning.write_configs(fla_tuning.parse_autotune_log(LOG), tmp_path)
    query = ["chunk_fwd_kernel_o", [16, 48, 128, 128, 64, False, "torch.bfloat16", "torch.int64"]]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(fla_tuning.SHIPPED_ROOT.parents[2])}
    (out,) = child_output([sys.executable, "-c", IMPORTED_FIRST, str(tmp_path), json.dumps(query)], env)
    before, after = json.loads(out)
    assert before is None and after["kwargs"] == {"BK": 64, "BV": 64}


def test_an_older_fla_core_imported_first_is_left_as_it_is(fresh, monkeypatch):
    """An fla-core without its config modes (before 0.6): the variables are set, nothing else is touched."""
    import os
    import types

    older = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", older)
    assert fla_tuning.use_shipped_configs() == fresh and os.environ["FLA_CACHE_MODE"] == "strict"
    assert vars(older) == {}


def test_the_command_writes_the_files_or_says_why_in_one_line(tmp_path, capsys):
    log = tmp_path / "start.log"
    log.write_text(LOG)
    assert fla_tuning.main([str(log), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "chunk_fwd_kernel_o.json",
        "chunk_local_cumsum_scalar_kernel.json",
    ]
    capsys.readouterr()
    log.write_text("no autotuning here")
    assert fla_tuning.main([str(log), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == f"error: {log} holds no 'Triton autotuning for function' line\n"
    assert fla_tuning.main([str(tmp_path / "missing.log"), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.startswith("error: [Errno 2]")
