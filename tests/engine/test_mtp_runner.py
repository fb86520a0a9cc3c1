"""The runner's MTP steps keep KV, linear-attention state and the head's own KV exactly as a fresh start would
have them, whatever number of drafts each step accepts; rejected drafts leave no trace and nothing leaks."""

import contextlib

import pytest
import torch

from lightllm.common.kv_cache import KVCacheManager
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5

PROMPT = [7, 91, 3, 250, 18, 44, 120, 9, 61, 300, 5]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-mtp"), mtp=True, seed=11))


def cpu_runner(model_dir, **opts):
    base = dict(model_dir=model_dir, data_type="fp32", device="cpu", max_req_total_len=96, running_max_req_size=3)
    return ModelRunner(EngineArgs(**{**base, **opts}))


def first_draft_logits(runner, slot, last):
    seen = []

    def choose(k, logits):
        seen.append(logits[0].clone())
        return logits.argmax(-1)

    drafts = runner.mtp.draft([slot], [last], choose)
    return drafts[0].tolist(), seen[0]


def test_forced_acceptance_counts_leave_the_state_of_a_fresh_start(mtp_dir):
    """Accept 0..N drafts in turn (the tokens after them made up): every verify logit equals a plain prefill of the
    same context, and every first draft equals the head's over a fresh prefill of the whole context."""
    n = 3
    runner, plain = cpu_runner(mtp_dir, mtp_mode="eagle_with_att", mtp_step=n), cpu_runner(mtp_dir)
    slot = runner.add_request()
    last = int(runner.prefill([slot], [PROMPT]).argmax())
    context = list(PROMPT)
    for step, accepted in enumerate([0, 3, 1, 2, 0, 3]):
        drafts, logits = first_draft_logits(runner, slot, last)
        fresh = cpu_runner(mtp_dir, mtp_mode="eagle_with_att", mtp_step=n)
        fresh_slot = fresh.add_request()
        fresh.prefill([fresh_slot], [context])
        torch.testing.assert_close(logits, first_draft_logits(fresh, fresh_slot, last)[1], atol=1e-4, rtol=0)
        verified = runner.mtp.verify([slot], [last], [drafts])[0]
        for k in (accepted, n):
            want_slot = plain.add_request()
            want = plain.prefill([want_slot], [context + [last] + drafts[:k]])[0]
            plain.free(want_slot)
            torch.testing.assert_close(verified[k], want, atol=1e-4, rtol=0, msg=f"step {step} position {k}")
        bonus = (step * 37 + 11) % 400  # any token: the engine would have drawn it from verified[accepted]
        runner.mtp.accept([slot], [accepted])
        context += [last] + drafts[:accepted]
        last = bonus
        assert runner.kv.seq_len(slot) == len(context)


def test_the_windowed_first_draft_equals_a_packed_catch_up_of_its_real_rows(mtp_dir):
    """A step's catch-up runs over N + 1 rows per request whatever it accepted: its logits and hidden states are a
    packed prefill's over the real rows alone (the filler rows after them change nothing)."""
    from lightllm.layers.infer_state import InferState

    runner = cpu_runner(mtp_dir, mtp_mode="eagle_with_att", mtp_step=3)
    mtp, kv, T = runner.mtp, runner.kv, 4
    slots = [runner.add_request() for _ in range(3)]
    lasts = [int(t) for t in runner.prefill(slots, [PROMPT, PROMPT[:4], PROMPT[3:]]).argmax(-1)]
    argmax = lambda k, logits: logits.argmax(-1)  # noqa: E731
    for step, accepted in enumerate([[0, 2, 3], [3, 0, 1]]):
        runner.mtp.verify(slots, lasts, runner.mtp.draft(slots, lasts, argmax))
        mtp.accept(slots, accepted)
        lasts = [(step * 31 + 7 * i) % 400 for i in range(3)]  # any bonus tokens
    for s, t in zip(slots, lasts):
        mtp.follow[s].append(t)
    bases = [kv.seq_len(s) for s in slots]
    kv.extend_many(slots, [T] * 3)
    counts, starts = [len(mtp.follow[s]) - 1 for s in slots], [mtp.mtp_next[s] for s in slots]
    assert counts == [4, 1, 2]
    rows = torch.tensor([s for s, k in zip(slots, counts) for _ in range(k)])
    at = torch.tensor([p for b, k in zip(starts, counts) for p in range(b, b + k)])
    state = InferState.packed_prefill(slots, kv.table, starts, counts, kv.table[rows, at].long(), "cpu",
                                      max_position=mtp.max_position)  # fmt: skip
    ids = torch.tensor([t for s in slots for t in mtp.follow[s][1:]])
    hidden = torch.cat([mtp.pending[s][0][:k] for s, k in zip(slots, counts)])
    want = mtp.head.forward(ids, hidden, state, out_rows=torch.tensor([3, 4, 6]))
    got = mtp.first_draft(mtp._first_draft_inputs(slots), 3, max(bases) + T)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert [mtp.mtp_next[s] for s in slots] == [b + k for b, k in zip(starts, counts)] == bases


def test_requests_in_and_out_free_every_kv_token_and_slot(mtp_dir):
    from lightllm import LLM, SamplingParams

    llm = LLM(mtp_dir, data_type="fp32", device="cpu", max_req_total_len=96, running_max_req_size=3,
              mtp_mode="eagle_with_att", mtp_step=2)  # fmt: skip
    kv = llm.runner.kv
    start = (kv.num_free_tokens, kv.num_free_slots)
    for i in range(4):
        prompts = [PROMPT[: 3 + i], PROMPT, PROMPT[i:], [9] * (i + 1)]
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=7 + i, ignore_eos=True))
        assert all(len(o.token_ids) == 7 + i for o in outs)
    assert (kv.num_free_tokens, kv.num_free_slots) == start


def test_truncate_many_is_truncate_of_each_and_a_bad_count_changes_nothing():
    def rows():
        kv = KVCacheManager(64, 4, 16, "cpu")
        slots = [kv.add_request() for _ in range(3)]
        kv.extend_many(slots, [2, 5, 3])
        kv.extend_many(slots, [4, 4, 4])
        return kv, slots

    one, slots = rows()
    for slot, n in zip(slots, [3, 0, 4]):
        one.truncate(slot, n)
    many, _ = rows()
    many.truncate_many(slots, [3, 0, 4])
    assert [many.seq_len(s) for s in slots] == [one.seq_len(s) for s in slots] == [3, 9, 3]
    assert many.num_free_tokens == one.num_free_tokens == 64 - 15
    # the freed slots are handed out again (in another order: one free of the batch, not one per request)
    assert sorted(many.extend(slots[0], 7).tolist()) == sorted(one.extend(slots[0], 7).tolist())
    kv, _ = rows()
    before = (kv.num_free_tokens, [kv.seq_len(s) for s in slots])
    with pytest.raises(ValueError, match=r"truncate_many: n expected <= the 4 tokens of slot 2's last extend, got 5"):
        kv.truncate_many(slots, [1, 1, 5])
    with pytest.raises(ValueError, match=r"truncate_many: distinct slots and one count each expected"):
        kv.truncate_many(slots, [1, 1])
    assert (kv.num_free_tokens, [kv.seq_len(s) for s in slots]) == before


def test_truncate_frees_the_tail_of_the_last_extend_only():
    kv = KVCacheManager(32, 2, 16, "cpu")
    slot = kv.add_request()
    kv.extend(slot, 3)
    tail = kv.extend(slot, 4)
    free = kv.num_free_tokens
    kv.truncate(slot, 3)
    assert kv.seq_len(slot) == 4 and kv.num_free_tokens == free + 3
    assert kv.extend(slot, 3).tolist() != []  # the freed slots are handed out again
    kv.extend_each([slot])
    with pytest.raises(ValueError, match=r"n expected <= the 0 tokens of slot 0's last extend, got 1"):
        kv.truncate(slot, 1)
    assert kv.seq_len(slot) == 8 and tail.numel() == 4


class ReplayingGraphAPI:
    """A CPU stand-in for CUDA graphs: "replay" reruns the captured forward over the static buffers and copies its
    outputs into the graph's output tensors, as a real replay writes them. A replay whose batch holds a request
    longer than the graph's KV length bucket fails (a real graph's kernels would skip the keys past it)."""

    def __init__(self):
        self.runner, self.replays, self.buckets = None, {"verify": 0, "first_draft": 0, "draft": 0}, set()

    def new_graph(self):
        return object()

    def capture(self, graph, pool):
        return contextlib.nullcontext()

    def pool(self, graph):
        return None

    def memory_used(self):
        return 0

    def replay(self, graph):
        graphs = self.runner.mtp.graphs
        kinds = {"verify": graphs.verify, "first_draft": graphs.first, "draft": graphs.draft}
        for kind, captured in kinds.items():
            for (graph_len, bs), (g, outs) in captured.graphs.items() if captured is not None else ():
                if g is graph:
                    forward = getattr(graphs, f"_{kind}_forward")
                    if kind == "first_draft":  # its window's last row sees start + N + 1 tokens
                        longest = int(graphs.first_in["start"][:bs].max()) + self.runner.mtp.tokens
                    else:
                        longest = int(getattr(graphs, f"{kind}_in")["b_seq_len"][:bs].max())
                    assert longest <= graph_len, f"a {longest}-token request replayed the <= {graph_len} {kind} graph"
                    self.buckets.add(graph_len)
                    for out, new in zip(outs, forward(bs, graph_len)):
                        out.copy_(new)
                    self.replays[kind] += 1
                    return
        raise AssertionError("replay of a graph that was never captured")


@pytest.mark.parametrize("step", [1, 3])
def test_graph_replays_give_the_eager_tokens(mtp_dir, step):
    """Batches above the largest graph and requests past --graph_max_len_in_batch run eagerly, the rest through the
    static buffers (a batch of 2 in the graph of 3, with a padding row) of the KV length bucket up to 20 tokens, then
    of the one up to 24."""
    from lightllm.engine.engine import Engine
    from lightllm.engine.sampler import SamplingParams
    from tests.engine.test_scheduler import run_all

    def drafts_of(runner):  # every draft step's tokens: the head's graphs must draft what it drafts eagerly
        seen, draft = [], runner.mtp.draft
        runner.mtp.draft = lambda *a: seen.append(draft(*a).tolist()) or torch.tensor(seen[-1])
        return seen

    prompts = [PROMPT, PROMPT[:3], [5], PROMPT[2:9]]
    params = {i: SamplingParams(max_new_tokens=n, ignore_eos=True) for i, n in enumerate((14, 9, 20, 6))}
    opts = dict(mtp_mode="eagle_with_att", mtp_step=step, running_max_req_size=4)
    eager = cpu_runner(mtp_dir, **opts)
    eager_drafts = drafts_of(eager)
    want, _ = run_all(Engine(eager, eos_ids=[]), prompts, params=params)
    api = ReplayingGraphAPI()
    runner = ModelRunner(EngineArgs(model_dir=mtp_dir, data_type="fp32", device="cpu", max_req_total_len=96,
                                    graph_max_batch_size=3, graph_split_batch_size=1, graph_grow_step_size=2,
                                    graph_max_len_in_batch=24, graph_len_buckets=[20], **opts),
                         graph_api=api)  # fmt: skip
    api.runner = runner
    assert runner.graphs is None and runner.mtp.graphs.verify.batch_sizes == [1, 3]
    graph_drafts = drafts_of(runner)
    got, _ = run_all(Engine(runner, eos_ids=[]), prompts, params=params)
    assert got == want and graph_drafts == eager_drafts
    assert api.replays["verify"] == api.replays["first_draft"] > 0 and (api.replays["draft"] > 0) == (step > 1)
    assert api.buckets == {20, 24} and sorted(runner.decode_graph_costs) == [20, 24]
