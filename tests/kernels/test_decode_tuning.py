"""The decode-attention kernels' shared tuning lengths: run-key KV lengths and the timing ladder."""

import contextlib
import math
from pathlib import Path

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup
from lightllm.kernels.attention.decode import fa3, flash_decode
from lightllm.kernels.attention.decode.tuning import (
    decode_attn_autotune_seq_lens,
    decode_attn_run_key_kv_len,
    decode_attn_run_key_lens,
    decode_attn_tuning_len,
    round_up_kv_len,
    seq_len_ladder,
    served_floor,
    served_ladder,
    set_decode_graph_lens,
)

GENERAL = AutotuneKernelType.GENERAL
DECODE = AutotuneKernelType.DECODE_ATTENTION


def test_round_up_kv_len():
    assert [round_up_kv_len(n) for n in (0, 1, 511, 512, 513, 32768, 32769)] == [512, 512, 512, 512, 1024, 32768, 33280]


@pytest.mark.parametrize("level", ["0", "1", "2", "3"])
@pytest.mark.parametrize("phase", [DECODE, GENERAL, None])
def test_decode_run_key_kv_len_is_the_tuning_len_in_and_out_of_the_scope(monkeypatch, level, phase):
    """The warm-up and the capture after it (outside the scope) key on the same length, so the capture looks up
    the entry the warm-up chose; a launch serving at most 1000 tokens keys (and tunes) at 1000."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", level)
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "4096")
    with contextlib.ExitStack() as scope:
        if phase is not None:
            scope.enter_context(autotune_warmup(phase))
        assert decode_attn_run_key_kv_len(100000) == 4096
        assert decode_attn_run_key_kv_len(1000) == 1000


def test_decode_tuning_capped_at_launch_max_len(monkeypatch):
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "32768")
    assert decode_attn_tuning_len(8384) == 8384 and decode_attn_tuning_len(40960) == 32768
    assert decode_attn_autotune_seq_lens(8384) == [8384, 4192, 1048, 512]
    assert decode_attn_autotune_seq_lens(448) == [448]
    assert decode_attn_autotune_seq_lens(10**6) == decode_attn_autotune_seq_lens() == [32768, 16384, 4096, 1024]


def test_a_kernel_may_time_its_own_ladder(monkeypatch):
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "32768")
    assert seq_len_ladder(32768, (2, 4, 8, 32)) == [32768, 16384, 8192, 4096, 1024]
    assert decode_attn_autotune_seq_lens(8192, (2, 4, 8, 32)) == [8192, 4096, 2048, 1024, 512]
    assert seq_len_ladder(1024, (2, 4)) == [1024, 512]  # never below 512, never a length twice


@pytest.mark.parametrize("env, expected", [(None, [32768, 16384, 4096, 1024]), ("1024", [1024, 512]), ("512", [512])])
def test_decode_autotune_seq_lens(monkeypatch, env, expected):
    if env:
        monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", env)
    assert decode_attn_autotune_seq_lens() == expected


def test_served_ladder_spans_the_range_a_graph_serves_at_most_a_factor_of_two_apart():
    assert served_ladder(32768, 4096) == [32768, 16384, 8192, 4096]
    assert served_ladder(32768, 8192) == [32768, 16384, 8192]
    assert served_ladder(32768, 16384) == [32768, 16384]
    assert served_ladder(40, 16) == [40, 25, 16]
    assert served_ladder(32768, 1024) == [32768, 10321, 3251, 1024]  # four points: wider than 2x apart


def test_with_length_buckets_each_launch_tunes_and_keys_on_the_lengths_its_graph_serves(monkeypatch):
    """Graphs up to 4K and up to 32K: the 32K graph serves 4K..32K, so its ladder stops at 4K and its run key
    carries that floor (a config chosen over 1K..32K by a one-graph start is not reused for it); the 4K graph and
    every length without buckets keep today's ladder and run key."""
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "32768")
    q = torch.empty(8, 32, 128)
    assert set_decode_graph_lens([4096, 32768]) == ()
    # an eager 64K launch (past the graphs) tunes at 32K, which no smaller graph serves: no floor
    assert [served_floor(n) for n in (1024, 4096, 4097, 32768, 65536)] == [0, 0, 4096, 4096, 0]
    assert decode_attn_autotune_seq_lens(32768) == [32768, 16384, 8192, 4096]
    assert decode_attn_autotune_seq_lens(4096) == [4096, 2048, 512]
    # FA3's own ladder has five lengths, so its served ladder may too: 2.4x apart over 32x, not 3.2x
    set_decode_graph_lens([1024, 32768])
    assert decode_attn_autotune_seq_lens(32768, (2, 4, 8, 32)) == [32768, 13777, 5793, 2435, 1024]
    set_decode_graph_lens([4096, 32768])
    assert decode_attn_autotune_seq_lens(32768, (2, 4, 8, 32)) == [32768, 16384, 8192, 4096]  # 2x apart already
    assert decode_attn_run_key_lens(32768) == (32768, 4096) and decode_attn_run_key_lens(20000) == (20480, 4096)
    assert decode_attn_run_key_lens(4096) == (4096,)
    assert flash_decode.split_kv_run_key(q, 32768) == (8, 32768, 4096)
    assert fa3._run_key(q.unsqueeze(1), 32768) == (8, 1, 32768, 4096)
    assert set_decode_graph_lens(()) == (4096, 32768)
    assert decode_attn_autotune_seq_lens(32768) == [32768, 16384, 4096, 1024]
    assert flash_decode.split_kv_run_key(q, 32768) == (8, 32768)


def test_a_floor_at_or_past_the_tuning_length_is_no_floor(monkeypatch):
    """LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN 4096 with graphs up to 8K and 32K: both tune at 4096 (the variable
    caps the tuning length), so no range is left to serve above 8K: today's ladder and key."""
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "4096")
    set_decode_graph_lens([8192, 32768])
    assert served_floor(32768) == 0 and decode_attn_autotune_seq_lens(32768) == [4096, 2048, 512]
    assert decode_attn_run_key_lens(32768) == (4096,)


def test_a_floored_key_is_near_its_unfloored_one():
    """An absent floor counts as 0: the same range first, then the nearest other range, a one-graph key included
    (keys of different lengths would otherwise never be near, and a bucketed graph would run the default)."""
    from lightllm.kernels.attention.decode.tuning import decode_attn_run_key_distance as d

    assert d((8, 32768, 4096), (8, 32768, 4096)) == 0 and d((8, 32768, 4096), (8, 32768)) == 4096
    assert d((8, 32768), (8, 32768, 16384)) == 16384 and d((8, 1, 32768, 4096), (8, 1, 32768), prefix=2) == 4096
    cached = [(8, 32768), (8, 32768, 16384), (16, 32768, 4096)]
    assert min(cached, key=lambda c: d((8, 32768, 4096), c)) == (16, 32768, 4096)
    # a hand-edited file's run key that is not a tuple is never near (it raised TypeError: no len() of an int)
    assert d((8, 32768), 5) == d((8, 32768), None) == d(5, (8, 32768)) == math.inf
    assert d((8, 32768), (8, "x")) == d((8, 32768), (8, True)) == math.inf and d((8, 32768), ()) == 8 + 32768


@pytest.mark.parametrize(
    "launch, nearest",
    [
        (16384, 32768),  # the default server's graph: 32K's config was timed at 16K on its ladder, 4K's never past 4K
        (8192, 32768),
        (32768, 32768),
        (4096, 4096),
        (2048, 4096),
        (512, 1024),  # a 1K graph tuned (a bucket), nearest above 512
        (65536, 32768),  # nothing tuned at or above it: the nearest below
    ],
)
def test_the_nearest_tuning_length_is_the_nearest_at_or_above_the_launch(launch, nearest):
    from lightllm.kernels.attention.decode.tuning import decode_attn_run_key_distance as d

    cached = [(b, n) for n in (4096, 32768) for b in (1, 8, 16)] + [(8, 1024)]
    assert min(cached, key=lambda c: d((8, launch), c)) == (8, nearest)
    fa3_cached = [(b, 1, n) for b, n in cached]
    assert min(fa3_cached, key=lambda c: d((8, 1, launch), c, prefix=2)) == (8, 1, nearest)
    # a batch size that was not tuned takes the nearest tuned one at the chosen length
    assert min(cached, key=lambda c: d((10, launch), c)) == (8, nearest)


def test_shipped_decode_attention_configs_resolve_to_the_tuning_length_that_covers_the_graph():
    """At level 0, the shipped H200 files (graph lengths 4096 and 32768) give a 16K graph (the default
    ``max_req_total_len``) the 32K-tuned config of its batch size, and a 4K or 2K graph the 4K one, under each
    kernel's own declared distance (FA3's keys carry q_len after the batch)."""
    from lightllm.common.autotuner import store
    from lightllm.common.autotuner.keys import key_from_json

    shipped = Path(store.__file__).resolve().parent / "configs"  # the package's own (the fixtures isolate the root)
    kernels = {
        "fa3_decode": fa3._launch_fa3_decode,
        "gqa_flash_decode": flash_decode._launch_gqa_flash_decode,
        "gqa_flash_decode_int8kv": flash_decode._launch_gqa_flash_decode_int8kv,
        "gqa_flash_decode_int4kv": flash_decode._launch_gqa_flash_decode_int4kv,
    }
    checked = 0
    for name, kernel in kernels.items():
        distance, at = kernel.run_key_distance_func, 2 if name == "fa3_decode" else 1  # the length's place in a key
        for path in store.iter_config_files(shipped, name):
            keys = [key_from_json(k) for k in store.read_config_file(path, strict=True)["configs"]]
            if not {4096, 32768} <= {k[at] for k in keys}:
                continue
            for key in (k for k in keys if k[at] == 32768):
                for launch, want in ((16384, 32768), (32768, 32768), (4096, 4096), (2048, 4096)):
                    run = key[:at] + (launch,)
                    got = min(keys, key=lambda c: distance(run, c))
                    assert got == key[:at] + (want,), (path.name, run, got)
                    checked += 1
    assert checked >= 4 * 19 * 10  # bf16, FA3 and quantized files of at least ten shapes ship both lengths


def test_shipped_decode_attention_files_cover_every_default_graph_size_at_both_lengths():
    """What README promises for the H200: every shipped decode-attention file (and each q_len of FA3's: its MTP
    verify is q_len 4) holds a config for each batch size a default server captures, at graph lengths 4096 and
    32768, so a first start there searches nothing at either length. Another GPU's files (the H100's hold 32768
    alone) cover every such batch size at each length they hold."""
    from lightllm.common.autotuner import store
    from lightllm.common.autotuner.keys import key_from_json
    from lightllm.engine.args import EngineArgs

    shipped = Path(store.__file__).resolve().parent / "configs"
    sizes = set(EngineArgs().graph_batch_sizes())
    files = 0
    for name in ("fa3_decode", "gqa_flash_decode", "gqa_flash_decode_int8kv", "gqa_flash_decode_int4kv",
                 "mtp_diverse_decode"):  # fmt: skip
        for path in store.iter_config_files(shipped, name):
            batches = {}  # (the key's middle, e.g. FA3's q_len; its length) -> batch sizes
            for key in map(key_from_json, store.read_config_file(path, strict=True)["configs"]):
                batches.setdefault((key[1:-1], key[-1]), set()).add(key[0])
            h200 = path.parent.parent.name == "NVIDIA_H200"
            for middle in {m for m, _ in batches}:
                for length in (4096, 32768) if h200 else {n for m, n in batches if m == middle}:
                    missing = sizes - batches.get((middle, length), set())
                    assert not missing, f"{path.name}: no config for batch sizes {sorted(missing)} at {middle, length}"
            files += h200
    assert files >= 25  # 6 Triton bf16, 6 + 6 quantized, 6 FA3, 1 MTP diverse


@pytest.mark.parametrize("lens", [[0, 4096], [4096, 1024], [1024, 1024], [-1]])
def test_bad_graph_lens_are_refused(lens):
    with pytest.raises(ValueError, match=r"^decode graph KV length buckets expected ascending positive lengths"):
        set_decode_graph_lens(lens)
    assert served_floor(10**6) == 0  # nothing was set


def test_decode_attention_kernels_are_declared_as_such():
    from lightllm.common.autotuner import AutotuneKernelType, tuner

    import lightllm.kernels.attention.decode.fa3  # noqa: F401  (declares fa3_decode)
    import lightllm.kernels.attention.decode.flash_decode  # noqa: F401
    import lightllm.kernels.norm.rmsnorm  # noqa: F401

    decode = tuner.kernel_names(AutotuneKernelType.DECODE_ATTENTION)
    assert {"gqa_flash_decode", "gqa_flash_decode_int8kv", "gqa_flash_decode_int4kv", "fa3_decode"} <= decode
    assert "rmsnorm" in tuner.kernel_names(AutotuneKernelType.GENERAL) and "rmsnorm" not in decode
