"""OpenAI's logprobs ``bytes``: each token's own bytes, so a client can join a character split over tokens; and the
completions ``text_offset``: where each token starts in the returned text."""

import pytest

from lightllm.server.openai_api import LogprobFormatter
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=1))


def test_a_character_split_over_byte_level_tokens_is_rebuilt_from_their_bytes(tokenizer):
    fmt = LogprobFormatter(tokenizer)
    for text in ("é", "日本", "a€b"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        entries = fmt.chat(ids, [-0.5] * len(ids), [None] * len(ids))["content"]
        assert any(e["token"] == "\ufffd" for e in entries), f"{text!r} is not split inside a character here"
        assert bytes(b for e in entries for b in e["bytes"]) == text.encode("utf-8")
    whole = tokenizer.encode("hello world", add_special_tokens=False)
    for tok in whole:  # a token that decodes whole: its text's bytes
        assert fmt.raw_bytes(tok, fmt.text(tok)) == list(fmt.text(tok).encode("utf-8"))


def test_text_offsets_index_the_returned_text_across_split_characters_and_special_tokens(tokenizer):
    """Each offset is where its token's text starts in the text the stream returns (a byte of a split character: where
    the character does; a skipped special token: where the next text does), from the echoed prompt's length."""
    fmt = LogprobFormatter(tokenizer)
    split = tokenizer.encode("中", add_special_tokens=False)  # one character, three byte-level tokens here
    assert len(split) == 3
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    a, b, c = (tokenizer.encode(x, add_special_tokens=False) for x in "abc")
    ids = a + split + b + [end] + c
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "a中bc"
    offsets = fmt.completion(ids, [-1.0] * len(ids), [None] * len(ids), 5)["text_offset"]
    assert offsets == [5, 6, 6, 6, 7, 8, 8]
    assert [text[o - 5] for o in (offsets[0], offsets[1], offsets[4], offsets[6])] == ["a", "中", "b", "c"]


class _ByteFallbackTokenizer:
    """SentencePiece with byte fallback: a byte token is ``<0xAB>`` and decodes alone to U+FFFD."""

    def decode(self, ids):
        return "\ufffd"

    def convert_ids_to_tokens(self, token_id):
        return {1: "<0xC3>", 2: "<0xA9>", 3: "\u2581\ufffd"}[token_id]


def test_sentencepiece_byte_fallback_tokens_give_their_byte():
    fmt = LogprobFormatter(_ByteFallbackTokenizer())
    assert fmt.raw_bytes(1, "\ufffd") + fmt.raw_bytes(2, "\ufffd") == list("é".encode("utf-8"))
    assert fmt.raw_bytes(3, "\ufffd") == list(
        "\ufffd".encode("utf-8")
    )  # neither a byte token nor byte-level: its text's bytes


def test_completion_top_logprobs_give_the_chosen_token_its_own_logprob_when_tokens_share_a_text(tokenizer):
    """Byte pieces of different characters all decode to U+FFFD: the chosen token's key holds its own logprob (not a
    less likely alternative's that overwrote it), and another shared text the likeliest's."""
    fmt = LogprobFormatter(tokenizer)
    a, b = tokenizer.encode("é", add_special_tokens=False)[:1] + tokenizer.encode("中", add_special_tokens=False)[:1]
    word = tokenizer.encode("hello", add_special_tokens=False)[0]
    assert fmt.text(a) == fmt.text(b) == "\ufffd" and a != b
    out = fmt.completion([a, word], [-0.1, -2.0], [[(a, -0.1), (b, -3.0)], [(a, -0.5), (b, -0.7)]], 0)
    assert [top[tok] for tok, top in zip(out["tokens"], out["top_logprobs"])] == out["token_logprobs"]
    assert out["top_logprobs"] == [{"\ufffd": -0.1}, {"\ufffd": -0.5, fmt.text(word): -2.0}]


def test_completion_top_logprobs_keep_a_sampled_token_s_own_logprob_when_a_likelier_one_shares_its_text(tokenizer):
    """The sampled token is the less likely of two that share a text: its key holds its own logprob (-3.0), not the
    likelier alternative's (-0.1) that came first among the alternatives."""
    fmt = LogprobFormatter(tokenizer)
    a, b = tokenizer.encode("é", add_special_tokens=False)[:1] + tokenizer.encode("中", add_special_tokens=False)[:1]
    assert fmt.text(a) == fmt.text(b) == "\ufffd" and a != b
    out = fmt.completion([b], [-3.0], [[(a, -0.1), (b, -3.0)]], 0)
    assert out["token_logprobs"] == [-3.0] and out["top_logprobs"] == [{"\ufffd": -3.0}]
