import random

import pytest
import torch

from lightllm.common.kv_cache import KVCacheFull, KVCacheManager, ReqSlotAllocator, TokenAllocator


def test_token_alloc_free_accounting():
    alloc = TokenAllocator(10)
    assert (alloc.num_free, alloc.num_used) == (10, 0)
    a = alloc.alloc(4)
    assert a.dtype == torch.int64 and a.device.type == "cpu" and a.tolist() == [0, 1, 2, 3]
    b = alloc.alloc(3)
    assert (alloc.num_free, alloc.num_used) == (3, 7)
    assert len(set(a.tolist()) | set(b.tolist())) == 7
    alloc.free(a[1:3])
    assert (alloc.num_free, alloc.num_used) == (5, 5)
    c = alloc.alloc(5)
    assert sorted(c.tolist()) == [1, 2, 7, 8, 9] and alloc.num_free == 0
    assert alloc.alloc(0).numel() == 0
    alloc.free(torch.cat([a[:1], a[3:], b, c]))
    assert (alloc.num_free, alloc.num_used) == (10, 0)
    assert sorted(alloc.alloc(10).tolist()) == list(range(10))


def test_token_free_accepts_lists_and_other_int_dtypes():
    alloc = TokenAllocator(6)
    idx = alloc.alloc(4)
    alloc.free(idx[:2].to(torch.int32))
    alloc.free(idx[2:].tolist())
    alloc.free([])
    assert alloc.num_free == 6


def test_token_exhaustion_message_and_no_change():
    alloc = TokenAllocator(8)
    alloc.alloc(5)
    with pytest.raises(KVCacheFull, match="asked for 4 tokens, only 3 of 8 are free"):
        alloc.alloc(4)
    assert alloc.num_free == 3 and alloc.can_alloc(3) and not alloc.can_alloc(4)
    assert isinstance(KVCacheFull("x"), RuntimeError)


def test_token_bad_frees_raise_and_keep_accounting():
    alloc = TokenAllocator(8)
    idx = alloc.alloc(4)
    alloc.free(idx[:1])
    with pytest.raises(ValueError, match=r"double free or never allocated.*\[0\]"):
        alloc.free(idx[:2])  # 0 already free, 1 in use: nothing may change
    with pytest.raises(ValueError, match="double free or never allocated"):
        alloc.free([6])  # never handed out
    with pytest.raises(ValueError, match="distinct"):
        alloc.free([2, 2])
    with pytest.raises(ValueError, match=r"indices expected values in \[0, 8\), got range \[-1, 3\]"):
        alloc.free([3, -1])
    with pytest.raises(ValueError, match="indices expected values"):
        alloc.free([8])
    assert (alloc.num_free, alloc.num_used) == (5, 3)
    alloc.free(idx[1:])
    assert alloc.num_free == 8


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: TokenAllocator(0), "num_tokens expected an int >= 1, got 0"),
        (lambda: TokenAllocator(2.0), "num_tokens expected an int, got float"),
        (lambda: TokenAllocator(4).alloc(-1), "n expected an int >= 0, got -1"),
        (lambda: TokenAllocator(4).alloc(True), "n expected an int, got bool"),
        (lambda: TokenAllocator(4).free(torch.zeros(2, 2, dtype=torch.int64)), "indices expected a 1-D tensor"),
        (lambda: TokenAllocator(4).free(torch.zeros(2)), "indices expected an integer tensor"),
        (lambda: TokenAllocator(4).free([1.5]), "indices expected an integer tensor, got dtype torch.float32"),
        (lambda: ReqSlotAllocator(0), "max_reqs expected an int >= 1, got 0"),
    ],
    ids=[
        "tokens-zero",
        "tokens-float",
        "alloc-negative",
        "alloc-bool",
        "free-2d",
        "free-float",
        "free-float-list",
        "slots-zero",
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_req_slots():
    slots = ReqSlotAllocator(3)
    got = [slots.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and slots.num_free == 0 and slots.num_used == 3
    with pytest.raises(KVCacheFull, match="0 of 3 are free"):
        slots.alloc()
    slots.free(1)
    with pytest.raises(ValueError, match="free slot 1"):
        slots.free(1)
    with pytest.raises(ValueError, match=r"slot expected a value in \[0, 3\), got 3"):
        slots.free(3)
    with pytest.raises(ValueError, match="slot expected an int >= 0, got -1"):
        slots.free(-1)
    assert (slots.num_free, slots.num_used) == (1, 2)
    assert slots.alloc() == 1


def test_manager_extend_writes_table():
    mgr = KVCacheManager(num_tokens=16, max_reqs=2, max_len=6, device="cpu")
    assert mgr.table.shape == (2, 6) and mgr.table.dtype == torch.int32
    a, b = mgr.add_request(), mgr.add_request()
    ta = mgr.extend(a, 3)
    tb = mgr.extend(b, 2)
    ta2 = mgr.extend(a, 1)
    assert mgr.extend(a, 0).numel() == 0
    assert (mgr.seq_len(a), mgr.seq_len(b), mgr.num_free_tokens) == (4, 2, 10)
    assert mgr.table[a, :4].tolist() == torch.cat([ta, ta2]).tolist()
    assert mgr.table[b, :2].tolist() == tb.tolist()
    assert len(set(mgr.table[a, :4].tolist()) | set(mgr.table[b, :2].tolist())) == 6


def test_manager_limits_change_nothing():
    mgr = KVCacheManager(num_tokens=8, max_reqs=2, max_len=5, device="cpu")
    a = mgr.add_request()
    mgr.extend(a, 4)
    with pytest.raises(ValueError, match=r"n expected <= 1 \(max_len 5, slot 0 holds 4\), got 2"):
        mgr.extend(a, 2)
    b = mgr.add_request()
    mgr.extend(b, 3)
    with pytest.raises(KVCacheFull, match="asked for 2 tokens, only 1 of 8"):
        mgr.extend(b, 2)
    assert (mgr.seq_len(a), mgr.seq_len(b), mgr.num_free_tokens) == (4, 3, 1)
    with pytest.raises(KVCacheFull, match="request slot"):
        mgr.add_request()
    mgr.free_request(a)
    with pytest.raises(ValueError, match="free slot 0"):
        mgr.free_request(a)
    with pytest.raises(ValueError, match="free slot 0"):
        mgr.extend(a, 1)
    with pytest.raises(ValueError, match="free slot 0"):
        mgr.seq_len(a)
    with pytest.raises(ValueError, match="num_tokens expected <= 2147483648"):
        KVCacheManager(num_tokens=2**31 + 1, max_reqs=1, max_len=1, device="cpu")
    assert mgr.num_free_tokens == 5 and mgr.num_free_slots == 1


def test_manager_random_cycles_never_leak():
    rng = random.Random(0)
    num_tokens = 40
    mgr = KVCacheManager(num_tokens=num_tokens, max_reqs=6, max_len=20, device="cpu")
    live, refused = {}, set()
    for _ in range(400):
        op = rng.random()
        if op < 0.2 and mgr.num_free_slots:
            live[mgr.add_request()] = []
        elif op < 0.6 and live:
            slot = rng.choice(list(live))
            n = rng.randint(0, 6)
            try:
                live[slot] += mgr.extend(slot, n).tolist()
            except (KVCacheFull, ValueError) as e:
                refused.add(type(e))  # the check below proves a refusal changed nothing
        elif op < 0.85 and live:  # a decode step over some of the live requests
            slots = rng.sample(list(live), rng.randint(1, len(live)))
            try:
                for slot, t in zip(slots, mgr.extend_each(slots).tolist()):
                    live[slot].append(t)
            except (KVCacheFull, ValueError) as e:
                refused.add(type(e))
        elif live:
            slot = rng.choice(list(live))
            mgr.free_request(slot)
            del live[slot]
        held = [t for toks in live.values() for t in toks]
        assert len(set(held)) == len(held) and mgr.num_free_tokens == num_tokens - len(held)
        for slot, toks in live.items():
            assert mgr.seq_len(slot) == len(toks) and mgr.table[slot, : len(toks)].tolist() == toks
    assert refused == {KVCacheFull, ValueError}  # both the pool and max_len limits were hit
    for slot in list(live):
        mgr.free_request(slot)
    assert mgr.num_free_tokens == num_tokens and mgr.num_free_slots == 6


def test_extend_each_is_one_token_per_slot():
    for contiguous in (False, True):
        m = KVCacheManager(3 * 8, max_reqs=3, max_len=8, device="cpu", contiguous_slots=contiguous)
        a, b, c = m.add_request(), m.add_request(), m.add_request()
        m.extend(a, 3)
        m.extend(c, 7)
        new = m.extend_each([c, a, b])
        assert [m.seq_len(s) for s in (a, b, c)] == [4, 1, 8]
        assert [int(m.table[s, m.seq_len(s) - 1]) for s in (c, a, b)] == new.tolist()
        assert m.extend_each([]).numel() == 0
        with pytest.raises(ValueError, match=r"slots \[2\] already hold max_len 8"):
            m.extend_each([a, c])
        with pytest.raises(ValueError, match="slots expected distinct"):
            m.extend_each([a, a])
        assert [m.seq_len(s) for s in (a, b, c)] == [4, 1, 8]  # refusals changed nothing
        for s in (a, b, c):
            m.free_request(s)
        assert m.num_free_tokens == 24


def test_contiguous_slots_layout():
    from lightllm.common.kv_cache import KVCacheManager

    m = KVCacheManager(4 * 16, max_reqs=4, max_len=16, device="cpu", contiguous_slots=True)
    a, b = m.add_request(), m.add_request()
    assert m.extend(b, 3).tolist() == [b * 16, b * 16 + 1, b * 16 + 2]
    assert m.extend(b, 2).tolist() == [b * 16 + 3, b * 16 + 4]
    assert m.extend(a, 1).tolist() == [a * 16]
    assert m.table[b, :5].tolist() == list(range(b * 16, b * 16 + 5))
    assert m.num_free_tokens == 64 - 6
    with pytest.raises(ValueError, match="n expected <= 11"):
        m.extend(b, 12)
    m.free_request(b)
    assert m.num_free_tokens == 64 - 1
    c = m.add_request()
    assert m.extend(c, 2).tolist() == [c * 16, c * 16 + 1]
    with pytest.raises(ValueError, match="num_tokens expected max_reqs \\* max_len = 64"):
        KVCacheManager(63, max_reqs=4, max_len=16, device="cpu", contiguous_slots=True)


def test_extend_each_can_leave_the_table_write_to_the_caller():
    """A staged decode step writes the new slots into the device table from its staged copy (no transfer of its
    own): extend_each(write_table=False) does the bookkeeping and leaves the table as it was."""
    m = KVCacheManager(16, max_reqs=2, max_len=8, device="cpu")
    a, b = m.add_request(), m.add_request()
    m.extend(a, 2)
    before = m.table.clone()
    new = m.extend_each([a, b], write_table=False)
    assert [m.seq_len(s) for s in (a, b)] == [3, 1] and new.numel() == 2
    assert torch.equal(m.table, before)


@pytest.mark.parametrize("bad", [3, -1, 4, 9, True, 1.0],
                         ids=["free", "negative", "max_reqs", "out-of-range", "bool", "float"])  # fmt: skip
def test_batch_slot_checks_name_the_first_bad_slot_as_the_single_checks_do(bad):
    """Every kind of bad slot, the first past the range (max_reqs) included, is the single check's ValueError."""
    m = KVCacheManager(32, max_reqs=4, max_len=8, device="cpu", prefix_cache=True)
    a, b = m.add_request(), m.add_request()
    m.extend(a, 2)
    with pytest.raises(ValueError) as single:
        m.seq_len(bad)
    for call in (m.seq_lens, m.extend_each):
        with pytest.raises(ValueError) as batch:
            call([a, bad, b])
        assert str(batch.value).split(": ", 1)[1] == str(single.value).split(": ", 1)[1]
    assert m.seq_lens([b, a]) == [0, 2] and m.seq_lens([]) == []  # the refused extend_each changed nothing


def test_computed_each_is_computed_one_token_per_slot():
    """What ``computed_each`` records goes to the prefix cache at free_request, as ``computed`` of each token."""
    batch, single = (KVCacheManager(32, max_reqs=4, max_len=8, device="cpu", prefix_cache=True) for _ in range(2))
    for m in (batch, single):
        a, b = m.add_request(), m.add_request()
        m.extend(a, 2), m.extend(b, 1)
        m.computed(a, [5, 6]), m.computed(b, [7])
        m.extend_each([a, b])
    batch.computed_each([a, b], [8, 9])
    single.computed(a, (8,)), single.computed(b, (9,))
    for m in (batch, single):
        m.free_request(a), m.free_request(b)
    assert [batch.match_prefix(ids) for ids in ([5, 6, 8], [7, 9], [5, 6, 9])] == [(3, 3), (2, 2), (2, 2)]
    assert [single.match_prefix(ids) for ids in ([5, 6, 8], [7, 9], [5, 6, 9])] == [(3, 3), (2, 2), (2, 2)]


def test_a_chunk_after_decode_steps_keeps_the_row_order_in_the_prefix_cache():
    """A mixed step extends a decoding request by a one-token chunk (``extend``) after its decode steps
    (``extend_each``): the tree must map each token id to the KV slot at its own position of the row, so a later
    request that reuses the prefix reads the right KV."""
    m = KVCacheManager(64, max_reqs=4, max_len=16, device="cpu", prefix_cache=True)
    a = m.add_request()
    m.extend(a, 3), m.computed(a, [1, 2, 3])  # prefill
    for tok in (4, 5):  # two decode steps
        m.extend_each([a]), m.computed_each([a], [tok])
    m.extend(a, 1), m.computed(a, [6])  # a mixed step's one-token chunk
    m.extend_each([a]), m.computed_each([a], [7])  # a decode step after it
    row = m.table[a, :7].tolist()
    m.free_request(a)
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 7])[0] == 7
    b = m.add_request([1, 2, 3, 4, 5, 6, 7])
    assert m.table[b, :7].tolist() == row


@pytest.mark.parametrize("contiguous", [False, True], ids=["pool", "contiguous"])
def test_extend_many_is_extend_of_each_in_one_write(contiguous):
    """A prefill step's extends at once: the same rows, token order, lengths and (freed) pool as one ``extend`` per
    request, after decode steps too; a bad batch is refused naming the problem with nothing changed."""
    kw = dict(max_reqs=4, max_len=8, device="cpu", contiguous_slots=contiguous, prefix_cache=not contiguous)
    many, each = (KVCacheManager(32, **kw) for _ in range(2))
    for m in (many, each):
        a, b, c = m.add_request(), m.add_request(), m.add_request()
        m.extend_each([a, b])
    got = many.extend_many([c, a, b], [3, 0, 2])
    want = torch.cat([each.extend(c, 3), each.extend(a, 0), each.extend(b, 2)])
    assert torch.equal(got, want) and torch.equal(many.table, each.table)
    assert many.seq_lens([a, b, c]) == each.seq_lens([a, b, c]) == [1, 3, 3]
    before = (many.table.clone(), many.seq_lens([a, b, c]), many.num_free_tokens)
    for slots, counts, match in (([a, a], [1, 1], "distinct slots and one count each"),
                                 ([a, b], [1], "distinct slots and one count each"),
                                 ([a, b], [1, 6], r"n expected <= 5 \(max_len 8, slot 1 holds 3\), got 6"),
                                 ([a, b], [1, -1], "n expected an int >= 0"),
                                 ([a, 3], [1, 1], "slot")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            many.extend_many(slots, counts)
        assert torch.equal(many.table, before[0]) and (many.seq_lens([a, b, c]), many.num_free_tokens) == before[1:]
    for m in (many, each):
        for slot in (a, b, c):
            m.free_request(slot)
    assert many.num_free_tokens == each.num_free_tokens
