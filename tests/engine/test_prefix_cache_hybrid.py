"""The prefix cache with Qwen3.5 (linear-attention state beside the KV) on the CPU, float32: a request leaves a
checkpoint of its state after its prompt (published while it runs) and after its computed tokens, and a later request
reuses a cached prefix up to the deepest checkpoint on it; one whose cached KV goes past that checkpoint stops a chunk
at the branch and leaves one there. Greedy output is the same with the cache on and off (and with one checkpoint for
many requests, under a pool small enough to preempt); a follow-up turn prefills only past the previous request's
tokens, or past its prompt when the answer differs; what no checkpoint covers is recomputed; the flag turns the
checkpoints, and with them the cache, off."""

import logging

import pytest

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5
from tests.engine.test_prefix_cache import BASE, WAVES, assert_no_leak, counting, run, run_waves, runner

OTHER = [90 + i for i in range(12)]  # shares nothing with BASE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("hybrid"), seed=3))


def assert_no_state_leak(r):
    kv = r.kv
    assert_no_leak(r)  # clears the tree
    assert kv.prefix.num_states == 0 and sorted(kv._free_states) == list(range(r.args.linear_att_cache_size))


def test_a_follow_up_turn_prefills_only_past_the_previous_request(model_dir):
    """Turn two's prompt is turn one's prompt and answer and more: only the answer's last token (its KV never
    computed) and the new tokens are prefilled, and the output is the cache-off run's."""
    first, more = BASE[:20], [50, 51, 52]
    off = Engine(runner(model_dir, cache=False), eos_ids=[])
    answer, _ = run(off, [first])
    want, _ = run(off, [first + answer[0] + more])
    r = runner(model_dir)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    got, _ = run(engine, [first])
    assert got == answer and r.kv.prefix.num_states == 2  # after the prompt (published) and after the answer
    run(engine, [OTHER])  # takes the freed slot: its state row no longer holds turn one's
    got, fins = run(engine, [first + answer[0] + more])
    computed = len(first) + len(answer[0]) - 1
    assert got == want and fins[0].cached_tokens == computed
    assert calls == [[len(first)], [len(OTHER)], [1 + len(more)]]
    assert_no_state_leak(r)


def test_a_turn_that_re_renders_the_answer_starts_after_the_previous_prompt(model_dir):
    """Turn two repeats turn one's prompt but not its answer (a chat template that re-renders it): it starts from
    the checkpoint published after turn one's prompt, and its output is the cache-off run's."""
    first, other_answer = BASE[:20], [60, 61, 62, 63]
    follow = first + other_answer + [50, 51]
    want, _ = run(Engine(runner(model_dir, cache=False), eos_ids=[]), [follow])
    r = runner(model_dir)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    run(engine, [first])
    run(engine, [OTHER])  # takes the freed slot: its state row no longer holds turn one's
    got, fins = run(engine, [follow])
    assert got == want and fins[0].cached_tokens == len(first)
    assert calls[-1] == [len(other_answer) + 2]
    assert_no_state_leak(r)


def test_what_no_checkpoint_covers_is_recomputed(model_dir):
    """An identical prompt's checkpoint lies past its last-but-one token (the request's answer was computed too),
    and a prompt inside a cached one has none: both prefill whole, as without the cache, when the KV they share is
    shorter than the scheduler's minimum branch (64 tokens by default; these share 24-36)."""
    r = runner(model_dir)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    assert engine.scheduler.branch_min_tokens == 64
    first, _ = run(engine, [BASE])
    second, fins = run(engine, [BASE])
    inner, inner_fins = run(engine, [BASE[:25]])
    assert second == first and fins[0].cached_tokens == inner_fins[0].cached_tokens == 0
    assert calls == [[len(BASE)], [len(BASE)], [25]]
    want, _ = run(Engine(runner(model_dir, cache=False), eos_ids=[]), [BASE[:25]])
    assert inner == want


@pytest.mark.parametrize("branch_min", [64, 1], ids=["no branches", "branch checkpoints"])
@pytest.mark.parametrize("mixed", [False, True], ids=["alternating", "mixed chunks"])
def test_greedy_output_is_the_same_with_the_cache_on_and_off(model_dir, mixed, branch_min):
    """The Qwen3 module's waves (contained, longer, diverging and identical prompts) and one more built on them. With
    mixed steps and 8-token chunks, running requests' decode tokens ride in the chunk steps of the longer prompts,
    each continuing its state there (the run checks that such steps happened). With a minimum branch of one token,
    every request that shares more KV than a checkpoint covers stops a chunk there and leaves a checkpoint, which
    later waves start from."""
    waves = WAVES + [[BASE + [5], BASE[:30], [7, 8, 9, 10, 11, 12]]]
    opts = dict(enable_mixed_chunk=True, chunked_prefill_size=8) if mixed else {}
    want = [outs for outs, _ in run_waves(runner(model_dir, cache=False, **opts), waves)]
    r = runner(model_dir, **opts)
    engine, kinds, branches = Engine(r, eos_ids=[]), [], []
    engine.scheduler.branch_min_tokens = branch_min
    schedule = engine.scheduler.schedule

    def watched():
        kind, batch = schedule()
        kinds.append(kind)
        branches.extend(req.chunk_end for req in batch if req.branch and req.chunk_end == req.branch)
        return kind, batch

    engine.scheduler.schedule = watched
    assert [run(engine, w)[0] for w in waves] == want
    assert ("mixed" in kinds) == mixed
    assert bool(branches) == (branch_min == 1)
    assert_no_state_leak(r)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "8-token chunks"])
def test_a_shared_prefix_is_checkpointed_at_its_branch(model_dir, chunk):
    """Three prompts share a 26-token prefix (a system prompt). Whole, the first leaves checkpoints only past it
    (after its prompt, after its answer); the second shares the prefix's KV but no checkpoint on it, so its prefill
    stops a chunk at the branch (26) and leaves a checkpoint there; the third then prefills only its own tokens. In
    8-token chunks the first also leaves one after each chunk: the second starts from the one at 24 (2 tokens short
    of the prefix: no branch under the minimum of 16), which it keeps lasting, and so does the third. Greedy output
    is the cache-off run's."""
    shared = BASE[:26]
    prompts = [shared + [60, 61], shared + [70, 71, 72], shared + [80, 81]]
    opts = dict(chunked_prefill_size=chunk) if chunk else {}
    off = Engine(runner(model_dir, cache=False, **opts), eos_ids=[])
    want = [run(off, [p])[0][0] for p in prompts]
    r = runner(model_dir, **opts)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    engine.scheduler.branch_min_tokens = 16
    got, cached = [], []
    for p in prompts:
        outs, fins = run(engine, [p])
        got.append(outs[0])
        cached.append(fins[0].cached_tokens)
    # all four checkpoint ids in use (of the prompts' and answers' ends, the branch, the chunks: the least recent go)
    assert got == want and cached == ([0, 24, 24] if chunk else [0, 0, 26]) and r.kv.prefix.num_states == 4
    want_calls = [8, 8, 8, 4, 5, 4] if chunk else [len(prompts[0]), 26, 3, 2]
    assert calls == [[n] for n in want_calls]
    assert_no_state_leak(r)


def test_identical_and_contained_prompts_are_reused_after_a_branch(model_dir):
    """The cases above that no checkpoint covered, with a minimum branch under what they share: the second
    identical prompt stops at its last-but-one token and leaves a checkpoint there, which the third reuses; a prompt
    inside a cached one does the same at its own last-but-one token."""
    r = runner(model_dir)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    engine.scheduler.branch_min_tokens = 8
    outs = [run(engine, [p]) for p in (BASE, BASE, BASE, BASE[:25], BASE[:25])]
    assert calls == [[37], [36], [1], [1], [24], [1], [1]]
    assert [fins[0].cached_tokens for _, fins in outs] == [0, 0, 36, 0, 24]
    off = Engine(runner(model_dir, cache=False), eos_ids=[])
    assert [o[0] for o, _ in outs] == [run(off, [p])[0][0] for p in (BASE, BASE, BASE, BASE[:25], BASE[:25])]
    assert_no_state_leak(r)


def test_aborts_leave_consistent_checkpoints(model_dir):
    """Aborted requests (one before its first token, one mid-answer) still leave checkpoints of what they computed,
    and a follow-up turn built on the mid-answer one restores it."""
    off = Engine(runner(model_dir, cache=False), eos_ids=[])
    r = runner(model_dir)
    engine = Engine(r, eos_ids=[])
    prompts = [BASE[:15] + [1], BASE[:15] + [2], OTHER]
    outs, fins = run(engine, prompts, max_new=8, abort_after={0: 1, 1: 4})
    assert [ev.finish_reason for ev in fins] == ["abort", "abort", "length"]
    follow = prompts[1] + outs[1] + [77]
    want, _ = run(off, [follow])
    got, fins = run(engine, [follow])
    # overlapped decode: the step in flight when the abort came had fed the last token read (KV and state kept)
    fed = len(prompts[1]) + len(outs[1]) - (0 if engine.overlap else 1)
    assert got == want and fins[0].cached_tokens == fed
    assert_no_state_leak(r)


def test_one_checkpoint_and_a_tiny_pool_lose_no_request(model_dir):
    """Follow-up turns of several conversations through one checkpoint (each finish takes it from the last) and a
    100-token pool that evicts and preempts (a preempted request is re-admitted from its own checkpoint)."""
    starts = [BASE[: 10 + 4 * i] + [i] for i in range(4)]
    off = Engine(runner(model_dir, cache=False), eos_ids=[])
    answers, _ = run(off, starts, max_new=10)
    follow = [s + a + [60 + i] for i, (s, a) in enumerate(zip(starts, answers))]
    want, _ = run(off, follow, max_new=10)
    r = runner(model_dir, tokens=100, linear_att_cache_size=1)
    engine = Engine(r, eos_ids=[])
    preempted, real_preempt = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda req: (preempted.append(req.id), real_preempt(req))
    assert run(engine, starts, max_new=10)[0] == answers
    got, fins = run(engine, follow, max_new=10)
    assert got == want and all(ev.finish_reason == "length" for ev in fins)
    assert preempted and r.kv.prefix.num_states <= 1
    assert_no_state_leak(r)


def test_chunked_prefill_continues_from_a_restored_checkpoint(model_dir):
    """Two-token chunks: turn one in twelve, turn two's four new tokens in two after the restored state (few tokens
    after it, so a wrong state would show in the output: this tiny model's gates forget within tens of tokens)."""
    first, more = BASE[:24], [50, 51, 52]
    off = Engine(runner(model_dir, cache=False, chunked_prefill_size=2), eos_ids=[])
    answer, _ = run(off, [first])
    want, _ = run(off, [first + answer[0] + more])
    r = runner(model_dir, chunked_prefill_size=2)
    engine, calls = Engine(r, eos_ids=[]), counting(r)
    run(engine, [first])
    run(engine, [OTHER])
    got, fins = run(engine, [first + answer[0] + more])
    assert got == want and fins[0].cached_tokens == len(first) + len(answer[0]) - 1
    assert calls[-2:] == [[2], [2]]


def test_the_flag_sizes_the_checkpoints_and_zero_turns_the_cache_off(model_dir, caplog):
    r = runner(model_dir)
    assert r.kv.stateful and r.args.linear_att_cache_size == r.args.running_max_req_size  # the default
    assert r.model.linear.state.ssm.shape[1] == r.args.running_max_req_size + 1 + r.args.linear_att_cache_size
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        off = runner(model_dir, linear_att_cache_size=0)
    assert off.kv.prefix is None and off.model.linear.state.ssm.shape[1] == off.args.running_max_req_size + 1
    (line,) = [m for m in caplog.messages if m.startswith("prefix cache (dynamic prompt cache) off")]
    assert "--linear_att_cache_size is 0" in line
    with pytest.raises(ValueError, match="--linear_att_cache_size expected a non-negative integer"):
        EngineArgs(model_dir=model_dir, device="cpu", linear_att_cache_size=-1).normalize()


def test_a_failed_forward_leaves_no_checkpoint_of_its_half_advanced_state(model_dir):
    """A chunk's forward that raises after the first layers advanced the state: the request ends with "error", and
    its first chunk's KV stays in the tree with the checkpoint published after it, none of the failed chunk's, so
    the same prompt again starts from the first chunk's state and gives the cache-off output."""
    prompt = BASE[:20]
    want, _ = run(Engine(runner(model_dir, cache=False, chunked_prefill_size=8), eos_ids=[]), [prompt])
    r = runner(model_dir, chunked_prefill_size=8)
    real, calls = r.model.forward, []

    def forward(input_ids, state):
        calls.append(1)
        if len(calls) == 2:  # the second chunk: the request rows' state moved, then the forward fails
            r.model.linear.state.ssm[:, : r.model._checkpoint_base].add_(1.0)
            raise RuntimeError("injected failure")
        return real(input_ids, state)

    r.model.forward = forward
    engine = Engine(r, eos_ids=[])
    _, fins = run(engine, [prompt])
    assert fins[0].finish_reason == "error"
    assert r.kv.prefix.num_tokens == 8 and r.kv.prefix.num_states == 1
    got, fins = run(engine, [prompt])
    assert got == want and fins[0].cached_tokens == 8


def test_a_failed_decode_step_leaves_no_checkpoint(model_dir):
    """The same for a decode forward: the running requests end with "error" and leave their prompts' KV in the
    tree, and only the checkpoints published after their prompts (before the failed step), from which follow-ups
    give the cache-off output."""
    off = Engine(runner(model_dir, cache=False), eos_ids=[])
    prompts = [BASE[:12], OTHER]
    follow = [p + [77, 78] for p in prompts]
    want, _ = run(off, follow)
    r = runner(model_dir)
    real = r.model.forward

    def forward(input_ids, state):
        if not state.is_prefill:
            r.model.linear.state.ssm[:, : r.model._checkpoint_base].add_(1.0)  # the request rows' state moved
            raise RuntimeError("injected decode failure")
        return real(input_ids, state)

    r.model.forward = forward
    engine = Engine(r, eos_ids=[])
    _, fins = run(engine, prompts)
    assert [ev.finish_reason for ev in fins] == ["error", "error"]
    assert r.kv.prefix.num_tokens == 12 + len(OTHER) and r.kv.prefix.num_states == 2
    r.model.forward = real
    got, fins = run(engine, follow)
    assert got == want and [ev.cached_tokens for ev in fins] == [12, len(OTHER)]
    assert_no_state_leak(r)
