"""The prefix cache: token-granular matches, pins that keep a running request's prefix from eviction, LRU eviction,
and a stress test of random admissions and finishes against a plain model of what every pool slot holds."""

import random

import pytest
import torch

from lightllm.common.kv_cache import KVCacheManager
from lightllm.common.kv_cache.radix_cache import RadixCache


def tree_with(*seqs):
    freed = []
    tree = RadixCache(lambda idx: freed.extend(idx.tolist()))
    nxt = 0
    for seq in seqs:
        tree.insert(seq, torch.arange(nxt, nxt + len(seq)))
        nxt += len(seq)
    return tree, freed


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


def test_manager_refuses_a_prefix_without_the_cache():
    kv = KVCacheManager(16, 2, 8, "cpu")
    with pytest.raises(ValueError, match="prefix expected empty without the prefix cache, got 2 tokens"):
        kv.add_request([1, 2])
    with pytest.raises(ValueError, match="prefix_cache expected a shared token pool"):
        KVCacheManager(16, 2, 8, "cpu", contiguous_slots=True, prefix_cache=True)


def _path_refs(tree):
    """{node: (its path's token ids, refs)} for every node."""
    out, stack = {}, [(c, []) for c in tree.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key
        out[node] = (path, node.refs)
        stack.extend((c, path) for c in node.children.values())
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_admissions_and_finishes_keep_the_tree_consistent(seed):
    """Requests share prefixes of a few base prompts; they are admitted as the scheduler does (a hit counts its
    evictable tokens as taken) and finish in random order, under a pool small enough to evict. A model of every
    slot's content (the token ids its KV was computed from) proves that a reused prefix holds exactly the
    request's tokens; after every operation pins match the live requests and no count goes negative."""
    rng = random.Random(seed)
    total, max_len = 64, 24
    kv = KVCacheManager(total, 6, max_len, "cpu", prefix_cache=True)
    content = {}  # slot -> the token ids (from position 0) whose last one's KV the slot holds
    bases = [[rng.randrange(5) for _ in range(max_len)] for _ in range(3)]
    live = {}  # request slot -> (its token ids, tokens pinned at admission)
    evictions = hits = 0
    for _ in range(300):
        if live and (rng.random() < 0.4 or not kv.has_free_slot()):
            slot = rng.choice(list(live))
            del live[slot]
            kv.free_request(slot)
        else:
            base = rng.choice(bases)
            ids = base[: rng.randrange(2, max_len)] + [rng.randrange(5) for _ in range(rng.randrange(3))]
            ids = ids[:max_len]
            cached, evictable = kv.match_prefix(ids[:-1])
            if not kv.can_allocate(len(ids) - cached + evictable):
                continue
            before = kv.prefix.num_tokens
            slot = kv.add_request(ids[:cached])
            row = kv.table[slot, :cached].tolist()
            assert [content[s] for s in row] == [tuple(ids[: i + 1]) for i in range(cached)]
            new = kv.extend(slot, len(ids) - cached)
            evictions += before > kv.prefix.num_tokens
            for i, s in enumerate(new.tolist(), start=cached):
                content[s] = tuple(ids[: i + 1])
            kv.computed(slot, ids[cached:])
            live[slot] = (ids, cached)
            hits += cached > 0
        nodes = _path_refs(kv.prefix)
        for node, (path, refs) in nodes.items():
            want = sum(len(path) <= pinned and ids[: len(path)] == path for ids, pinned in live.values())
            assert refs == want >= 0
            assert [content[s] for s in node.slots.tolist()] == [tuple(path[: len(path) - len(node.key) + i + 1])
                                                                 for i in range(len(node.key))]  # fmt: skip
        assert kv.prefix.num_tokens == sum(len(n.key) for n in nodes)
        assert kv.prefix.num_evictable == sum(len(n.key) for n in nodes if n.refs == 0)
        held = sum(kv.seq_len(s) - pinned for s, (_, pinned) in live.items())
        assert kv.tokens.num_free + kv.prefix.num_tokens + held == total  # no slot leaked or counted twice
    assert evictions > 0 and hits > 0
    for slot in list(live):
        kv.free_request(slot)
    assert kv.tokens.num_free == total - kv.prefix.num_tokens
    kv.prefix.clear()
    assert kv.tokens.num_free == total and kv.num_free_tokens == total
