"""prefix_publish_cost's method on the CPU: the rows it writes and the checks of its flags, not how fast."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("prefix_publish_cost")


def test_rows_time_each_length_fresh_and_shared(bench, tmp_path):
    out = tmp_path / "cost.json"
    bench.main(["--lengths", "64", "100", "--decode", "3", "--repeats", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt"], r["shared"]) for r in rows] == [(64, False), (64, True), (100, False), (100, True)]
    for r in rows:
        assert r["plain_us"] > 0 and r["publish_us"] > 0 and r["added_us"] == r["publish_us"] - r["plain_us"]


def test_a_request_publishes_as_the_engine_does(bench):
    """The timed request publishes and leaves the tree what the engine's does: its prompt chunk by chunk, then its
    prompt and decode tokens, unpinned."""
    from lightllm.common.kv_cache import KVCacheManager

    kv = KVCacheManager(256, 2, 64, "cpu", prefix_cache=True)
    prompt = list(range(1, 41))
    published = []
    real = kv.publish
    kv.publish = lambda slot, lasting: published.append((kv.seq_len(slot), lasting)) or real(slot, lasting)
    bench.request_us(kv, prompt, 4, publish=True, chunk=16)
    assert published == [(16, False), (32, False), (40, True)]  # after each chunk, the prompt's end lasting
    assert kv.prefix.num_tokens == 44 and kv.prefix.num_evictable == 44 and kv.num_free_slots == 2
    assert kv.match_prefix(prompt + [0, 1, 2, 3, 99]) == (44, 44)  # decode tokens 0..3 follow the prompt


def test_prompts_must_keep_their_own_tokens(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--lengths", "16", "--out", str(tmp_path / "x.json")])
    assert "--lengths expected each > 16" in capsys.readouterr().err
