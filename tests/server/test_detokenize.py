"""Incremental detokenization gives the text a full decode gives, delta by delta."""

import random

import pytest

from lightllm.server.detokenize import IncrementalDetokenizer, StopStrings
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_qwen3(tmp_path_factory.mktemp("m")))


def stream(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    return deltas, detok.finish()


def test_text_with_multibyte_characters(tokenizer):
    text = "Hello, wörld! 你好 🙂 naïve café — x = 42;\n\tdef f(): return 'ok'"
    ids = tokenizer.encode(text)
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert rest == ""  # every character complete by the last id: nothing was left held back
    assert all("\ufffd" not in d for d in deltas)  # a split character is held back, never emitted half
    assert sum(1 for d in deltas if d) > len(text) // 8  # it streams, not one blob at the end


@pytest.mark.parametrize("seed", range(20))
def test_random_ids_special_tokens_included(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 200))]
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True)


def test_nothing_to_finish(tokenizer):
    assert IncrementalDetokenizer(tokenizer).finish() == ""


def run_stops(stops, deltas):
    cut = StopStrings(stops)
    out = []
    for d in deltas:
        text, hit = cut.cut(d)
        out.append(text)
        if hit:
            return out, True
    out.append(cut.cut("", final=True)[0])
    return out, False


@pytest.mark.parametrize(
    "stops, deltas, want, hit",
    [
        (["END"], ["ab", "cE", "N", "Dxyz"], "abc", True),  # split over three deltas: nothing of it emitted
        (["END"], ["ab", "cE", "N", "o"], "abcENo", False),  # a prefix that was not a stop is emitted later
        (["zz", "b"], ["aazbzz"], "aaz", True),  # the earliest stop wins, not the first listed
        (["ab"], ["xa"], "xa", False),  # held back, then released at the end
        (["\n\n"], ["one\n", "\ntwo"], "one", True),
    ],
)
def test_stop_strings_cut_streamed_text(stops, deltas, want, hit):
    out, found = run_stops(stops, deltas)
    assert "".join(out) == want and found is hit
    assert not any(s in "".join(out) for s in stops)
