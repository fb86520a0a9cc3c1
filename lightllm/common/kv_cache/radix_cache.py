"""The prefix cache (LightLLM's dynamic prompt cache): a radix tree over token ids whose nodes own KV pool slots.

A path from the root spells a token sequence; each node holds the pool slots of its own tokens. A request that
starts with a cached sequence *pins* its path (a reference count on every node of it) and reads those slots instead
of computing them; an unpinned node is evictable, least recently used leaf first, when the pool runs short.
Matching is at token granularity: a node is split where a sequence leaves it.

A node may also hold a *state checkpoint* (an id the caller owns the contents of): the state a model with
per-request state beside its KV (Qwen3.5's linear attention) had after the node's last token. For such a model a
cached prefix is usable only up to the deepest checkpoint on its path (``match(..., stateful=True)``). A checkpoint
belongs to the end of its node, so a split leaves it on the lower part; an evicted node frees its checkpoint through
``free_state``, and ``evict_state`` gives up the least recently used one when the caller runs out.

Eviction keeps its candidates in a heap that lives as long as the tree: a node is pushed whenever it becomes an
unpinned leaf (or, as one, is used again), and an entry that no longer describes its node is dropped when it comes up.
So an admission that evicts costs the leaves it takes, not a walk over every cached request (a full pool of 7 K cached
requests: 4.9 ms a request before, 0.6 now, ``benchmarks/prefix_evict_cost.py``).

Only bookkeeping: the manager decides when to pin, insert and evict; slots are returned through ``free_slots``.
"""

import heapq
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


class _Node:
    __slots__ = ("key", "slots", "children", "parent", "refs", "last_used", "serial", "state", "lasting")
    _serials = itertools.count()  # ties in LRU order break by creation, the same on every tensor-parallel rank

    def __init__(self, key: List[int], slots: torch.Tensor, parent: Optional["_Node"]):
        self.key = key  # its token ids
        self.slots = slots  # CPU int64 [len(key)]: the pool slot of each
        self.children: Dict[int, "_Node"] = {}  # by first token id
        self.parent = parent
        self.refs = 0  # requests whose pinned path runs through it
        self.last_used = 0
        self.serial = next(_Node._serials)
        self.state: Optional[int] = None  # checkpoint id: the state after this node's last token
        self.lasting = False  # the checkpoint ends a prompt, a branch or a request (not a chunk inside a prompt)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share: compared 1024 at a time as slices (C speed), then item by item in
    the block where they part, so two long sequences that part early cost that block, not their length."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + 1024] == b[i : i + 1024]:
        i += 1024
    if i >= n:
        return n
    return next((j for j in range(i, min(i + 1024, n)) if a[j] != b[j]), min(i + 1024, n))


class RadixCache:
    """Token-id prefixes and the KV slots that hold them. ``free_slots(indices)`` takes back evicted slots."""

    def __init__(self, free_slots: Callable[[torch.Tensor], None], free_state: Callable[[int], None] = lambda i: None):
        self.free_slots = free_slots
        self.free_state = free_state
        self._stateful: Dict[int, _Node] = {}  # checkpoint id -> the node holding it
        self.root = _Node([], torch.empty(0, dtype=torch.int64), None)
        self.root.refs = 1  # never evicted
        self.num_tokens = 0  # slots the tree owns
        self.num_evictable = 0  # of them, in unpinned nodes
        self._clock = itertools.count(1)  # LRU order; a counter, not time, so tensor-parallel ranks agree
        # Eviction candidates, (last_used, serial, push, node): every unpinned leaf has an entry with its current
        # last_used; entries a node has outgrown (pinned, given a child, used again, evicted) are skipped when popped
        self._leaves: List[Tuple[int, int, int, _Node]] = []
        self._pushes = itertools.count()  # breaks ties between two entries of one node: nodes do not compare
        self._num_nodes = 0  # below the root

    # ---- queries -------------------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], stateful: bool = False) -> Tuple[int, int]:
        """(how many leading ``tokens`` are cached, how many of those sit in unpinned nodes); changes nothing.
        ``stateful``: cached up to the deepest state checkpoint on their path (0 without one)."""
        kv, usable = self._match(tokens)
        return usable if stateful else kv

    def match_with_branch(self, tokens: Sequence[int]) -> Tuple[int, int, int]:
        """``match(tokens, stateful=True)`` and, third, how many leading ``tokens`` are cached whatever the
        checkpoints (``match(tokens)[0]``), from one walk: where a checkpoint would make more of them usable."""
        kv, usable = self._match(tokens)
        return usable[0], usable[1], kv[0]

    def _match(self, tokens: Sequence[int]) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """``match(tokens)`` and ``match(tokens, stateful=True)``."""
        node, i, unpinned, usable = self.root, 0, 0, (0, 0)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens[i : i + len(child.key)])
            unpinned += n if child.refs == 0 else 0
            i += n
            if n < len(child.key):
                break
            node = child
            if node.state is not None:
                usable = (i, unpinned)
        return (i, unpinned), usable

    @property
    def num_states(self) -> int:
        """State checkpoints the tree holds."""
        return len(self._stateful)

    # ---- changes -------------------------------------------------------------------------------------------

    def pin(self, tokens: Sequence[int]) -> Tuple[_Node, torch.Tensor]:
        """Pin the path spelling ``tokens`` (all cached: ``ValueError`` otherwise, nothing changed): its last node
        (for ``unpin``) and the slots of ``tokens``."""
        cached, _ = self.match(tokens)
        if cached < len(tokens):
            raise ValueError(f"RadixCache.pin: tokens expected a cached prefix, got {len(tokens)} tokens of which "
                             f"{cached} are cached")  # fmt: skip
        node, _, parts = self._walk(tokens)
        self.pin_node(node)
        return node, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def pin_node(self, node: _Node) -> None:
        """``pin`` of the path ending at ``node`` (a node of this tree, the root for none), from the node up: its
        length in nodes, not tokens."""
        now = next(self._clock)
        while node is not self.root:
            if node.refs == 0:
                self.num_evictable -= len(node.key)
            node.refs += 1
            node.last_used = now
            node = node.parent

    def unpin(self, node: _Node) -> None:
        """Undo one ``pin`` that returned ``node``."""
        while node is not self.root:
            if node.refs <= 0:
                raise RuntimeError("RadixCache.unpin: a node's reference count would go negative (unpinned twice)")
            node.refs -= 1
            if node.refs == 0:
                self.num_evictable += len(node.key)
                self._offer(node)
            node = node.parent

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Keep ``slots`` (CPU int64, one per token) as the KV of ``tokens``. Returns how many leading tokens were
        cached already: the tree keeps its own slots for those, so the caller still owns (and frees) the first that
        many of ``slots``; the tree owns the rest."""
        return self.insert_after(self.root, tokens, slots)[0]

    def insert_after(self, node: _Node, tokens: Sequence[int], slots: torch.Tensor) -> Tuple[int, _Node, torch.Tensor]:
        """``insert`` of ``tokens`` after the path ending at ``node`` (a request's pinned node, so one that no
        eviction can take; the root for none), walking from there: the tokens after a running request's published
        part cost their own length, not the whole prefix's. Returns (how many leading ``tokens`` were cached
        already, the node where ``tokens`` end (split there if needed), the tree's slots of ``tokens``)."""
        if slots.numel() != len(tokens):
            raise ValueError(f"RadixCache.insert: slots expected one per token ({len(tokens)}), got "
                             f"{slots.numel()}")  # fmt: skip
        node, cached, parts = self._walk(tokens, node)
        if cached < len(tokens):
            leaf = _Node(list(tokens[cached:]), slots[cached:].clone(), node)
            leaf.last_used = next(self._clock)
            node.children[leaf.key[0]] = leaf
            self._num_nodes += 1
            self.num_tokens += len(leaf.key)
            self.num_evictable += len(leaf.key)
            self._offer(leaf)
            parts.append(leaf.slots)
            node = leaf
        return cached, node, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def attach_state(self, tokens: Sequence[int], take: Callable[[], Optional[int]], lasting: bool = True
                     ) -> Optional[int]:  # fmt: skip
        """Record a checkpoint after the cached ``tokens`` (``ValueError`` if they are not all cached), its id from
        ``take()``, which is called only when there is none there yet; the id, or None when ``tokens`` is empty, a
        checkpoint is there already (made ``lasting`` if this one is: the same state) or ``take()`` gave none.
        ``take`` may call ``evict_state``. A checkpoint that is not ``lasting`` (after a chunk inside a prompt) is
        given up before any lasting one."""
        cached, _ = self.match(tokens)
        if cached < len(tokens):
            raise ValueError(f"RadixCache.attach_state: tokens expected a cached prefix, got {len(tokens)} tokens of "
                             f"which {cached} are cached")  # fmt: skip
        node, _, _ = self._walk(tokens)
        return self.attach_at(node, take, lasting)

    def attach_at(self, node: _Node, take: Callable[[], Optional[int]], lasting: bool = True) -> Optional[int]:
        """``attach_state`` at the end of ``node`` (the root: none), without walking to it."""
        if node is self.root or node.state is not None:
            node.lasting = node.lasting or lasting
            return None
        state = take()  # never this node's (it has none): evict_state picks among nodes that have one
        if state is None:
            return None
        node.state, node.lasting = state, lasting
        node.last_used = next(self._clock)
        self._offer(node)  # an unpinned leaf's entry now has an old last_used
        self._stateful[state] = node
        return state

    def evict_state(self) -> Optional[int]:
        """Give up the least recently used state checkpoint, one that is not lasting if there is any (its node's KV
        stays); its id, None when there is none. A pinned path's checkpoint may go too: whoever pinned it has read
        it already."""
        if not self._stateful:
            return None
        node = min(self._stateful.values(), key=lambda n: (n.lasting, n.last_used, n.serial))
        del self._stateful[node.state]
        state, node.state = node.state, None
        return state

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (or all evictable ones), least recently used unpinned leaves first;
        returns how many were freed. The slots go back in one ``free_slots`` call, in the order per-leaf calls
        would have returned them (last evicted first), so the pool hands them out again in the same order."""
        freed, slots = 0, []
        while freed < num_tokens and self._leaves:
            last_used, _, _, leaf = heapq.heappop(self._leaves)
            if leaf.parent is None or leaf.refs or leaf.children or leaf.last_used != last_used:
                continue  # outgrown (the node is evicted, pinned, a parent, or has a newer entry)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None  # evicted: its other entries are skipped
            self._num_nodes -= 1
            slots.append(leaf.slots)
            if leaf.state is not None:
                del self._stateful[leaf.state]
                self.free_state(leaf.state)
            freed += len(leaf.key)
            self.num_tokens -= len(leaf.key)
            self.num_evictable -= len(leaf.key)
            self._offer(parent)
        if slots:
            self.free_slots(torch.cat(slots[::-1]))
        return freed

    def clear(self) -> int:
        """Free every slot (``RuntimeError`` if a request still pins a path); how many."""
        if self.num_evictable != self.num_tokens:
            raise RuntimeError(f"RadixCache.clear: {self.num_tokens - self.num_evictable} cached tokens are pinned by "
                               "running requests")  # fmt: skip
        return self.evict(self.num_tokens)

    # ---- helpers -------------------------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int], node: Optional[_Node] = None) -> Tuple[_Node, int, List[torch.Tensor]]:
        """From ``node`` (the root by default) along ``tokens`` while the tree holds them: the node where the held ones
        end (split there if they end inside one), how many are held, and the slots along."""
        node, i, parts = self.root if node is None else node, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens[i : i + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            parts.append(child.slots)
            node, i = child, i + n
        return node, i, parts

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after its first ``n`` tokens; the new upper part (same pins, same age, no checkpoint: the
        node's belongs to its end) is returned. ``node`` keeps its eviction entry: it is the same leaf, or not."""
        upper = _Node(node.key[:n], node.slots[:n], node.parent)
        upper.refs, upper.last_used = node.refs, node.last_used
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        self._num_nodes += 1
        return upper

    def _offer(self, node: _Node) -> None:
        """An eviction entry for ``node`` if it is an unpinned leaf now (the root never is: it holds a pin). Entries
        outgrown by their nodes pile up as requests pin and unpin; past twice the nodes the heap is made anew."""
        if node.refs or node.children:
            return
        heapq.heappush(self._leaves, (node.last_used, node.serial, next(self._pushes), node))
        if len(self._leaves) > 2 * self._num_nodes + 64:
            self._leaves = [(n.last_used, n.serial, next(self._pushes), n) for n in self._nodes()
                            if not n.refs and not n.children]  # fmt: skip
            heapq.heapify(self._leaves)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
