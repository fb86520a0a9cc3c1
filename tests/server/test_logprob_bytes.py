"""OpenAI's logprobs ``bytes``: each token's own bytes, so a client can join a character split over tokens."""

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
