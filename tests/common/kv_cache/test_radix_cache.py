"""The prefix cache: token-granular matches, pins that keep a running request's prefix from eviction, LRU eviction,
and a stress test of random admissions and finishes against a plain model of what every pool slot holds."""

import heapq
import itertools
import random

import pytest
import torch

from lightllm.common.kv_cache import KVCacheManager
from lightllm.common.kv_cache.radix_cache import RadixCache, common_prefix_len


def tree_with(*seqs):
    freed = []
    tree = RadixCache(lambda idx: freed.extend(idx.tolist()))
    nxt = 0
    for seq in seqs:
        tree.insert(seq, torch.arange(nxt, nxt + len(seq)))
        nxt += len(seq)
    return tree, freed


def test_common_prefix_len_is_where_two_sequences_part():
    """Against an item-by-item count, for lengths around the 1024-item blocks it compares at once."""
    rng = random.Random(0)
    for _ in range(500):
        base = [rng.randrange(3) for _ in range(3000)]
        a, b = base[: rng.randrange(3000)], list(base[: rng.randrange(3000)])
        if b and rng.random() < 0.7:
            b[rng.randrange(len(b))] += 1
        n = min(len(a), len(b))
        assert common_prefix_len(a, b) == next((i for i in range(n) if a[i] != b[i]), n)


def test_matches_at_token_granularity():
    tree, _ = tree_with(list(range(50)))
    assert tree.match(list(range(37)) + [99, 98]) == (37, 37)
    assert tree.match(list(range(60))) == (50, 50)
    assert tree.match([7, 8]) == (0, 0)
    node, slots = tree.pin(list(range(37)))  # splits the node after 37 tokens
    assert slots.tolist() == list(range(37))
    assert tree.match(list(range(50))) == (50, 13) and tree.num_evictable == 13
    tree.unpin(node)
    assert tree.num_evictable == tree.num_tokens == 50


def test_insert_keeps_the_tree_slots_of_what_it_already_holds():
    tree, _ = tree_with([1, 2, 3, 4])
    assert tree.insert([1, 2, 9], torch.tensor([10, 11, 12])) == 2  # the caller still owns slots 10 and 11
    assert tree.num_tokens == 5
    _, slots = tree.pin([1, 2, 9])
    assert slots.tolist() == [0, 1, 12]


def test_insert_after_a_pinned_node_walks_from_there():
    """``insert_after`` (a running row's publish) from the node its pin ends at: what it held already (splitting a
    node where the tokens leave it), a new leaf for the rest, the tree's slots of all of them; ``pin_node`` and
    ``attach_at`` act on the node it returns as ``pin`` and ``attach_state`` do on the tokens."""
    tree, _ = tree_with([1, 2, 3, 4, 5, 6])
    node, _ = tree.pin([1, 2])
    assert tree.insert_after(node, [], torch.empty(0, dtype=torch.int64))[:2] == (0, node)
    cached, end, slots = tree.insert_after(node, [3, 4, 9, 9], torch.tensor([20, 21, 22, 23]))
    assert cached == 2 and slots.tolist() == [2, 3, 22, 23] and tree.num_tokens == 8
    assert tree.match([1, 2, 3, 4, 5, 6]) == (6, 4) and tree.match([1, 2, 3, 4, 9, 9]) == (6, 4)
    tree.pin_node(end)
    tree.unpin(node)
    assert tree.num_evictable == 2  # [5, 6]: the path to [.., 9, 9] is pinned
    assert tree.attach_at(end, lambda: 7) == 7 and tree.match([1, 2, 3, 4, 9, 9, 1], stateful=True) == (6, 0)
    assert tree.attach_at(end, lambda: 8) is None and tree.attach_at(tree.root, lambda: 8) is None
    tree.unpin(end)
    assert tree.num_evictable == tree.num_tokens == 8


def test_pin_of_an_uncached_prefix_changes_nothing():
    tree, _ = tree_with([1, 2, 3])
    with pytest.raises(ValueError, match="expected a cached prefix, got 4 tokens of which 3 are cached"):
        tree.pin([1, 2, 3, 4])
    assert tree.num_evictable == 3


def test_unpinning_twice_is_refused():
    tree, _ = tree_with([1, 2, 3])
    node, _ = tree.pin([1, 2])
    tree.unpin(node)
    with pytest.raises(RuntimeError, match="negative"):
        tree.unpin(node)


def test_eviction_takes_the_least_recently_used_unpinned_leaves():
    tree, freed = tree_with([1, 2, 3], [5, 6], [8, 9, 10, 11])
    tree.pin([1, 2, 3])  # pinned: never evicted
    node, _ = tree.pin([8, 9])
    tree.unpin(node)  # [8..11] used after [5, 6]
    assert tree.evict(1) == 2 and sorted(freed) == [3, 4]
    assert tree.evict(100) == 4 and tree.num_tokens == 3 and tree.num_evictable == 0
    with pytest.raises(RuntimeError, match="3 cached tokens are pinned"):
        tree.clear()


def _lru_leaves(tree, num_tokens):
    """The leaves ``tree.evict(num_tokens)`` must take, in order, by the rule itself over a walk of every node: the
    least recently used unpinned leaf first (ties by creation), a parent joining once its last child is taken."""
    nodes, stack = [], list(tree.root.children.values())
    while stack:
        nodes.append(stack.pop())
        stack.extend(nodes[-1].children.values())
    children = {id(n): len(n.children) for n in nodes}
    heap = [(n.last_used, n.serial, n) for n in nodes if n.refs == 0 and not n.children]
    heapq.heapify(heap)
    taken, freed = [], 0
    while freed < num_tokens and heap:
        leaf = heapq.heappop(heap)[2]
        taken.append(leaf)
        freed += len(leaf.key)
        parent = leaf.parent
        if parent is not tree.root:
            children[id(parent)] -= 1
            if parent.refs == 0 and not children[id(parent)]:
                heapq.heappush(heap, (parent.last_used, parent.serial, parent))
    return taken


@pytest.mark.parametrize("seed", range(6))
def test_eviction_follows_the_lru_rule_of_a_full_walk_through_pins_splits_and_checkpoints(seed):
    """Random inserts (sharing prefixes, so nodes split), pins, unpins, checkpoints and evictions: every eviction
    takes exactly the leaves a walk over the whole tree picks by the rule, and hands their slots back in one call,
    last taken first (the order per-leaf calls gave the pool); the heap of candidates stays within its bound."""
    rng = random.Random(seed)
    calls = []
    tree = RadixCache(calls.append)
    pins, nxt, states = [], 0, itertools.count()
    bases = [[rng.randrange(4) for _ in range(12)] for _ in range(4)]
    for _ in range(600):
        op = rng.random()
        if op < 0.4:
            seq = rng.choice(bases)[: rng.randrange(1, 12)] + [rng.randrange(4) for _ in range(rng.randrange(4))]
            cached, _ = tree.match(seq)
            tree.insert(seq, torch.arange(nxt, nxt + len(seq)))
            nxt += len(seq)
            if rng.random() < 0.3:
                tree.attach_state(seq[: rng.randrange(1, len(seq) + 1)], lambda: next(states), rng.random() < 0.5)
        elif op < 0.6 and tree.num_tokens:
            seq = rng.choice(bases)[: rng.randrange(1, 12)]
            cached, _ = tree.match(seq)
            if cached:
                pins.append(tree.pin(seq[:cached])[0])
        elif op < 0.75 and pins:
            tree.unpin(pins.pop(rng.randrange(len(pins))))
        else:
            want = rng.randrange(1, 12)
            taken = _lru_leaves(tree, want)
            expected = [s for leaf in reversed(taken) for s in leaf.slots.tolist()]
            calls.clear()
            assert tree.evict(want) == len(expected)
            assert [s for c in calls for s in c.tolist()] == expected and len(calls) == (1 if taken else 0)
        nodes = len(_path_refs(tree))
        assert tree._num_nodes == nodes and len(tree._leaves) <= 2 * nodes + 65
    while pins:
        tree.unpin(pins.pop())
    held = tree.num_tokens
    assert tree.clear() == held and tree.num_tokens == 0 and tree._num_nodes == 0 and tree.num_states == 0


def test_an_eviction_does_not_walk_the_tree():
    """A full cache admits each request by evicting an old one: that costs the leaves taken, not a walk over every
    cached request. The heap is rebuilt (one walk) only once it holds more than twice as many entries as the tree has
    nodes, which takes hundreds of pins."""
    tree = RadixCache(lambda idx: None)
    walks = []
    real = tree._nodes
    tree._nodes = lambda: walks.append(1) or real()
    rng = random.Random(0)
    for i in range(300):
        tree.insert([i] + [rng.randrange(100) for _ in range(7)], torch.arange(8 * i, 8 * i + 8))
    for i in range(300, 1300):
        assert tree.evict(8) == 8
        tree.insert([i] + [rng.randrange(100) for _ in range(7)], torch.arange(8 * i, 8 * i + 8))
        node, _ = tree.pin(tree.root.children[i].key)  # a request that reads it, then finishes
        tree.unpin(node)
    assert tree._num_nodes == 300 and not walks and len(tree._leaves) <= 2 * 300 + 65
    for i in range(1000):  # requests reading cached prefixes, none evicting: entries pile up until a rebuild
        node, _ = tree.pin(tree.root.children[rng.randrange(1000, 1300)].key)
        tree.unpin(node)
        assert len(tree._leaves) <= 2 * tree._num_nodes + 65
    assert 1 <= len(walks) <= 1000 // 300 + 1  # a walk per pushes of at least the node count


def test_state_checkpoints_sit_at_node_ends_and_bound_a_stateful_match():
    freed_states = []
    tree = RadixCache(lambda idx: None, freed_states.append)
    tree.insert([1, 2, 3, 4, 5], torch.arange(5))
    assert tree.match([1, 2, 3, 4, 5, 6], stateful=True) == (0, 0)  # no checkpoint: nothing usable
    taken = []
    take = lambda n: lambda: taken.append(n) or n  # noqa: E731
    assert tree.attach_state([1, 2, 3], take(7)) == 7 and tree.attach_state([1, 2, 3], take(8)) is None
    assert taken == [7]  # no id is taken where a checkpoint is already
    assert tree.attach_state([], take(9)) is None and tree.attach_state([1, 2], lambda: None) is None
    with pytest.raises(ValueError, match="tokens expected a cached prefix, got 6 tokens of which 5 are cached"):
        tree.attach_state([1, 2, 3, 4, 5, 6], take(9))
    assert tree.match([1, 2, 3, 4, 5, 6], stateful=True) == (3, 3) and tree.match([1, 2, 3, 4, 5, 6]) == (5, 5)
    assert tree.match([1, 2], stateful=True) == (0, 0)  # the checkpoint lies past the tokens
    tree.pin([1, 2])  # splits [1, 2] off: the checkpoint stays at the end of [1, 2, 3]
    assert tree.match([1, 2, 3, 9], stateful=True) == (3, 1)
    assert tree.attach_state([1, 2, 3, 4, 5], take(8)) == 8 and tree.num_states == 2
    assert tree.evict(100) == 3 and freed_states == [8, 7]  # evicted nodes give their checkpoints back
    assert tree.num_states == 0


def test_the_least_recently_used_checkpoint_is_given_up_first():
    tree = RadixCache(lambda idx: None)
    tree.insert([1, 2], torch.arange(2))
    tree.insert([5, 6], torch.arange(2, 4))
    assert tree.attach_state([5, 6], lambda: 0) == 0 and tree.attach_state([1, 2], lambda: 1) == 1
    tree.pin([5, 6])  # used again after [1, 2]'s checkpoint was made
    assert tree.evict_state() == 1 and tree.match([1, 2, 3], stateful=True) == (0, 0)
    assert tree.evict_state() == 0 and tree.evict_state() is None
    assert tree.num_tokens == 4  # the KV stays


def test_a_checkpoint_made_now_makes_its_node_the_most_recently_used():
    """Recording a checkpoint is a use of its node: the KV of an older untouched prefix is evicted before it."""
    tree, freed = tree_with([1, 2], [5, 6])  # [1, 2] older
    assert tree.attach_state([1, 2], lambda: 0) == 0
    assert tree.evict(2) == 2 and freed == [2, 3]  # [5, 6]'s slots
    assert tree.match([1, 2, 9], stateful=True) == (2, 2)


def test_checkpoints_of_chunks_inside_a_prompt_are_given_up_first():
    """A checkpoint that is not lasting (a chunk's) goes before any lasting one, however recent; recording a lasting
    one where it is makes it lasting, and so does a request that starts from it (the manager's admission)."""
    tree = RadixCache(lambda idx: None)
    for i, seq in enumerate(([1, 2], [5, 6], [7, 8])):
        tree.insert(seq, torch.arange(2 * i, 2 * i + 2))
    assert tree.attach_state([1, 2], lambda: 0) == 0  # lasting, the oldest
    assert tree.attach_state([5, 6], lambda: 1, lasting=False) == 1
    assert tree.attach_state([7, 8], lambda: 2, lasting=False) == 2
    assert tree.attach_state([7, 8], lambda: 9) is None  # one there: now lasting, the same state
    assert tree.evict_state() == 1 and tree.evict_state() == 0 and tree.evict_state() == 2

    kv = KVCacheManager(32, 2, 16, "cpu", prefix_cache=True, state_checkpoints=2)
    a = kv.add_request()
    kv.extend(a, 4)
    kv.computed(a, [1, 2, 3, 4])
    assert kv.publish(a, lasting=False) == 0  # a chunk inside the prompt
    kv.extend(a, 2)
    kv.computed(a, [5, 6])
    assert kv.publish(a) == 1 and kv.free_request(a) is None  # the prompt's end, which is also the request's
    b = kv.add_request([1, 2, 3, 4])  # starts from the chunk's checkpoint: lasting from now on, and just used
    kv.extend(b, 1)
    kv.computed(b, [7])
    assert kv.publish(b) == 1  # both ids lasting: the least recently used, [1..6]'s, is given up
    assert kv.match_prefix([1, 2, 3, 4, 8]) == (4, 0) and kv.match_prefix([1, 2, 3, 4, 5, 6, 9]) == (4, 0)
    kv.free_request(b)


def test_a_chunk_s_checkpoint_where_a_lasting_one_is_leaves_it_lasting():
    """Recording a checkpoint that is not lasting (a chunk's end inside a later prompt) where a lasting one is changes
    nothing: the same state stays lasting, and the newer chunk's checkpoint is given up before it."""
    tree, _ = tree_with([1, 2], [5, 6])
    assert tree.attach_state([1, 2], lambda: 0) == 0  # a prompt's end: lasting, the oldest
    assert tree.attach_state([5, 6], lambda: 1, lasting=False) == 1
    assert tree.attach_state([1, 2], lambda: pytest.fail("took an id where a checkpoint is"), lasting=False) is None
    assert tree.evict_state() == 1 and tree.evict_state() == 0 and tree.evict_state() is None


def test_manager_refuses_a_prefix_without_the_cache():
    kv = KVCacheManager(16, 2, 8, "cpu")
    with pytest.raises(ValueError, match="prefix expected empty without the prefix cache, got 2 tokens"):
        kv.add_request([1, 2])
    with pytest.raises(ValueError, match="prefix_cache expected a shared token pool"):
        KVCacheManager(16, 2, 8, "cpu", contiguous_slots=True, prefix_cache=True)
    with pytest.raises(ValueError, match="state_checkpoints expected 0 without the prefix cache, got 2"):
        KVCacheManager(16, 2, 8, "cpu", state_checkpoints=2)


def test_manager_with_state_checkpoints_reuses_a_prefix_only_up_to_one():
    kv = KVCacheManager(32, 3, 16, "cpu", prefix_cache=True, state_checkpoints=1)
    slot = kv.add_request()
    kv.extend(slot, 5)
    kv.computed(slot, [1, 2, 3, 4, 5])
    assert kv.prefix_state(slot) is None and kv.free_request(slot) == 0  # fill checkpoint 0 with its state
    assert kv.match_prefix([1, 2, 3, 4, 5, 6]) == (5, 5) and kv.match_prefix([1, 2, 3, 4]) == (0, 0)
    with pytest.raises(ValueError, match="prefix expected to end at a state checkpoint"):
        kv.add_request([1, 2, 3])
    assert kv.num_free_slots == 3  # the refused request took no slot
    slot = kv.add_request([1, 2, 3, 4, 5])
    assert kv.prefix_state(slot) == 0
    kv.extend(slot, 2)
    kv.computed(slot, [6, 7])
    assert kv.free_request(slot) == 0  # the only checkpoint, taken back from [1..5] for [1..7]
    assert kv.match_prefix([1, 2, 3, 4, 5, 6]) == (0, 0) and kv.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == (7, 7)
    slot = kv.add_request()
    assert kv.free_request(slot) is None  # nothing computed: no checkpoint


def test_the_branch_is_where_the_cached_kv_goes_past_the_last_checkpoint():
    """A request sharing more KV with the tree than its checkpoints cover learns where (the branch); publishing a
    row whose computed tokens stop there records a checkpoint, after which the whole shared prefix is usable."""
    plain = KVCacheManager(32, 2, 16, "cpu", prefix_cache=True)
    slot = plain.add_request()
    plain.extend(slot, 4)
    plain.computed(slot, [1, 2, 3, 4])
    plain.free_request(slot)
    assert plain.match_prefix_with_branch([1, 2, 3, 9]) == (3, 3, 0)  # no state: every cached token is usable

    kv = KVCacheManager(64, 3, 16, "cpu", prefix_cache=True, state_checkpoints=3)
    slot = kv.add_request()
    kv.extend(slot, 6)
    kv.computed(slot, [1, 2, 3, 4, 5, 6])
    assert kv.free_request(slot) == 0  # the end of [1..6]
    assert kv.match_prefix_with_branch([1, 2, 3, 4, 7]) == (0, 0, 4)
    assert kv.match_prefix_with_branch([1, 2, 3, 4, 5, 6, 7]) == (6, 6, 0)  # the checkpoint covers the hit
    assert kv.match_prefix_with_branch([8, 9]) == (0, 0, 0)
    slot = kv.add_request()  # [1, 2, 3, 4, 7, ...]: its prefill stops at the branch, 4
    kv.extend(slot, 4)
    kv.computed(slot, [1, 2, 3, 4])
    assert kv.publish(slot) == 1  # the caller copies the row's state into checkpoint 1
    assert kv.publish(slot) is None  # one there already
    assert kv.match_prefix_with_branch([1, 2, 3, 4, 8]) == (4, 0, 0)  # usable now, pinned by the running row
    kv.extend(slot, 1)
    kv.computed(slot, [7])
    assert kv.free_request(slot) == 2 and kv.prefix.num_states == 3
    assert kv.match_prefix_with_branch([1, 2, 3, 4, 8]) == (4, 4, 0)


def test_a_published_row_shares_its_tokens_while_it_runs():
    """``publish`` puts a running row's computed tokens into the tree, pinned: a second request reuses them at
    once, nothing can evict them, and when both end every slot is accounted for (the tree's, the free list's)."""
    kv = KVCacheManager(24, 3, 16, "cpu", prefix_cache=True)
    assert kv.publish(kv.add_request()) is None  # nothing computed yet
    kv.free_request(0)
    a = kv.add_request()
    kv.extend(a, 5)
    kv.computed(a, [1, 2, 3, 4, 5])
    kv.extend(a, 1)  # a decode step's token whose forward has not returned: only the computed ones go in
    assert kv.publish(a) is None and kv.prefix.num_tokens == 5
    kv.computed(a, [6])
    assert kv.publish(a) is None  # without state checkpoints: no id, but the tokens are in
    assert kv.match_prefix([1, 2, 3, 4, 5, 6, 9]) == (6, 0) and kv.prefix.num_evictable == 0
    assert kv.num_free_tokens == 24 - 6  # the row's tokens, now the tree's, pinned: not free
    kv.prefix.evict(24)
    assert kv.prefix.num_tokens == 6  # pinned: nothing evicted
    b = kv.add_request([1, 2, 3, 4])  # reuses a's slots
    assert kv.table[b, :4].tolist() == kv.table[a, :4].tolist()
    kv.extend(b, 2)
    kv.computed(b, [7, 8])
    kv.publish(b)  # [1..4] + [7, 8]: the tree splits a's node at 4
    kv.extend(a, 1)
    kv.computed(a, [10])
    kv.free_request(a)  # the tree keeps [1..6] (its own since publish) and takes token 10
    assert kv.prefix.num_tokens == 9 and kv.prefix.num_evictable == 3  # b pins [1..4] + [7, 8]
    kv.free_request(b)
    assert kv.prefix.num_evictable == kv.prefix.num_tokens == 9 and kv.tokens.num_free == 24 - 9
    kv.prefix.clear()
    assert kv.tokens.num_free == 24


def _path_refs(tree):
    """{node: (its path's token ids, refs)} for every node."""
    out, stack = {}, [(c, []) for c in tree.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key
        out[node] = (path, node.refs)
        stack.extend((c, path) for c in node.children.values())
    return out


@pytest.mark.parametrize("checkpoints", [0, 3], ids=["kv only", "state checkpoints"])
@pytest.mark.parametrize("seed", range(4))
def test_random_admissions_and_finishes_keep_the_tree_consistent(seed, checkpoints):
    """Requests share prefixes of a few base prompts; they are admitted as the scheduler does (a hit counts its
    evictable tokens as taken) and finish in random order, under a pool small enough to evict. A model of every
    slot's content (the token ids its KV was computed from) proves that a reused prefix holds exactly the
    request's tokens; after every operation pins match the live requests and no count goes negative. With state
    checkpoints (three, fewer than the finishes: they are reused) a model of each checkpoint's content (the token
    ids of the request whose state was saved into it) proves that a hit starts from the state of exactly its
    prefix, and that every node's checkpoint holds its path's state. As in the engine, rows are published while they
    run (at their branch, at the end of their prompt), which pins what they computed and hands it to the tree."""
    rng = random.Random(seed)
    total, max_len = 64, 24
    kv = KVCacheManager(total, 6, max_len, "cpu", prefix_cache=True, state_checkpoints=checkpoints)
    content = {}  # slot -> the token ids (from position 0) whose last one's KV the slot holds
    saved = {}  # checkpoint id -> the token ids whose state it holds
    bases = [[rng.randrange(5) for _ in range(max_len)] for _ in range(3)]
    live = {}  # request slot -> (its token ids, its leading tokens whose slots are the tree's, pinned)
    evictions = hits = branches = 0
    for _ in range(300):
        if live and (rng.random() < 0.4 or not kv.has_free_slot()):
            slot = rng.choice(list(live))
            ids, _ = live.pop(slot)
            state = kv.free_request(slot)
            if state is not None:  # the runner copies the row's state (after all of ids) into it
                saved[state] = tuple(ids)
        else:
            base = rng.choice(bases)
            ids = base[: rng.randrange(2, max_len)] + [rng.randrange(5) for _ in range(rng.randrange(3))]
            ids = ids[:max_len]
            cached, evictable, branch = kv.match_prefix_with_branch(ids[:-1])
            assert (cached, evictable) == kv.match_prefix(ids[:-1]) and (branch == 0 or branch > cached)
            if not kv.can_allocate(len(ids) - cached + evictable + 1):  # + a decode step's token, as admission
                continue
            before = kv.prefix.num_tokens
            slot = kv.add_request(ids[:cached])
            row = kv.table[slot, :cached].tolist()
            assert [content[s] for s in row] == [tuple(ids[: i + 1]) for i in range(cached)]
            if checkpoints and cached:
                assert saved[kv.prefix_state(slot)] == tuple(ids[:cached])
            # as the engine does: the prefill stops at the branch, then goes on to the end of the prompt, and the
            # row is published at both (with checkpoints, the runner copies the row's state into the id it gets)
            pinned = cached  # the row's leading tokens whose slots are the tree's, pinned by it
            for start, end in [(cached, branch), (branch, len(ids))] if branch else [(cached, len(ids))]:
                new = kv.extend(slot, end - start)
                for i, s in enumerate(new.tolist(), start=start):
                    content[s] = tuple(ids[: i + 1])
                kv.computed(slot, ids[start:end])
                if rng.random() < 0.7:  # and sometimes not: a row that never published ends the same way
                    pinned = end  # the tree's slots from then on (the row's duplicates freed)
                    state = kv.publish(slot, lasting=end == len(ids) or rng.random() < 0.5)
                    row = kv.table[slot, :end].tolist()  # the row reads slots holding exactly its tokens' KV
                    assert row == kv._row_tokens(slot).tolist()[:end]
                    assert [content[s] for s in row] == [tuple(ids[: i + 1]) for i in range(end)]
                    branches += end == branch
                    if state is not None:
                        saved[state] = tuple(ids[:end])
            if len(ids) < max_len and rng.random() < 0.3:  # a decode step, published too (a mixed step's chunk)
                token = rng.randrange(5)
                (new,) = kv.extend_each([slot]).tolist()
                content[new] = tuple(ids) + (token,)
                kv.computed_each([slot], [token])
                ids = ids + [token]
                if rng.random() < 0.5:
                    pinned = len(ids)
                    state = kv.publish(slot)
                    row = kv.table[slot, : len(ids)].tolist()
                    assert row == kv._row_tokens(slot).tolist() and content[row[-1]] == tuple(ids)
                    if state is not None:
                        saved[state] = tuple(ids)
            evictions += before > kv.prefix.num_tokens
            live[slot] = (ids, pinned)
            hits += cached > 0
        nodes = _path_refs(kv.prefix)
        for node, (path, refs) in nodes.items():
            want = sum(len(path) <= pinned and ids[: len(path)] == path for ids, pinned in live.values())
            assert refs == want >= 0
            assert [content[s] for s in node.slots.tolist()] == [tuple(path[: len(path) - len(node.key) + i + 1])
                                                                 for i in range(len(node.key))]  # fmt: skip
            if node.state is not None:
                assert saved[node.state] == tuple(path)
        states = [n.state for n in nodes if n.state is not None]
        assert len(set(states)) == len(states) == kv.prefix.num_states
        assert sorted(states + kv._free_states) == list(range(checkpoints))
        assert kv.prefix.num_tokens == sum(len(n.key) for n in nodes)
        assert kv.prefix.num_evictable == sum(len(n.key) for n in nodes if n.refs == 0)
        held = sum(kv.seq_len(s) - pinned for s, (_, pinned) in live.items())  # the rows' own slots
        assert kv.tokens.num_free + kv.prefix.num_tokens + held == total  # no slot leaked or counted twice
    assert evictions > 0 and hits > 0
    if checkpoints:
        assert len(saved) == checkpoints and branches > 0  # every id used, some several times
    for slot in list(live):
        kv.free_request(slot)
    assert kv.tokens.num_free == total - kv.prefix.num_tokens
    kv.prefix.clear()
    assert kv.tokens.num_free == total and kv.num_free_tokens == total
    assert sorted(kv._free_states) == list(range(checkpoints)) and kv.prefix.num_states == 0
