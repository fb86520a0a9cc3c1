"""Logprobs report the tokens of the text the client gets: when a stop string cuts the text, the tokens after the
cut (the stop string's own, held back while it could still be one) are not reported, whole or streamed."""

from fake_model import make_scripted_server, post, sse
from fastapi.testclient import TestClient

ANSWER = "Hi yo\n\nmore"  # ScriptedRunner answers this, one character a token
CUT = "Hi yo"


def completion(**extra):
    return {"prompt": ANSWER + chr(30), "stop": "\n\n", "logprobs": 1, "max_tokens": 20, **extra}


def chat(**extra):
    return {"messages": [{"role": "user", "content": ANSWER}], "stop": ["\n\n"], "logprobs": True, "top_logprobs": 1,
            "max_tokens": 20, **extra}  # fmt: skip


def test_completion_logprobs_end_with_the_text_cut_at_a_stop_string():
    with TestClient(make_scripted_server().app) as c:
        whole = post(c, "/v1/completions", completion())["choices"][0]
        events = sse(c, "/v1/completions", completion(stream=True))
    assert whole["text"] == CUT and whole["finish_reason"] == "stop"
    assert whole["logprobs"]["tokens"] == list(CUT)
    assert whole["logprobs"]["text_offset"] == list(range(len(CUT)))
    assert len(whole["logprobs"]["token_logprobs"]) == len(whole["logprobs"]["top_logprobs"]) == len(CUT)
    choices = [e["choices"][0] for e in events]
    streamed = [lp for ch in choices if ch["logprobs"] for lp in zip(*ch["logprobs"].values())]
    assert "".join(ch["text"] for ch in choices) == CUT and choices[-1]["finish_reason"] == "stop"
    assert [t for t, _, _, _ in streamed] == list(CUT)
    assert [offset for _, _, _, offset in streamed] == list(range(len(CUT)))


def test_chat_logprobs_end_with_the_text_cut_at_a_stop_string():
    with TestClient(make_scripted_server().app) as c:
        whole = post(c, "/v1/chat/completions", chat())["choices"][0]
        events = sse(c, "/v1/chat/completions", chat(stream=True))
    assert whole["message"]["content"] == CUT and whole["finish_reason"] == "stop"
    assert [e["token"] for e in whole["logprobs"]["content"]] == list(CUT)
    choices = [e["choices"][0] for e in events]
    assert "".join(ch["delta"].get("content", "") for ch in choices) == CUT and choices[-1]["finish_reason"] == "stop"
    assert [e["token"] for ch in choices if ch["logprobs"] for e in ch["logprobs"]["content"]] == list(CUT)


def test_a_finish_without_a_cut_still_reports_every_token():
    """Text held back as the possible start of a stop string that never completes is in the text, and so are its
    tokens; the end-of-sequence token (no text of its own) is reported as before."""
    body = chat(messages=[{"role": "user", "content": "ab\n"}], stream=True)
    with TestClient(make_scripted_server().app) as c:
        events = sse(c, "/v1/chat/completions", body)
    choices = [e["choices"][0] for e in events]
    assert "".join(ch["delta"].get("content", "") for ch in choices) == "ab\n"
    assert [e["token"] for ch in choices if ch["logprobs"] for e in ch["logprobs"]["content"]] == list("ab\n\0")
