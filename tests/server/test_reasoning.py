"""--reasoning_parser: <think>...</think> split off a chat answer, whole and streamed in any pieces."""

import pytest

from lightllm.server.reasoning import ReasoningSplitter, partial_tag_at_end, prompt_opens_think


def split(pieces, in_reasoning=False):
    """(reasoning, content) of ``pieces`` fed one by one, the deltas joined (a part of a tag sent too early would
    show in them)."""
    s = ReasoningSplitter(in_reasoning)
    deltas = [s.add(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def every_split(text, three_ways=True):
    """``text`` whole, a character at a time, and cut in two (and in three) at every position."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1) if three_ways else ():
            yield [text[:i], text[i:j], text[j:]]


CASES = [  # (answer text, starts in reasoning, expected reasoning, expected content)
    ("<think>\nlet me see</think>\n\nThe answer.", False, "\nlet me see", "The answer."),
    ("\n<think>a<b</think>c</thi", False, "a<b", "c</thi"),
    ("plain answer, no tags", False, "", "plain answer, no tags"),
    ("plain </think> kept", False, "", "plain </think> kept"),
    ("the prompt opened it</think>done", True, "the prompt opened it", "done"),
    ("<think>R1 writes it anyway</think>done", True, "R1 writes it anyway", "done"),
    ("cut off while thinking </thi", True, "cut off while thinking </thi", ""),
    ("<think>", False, "", ""),
    ("<thin", False, "", "<thin"),
    ("  ", False, "", "  "),
    ("<think></think>", False, "", ""),
]


@pytest.mark.parametrize("text, in_reasoning, reasoning, content", CASES, ids=[c[0] for c in CASES])
def test_split_at_every_position(text, in_reasoning, reasoning, content):
    for pieces in every_split(text):
        assert split(pieces, in_reasoning) == (reasoning, content), pieces


def test_nothing_is_held_longer_than_a_tag_could_need():
    s = ReasoningSplitter(False)
    assert s.add("<think>abc") == ("abc", "")
    assert s.add("de</") == ("de", "")  # "</" may start </think>
    assert s.add("b>") == ("</b>", "")
    assert s.add("</think>\n") == ("", "")
    assert s.add("\nok") == ("", "ok")
    assert s.add(" go") == ("", " go")


def test_the_prompt_tells_whether_the_answer_starts_inside_the_reasoning():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opens_think("<|im_start|>assistant\n")
    assert prompt_opens_think("<think>old</think> ... <think>")


def test_partial_tag_at_end():
    assert [partial_tag_at_end(t, "</think>") for t in ("a<", "a</think", "a</think>", "<x", "")] == [1, 7, 0, 0, 0]
