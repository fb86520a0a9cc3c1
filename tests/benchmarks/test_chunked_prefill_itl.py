"""chunked_prefill_itl's method on the CPU (tiny model): what it counts, not how fast anything is."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def itl():
    return load_benchmark("chunked_prefill_itl")


def test_streams_are_measured_between_the_chunks(itl, tmp_path):
    out = tmp_path / "itl.json"
    itl.main(["--tiny", "--streams", "2", "--prompt", "100", "--chunks", "32", "--warmup", "1", "--baseline", "2",
              "--out", str(out)])  # fmt: skip
    chunked, off = json.loads(out.read_text())["rows"]
    assert (chunked["mode"], chunked["prefill_steps"]) == ("chunk 32", 4)  # ceil(100 / 32) chunks
    # each stream: the token of the decode step in flight when the long prompt came (overlapped decode reads it in
    # the next step), one gap per decode step between chunks (3), and the one spanning the last chunk
    assert chunked["loaded_tokens"] == 2 * 5 and len(chunked["loaded_gaps_ms"]) == 10
    # the whole prompt: one stall (and the token in flight before it)
    assert (off["mode"], off["prefill_steps"], off["loaded_tokens"]) == ("off", 1, 2 * 2)
    assert len(chunked["unloaded_gaps_ms"]) == 2 * (2 - 1)  # per stream: baseline tokens, one gap fewer


def test_mixed_runs_carry_the_streams_in_the_chunk_steps(itl, tmp_path):
    """--mixed: the chunk size again with the streams' tokens in each chunk's forward. The budget of 32 less the two
    streams leaves chunks of 30: ceil(100 / 30) = 4 mixed steps, each a token per stream (the last also the long
    request's first), then the decode step that ends the window, after the token of the decode step in flight when
    the long prompt came: 6 gaps per stream."""
    out = tmp_path / "itl.json"
    itl.main(["--tiny", "--streams", "2", "--prompt", "100", "--chunks", "32", "--warmup", "1", "--baseline", "2",
              "--mixed", "--no-off", "--out", str(out)])  # fmt: skip
    chunked, mixed = json.loads(out.read_text())["rows"]
    assert (chunked["mode"], mixed["mode"], mixed["mixed"]) == ("chunk 32", "chunk 32 mixed", True)
    assert mixed["prefill_steps"] == 4 and mixed["loaded_tokens"] == 2 * 6
