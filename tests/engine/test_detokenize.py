"""Incremental detokenization gives the text a full decode gives, delta by delta."""

import gc
import random

import pytest

from lightllm.engine.detokenize import MAX_HELD_TOKENS, IncrementalDetokenizer, StopStrings, decoder
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


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_direct_decoder_is_the_tokenizers_own_decode(tokenizer, skip_special):
    """The fast tokenizer's decode is taken from its Rust backend directly; the text is the same, special
    tokens (kept or skipped) and byte pieces that split a character included."""
    fast = decoder(tokenizer, skip_special)
    assert fast.func.__self__ is tokenizer.backend_tokenizer
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
        assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special)


@pytest.mark.parametrize("method", ["_decode", "decode"])
def test_a_tokenizer_with_its_own_decode_or_space_clean_up_keeps_it(tokenizer, monkeypatch, method):
    Custom = type("Custom", (type(tokenizer),), {method: lambda self, token_ids, **kwargs: "custom"})
    monkeypatch.setattr(tokenizer, "__class__", Custom)
    assert decoder(tokenizer, True)([1, 2]) == "custom"
    monkeypatch.setattr(tokenizer, "__class__", Custom.__mro__[1])
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert decoder(tokenizer, True).func.__self__ is tokenizer


def _stray_bytes(tokenizer):
    """Ids whose text alone is one U+FFFD: single bytes that are no UTF-8 character on their own."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]


@pytest.mark.parametrize("kind", ["stray bytes", "skipped special tokens", "mixed"])
def test_a_stream_that_never_completes_a_character_keeps_its_window_short(tokenizer, kind):
    """A model emitting stray bytes (its text always ends in an incomplete character) or only tokens that add no
    text: the window decoded per token stays a few ids long (before: every id since the last emission, O(n^2)
    per request on the HTTP loop), and the text streamed is still the full decode's."""
    stray, special = _stray_bytes(tokenizer), list(tokenizer.all_special_ids)
    assert len(stray) > 16 and special
    rng = random.Random(0)
    pool = {"stray bytes": stray, "skipped special tokens": special, "mixed": stray + special + [65, 66]}[kind]
    ids = [rng.choice(pool) for _ in range(600)]
    detok = IncrementalDetokenizer(tokenizer)
    sizes = []
    decode = detok._decode
    detok._decode = lambda window: (sizes.append(len(window)), decode(window))[1]
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) + detok.finish() == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(sizes) <= 24  # ids per decode: the held-back ids and their context, not the 600 of the stream
    if kind == "stray bytes":
        assert sum(1 for d in deltas if d) > len(ids) // 24  # it still streams


@pytest.mark.parametrize("skip_special", [True, False])
def test_characters_whose_bytes_have_textless_tokens_between_them_stay_whole(tokenizer, skip_special):
    """A character's bytes with skipped special tokens between them (ids that add no text, so the bytes of one
    character span more than 3 ids), in streams long enough to force cuts: the streamed text is the full decode's."""
    pieces = [tokenizer.encode(c) for c in "中🙂é"]
    assert all(len(p) > 1 for p in pieces)  # each character is several byte tokens here
    special = list(tokenizer.all_special_ids)
    for seed in range(200):
        rng = random.Random(seed)
        ids = []
        for _ in range(rng.randrange(1, 12)):
            for byte in rng.choice(pieces):
                ids += [rng.choice(special) for _ in range(rng.choice([0, 0, 1, 12]))] + [byte]
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
        deltas = [detok.add(t) for t in ids]
        assert "".join(deltas) + detok.finish() == tokenizer.decode(ids, skip_special_tokens=skip_special), seed


@pytest.mark.parametrize("seed", range(10))
def test_valid_characters_across_a_forced_cut_stay_whole(tokenizer, seed):
    """Stray bytes long enough to force a cut, then multi-byte characters: no character is split at the cut."""
    rng = random.Random(seed)
    stray = _stray_bytes(tokenizer)
    text = "".join(rng.choice("你好🙂éü—x ") for _ in range(30))
    ids = []
    for piece in text:
        ids += [rng.choice(stray) for _ in range(rng.randrange(0, 2 * MAX_HELD_TOKENS))]
        ids += tokenizer.encode(piece)
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_forced_cut_never_splits_an_invalid_byte_run(tokenizer):
    """A 4-byte lead with two continuation bytes, then textless ids past the hold-back: a cut after the lead alone
    decodes to the same U+FFFD as the whole run, but the continuation bytes decoded apart later give one each."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = {b: tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = [byte[0xF3], byte[0xB2], byte[0xB2], eot, eot, byte[0xE6], eot, eot, eot, byte[0x9B]]
    assert len(ids) > MAX_HELD_TOKENS  # the forced cut runs
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True) == "\ufffd\ufffd"


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


@pytest.mark.parametrize("seed", range(30))
def test_stop_strings_match_a_search_of_the_whole_text(seed):
    """Incremental matching finds what a search of the whole text does: the earliest stop string."""
    rng = random.Random(seed)
    text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 120)))
    stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 4))]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 40)))) if len(text) > 1 else []
    deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    out, hit = run_stops(stops, deltas)
    assert "".join(out) == (text if first is None else text[:first]) and hit is (first is not None)


def test_stop_matching_work_per_token_does_not_grow_with_the_text():
    """Each delta is searched with at most the longest stop string - 1 held-back characters, even when the
    text keeps ending in a prefix of a stop string."""
    stops = ["a" * 200 + "!", "xyz"]
    cut = StopStrings(stops)
    deltas = ["a"] * 5000 + ["ab"] * 5000
    for d in deltas:
        assert not cut.cut(d)[1]
    assert cut.scanned <= sum(map(len, deltas)) + len(deltas) * (201 - 1)


@pytest.mark.parametrize(
    "stops, message",
    [
        (["x"] * 17, "stop: at most 16 strings, got 17"),
        (["x" * 257], "stop: at most 256 characters per string, got one of 257"),
        (["ok", ""], "stop: expected non-empty strings"),
    ],
)
def test_stop_string_limits(stops, message):
    from lightllm.engine.detokenize import check_stop_strings

    check_stop_strings(["x" * 256] * 16)
    with pytest.raises(ValueError, match=message):
        check_stop_strings(stops)


class _CountingTokenizer:
    """The tiny tokenizer's ``decode``, counted (a class of its own: ``decoder`` then calls it, not the backend)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_streaming_token_costs_one_decode_once_its_ids_texts_are_known(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, again and again and again.")
    first, calls_first = stream(counting, ids), counting.calls
    counting.calls = 0
    second = stream(counting, ids)  # another stream of the same tokenizer: every single id's text is known now
    assert first == second and "".join(first[0]) + first[1] == tokenizer.decode(ids, skip_special_tokens=True)
    # the window alone (the id emitted last and the new one), one per token but the first (was two per token)
    assert counting.calls == len(ids) - 1 < calls_first


def test_single_id_texts_are_kept_per_tokenizer_and_skip_special_setting(tokenizer):
    from lightllm.engine.detokenize import _PIECES

    special = tokenizer.all_special_ids[0]
    counting = _CountingTokenizer(tokenizer)
    for skip in (True, False):
        detok = IncrementalDetokenizer(counting, skip_special_tokens=skip)
        for t in [special] * (MAX_HELD_TOKENS + 2):  # skipped: held back until the window is cut by texts
            detok.add(t)
        detok.finish()
    assert _PIECES[counting][True][special] == "" and _PIECES[counting][False][special] == tokenizer.decode([special])
    del counting, detok  # the cache goes with its tokenizer
    gc.collect()
    assert all(type(t) is not _CountingTokenizer for t in _PIECES.keys())


def test_a_tokenizer_that_cannot_be_weakly_referenced_still_streams(tokenizer):
    class Slotted:
        __slots__ = ("decode",)

    slotted = Slotted()
    slotted.decode = tokenizer.decode
    ids = tokenizer.encode("naïve café 你好")
    deltas, rest = stream(slotted, ids)
    assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=True)


def _metaspace_tokenizer():
    """A SentencePiece-style fast tokenizer: a word's text alone has no leading space, after another word it has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "\u2581again": 3},
                                         unk_token="<unk>"))  # fmt: skip
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


def test_pieces_join_only_for_a_byte_level_decoder_called_directly(tokenizer):
    from lightllm.engine.detokenize import pieces_join

    metaspace = _metaspace_tokenizer()
    assert metaspace.decode([1, 2]) == "hello world" and metaspace.decode([2]) == "world"  # so pieces don't join
    assert pieces_join(tokenizer) and not pieces_join(metaspace) and not pieces_join(_CountingTokenizer(tokenizer))
    ids = [1, 2, 3, 2, 1]
    deltas, rest = stream(metaspace, ids)
    assert deltas == ["hello", " world", " again", " world", " hello"] and rest == ""


def test_a_byte_level_stream_of_whole_pieces_decodes_nothing_once_they_are_known(tokenizer):
    ids = tokenizer.encode("Hello, wörld! 你好 🙂 naïve café — plain words and more plain words.")
    stream(tokenizer, ids)  # every single id's text is known from here on
    detok, calls = IncrementalDetokenizer(tokenizer), []
    decode = detok._decode
    detok._decode = lambda window: calls.append(window) or decode(window)
    text = "".join(detok.add(t) for t in ids) + detok.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    split = [t for t in ids if "\ufffd" in tokenizer.decode([t])]  # bytes of characters split across ids
    assert split and 0 < len(calls) <= 2 * len(split)  # decoding only around them


@pytest.mark.parametrize("include", [False, True])
def test_the_first_stop_string_to_be_complete_ends_the_text_however_the_tokens_split_it(include):
    """Stops "ange" and "n" in "orange": "n" is complete first, whether "ange" arrives as one delta or four."""
    for deltas in (["or", "ange"], ["or", "a", "n", "g", "e"]):
        cut = StopStrings(["ange", "n"], include)
        text, hit = "", False
        for delta in deltas:
            out, hit = cut.cut(delta)
            text += out
            if hit:
                break
        assert (text, hit) == ("oran" if include else "ora", True), deltas
