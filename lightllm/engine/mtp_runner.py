"""The model runner's side of MTP speculative decoding: per-request bookkeeping, draft, verify and accept.

Positions: a request whose KV holds positions ``0 .. m - 1`` and whose last emitted token ``t_m`` is not in the KV
yet. The MTP head's entry at position ``i`` reads the main model's hidden state ``h_i`` and the token ``t_{i+1}``
that followed it, so it lags the main model by one token. Each request keeps, since ``mtp_next`` (its first
position without a correct head entry): the main hidden states of the positions up to ``m - 1`` (``pending``) and
the tokens from ``t_{mtp_next}`` on (``follow``). A forward of the head over ``pending`` with ``follow[1:]`` as its
tokens brings the head's KV up to date ("catch-up"); a prefill chunk catches up all but its last position.

A step (the engine's ``spec_decode``):
1. ``draft``: the KV grows by ``T = N + 1`` tokens (positions ``m .. m + N``); the catch-up over the pending
   positions (``k``, 1 .. T of them), now followed by ``t_m``, gives the first draft's logits; ``N - 1`` more head
   steps at positions ``m .. m + N - 2``, each fed the previous draft and the head's own output hidden state, give
   the others. The engine's ``choose`` picks each draft token (argmax, or a draw from the draft distribution).
   A step's catch-up runs over a fixed window of ``T`` rows per request (``first_draft``: one shape, so one CUDA
   graph), its ``k`` real rows first; the rows past them sit at positions ``m ..``, which the draft steps (and the
   next catch-up) rewrite before anything reads them, so they are harmless to compute.
2. ``verify``: one main-model forward over ``[t_m, d_1 .. d_N]`` (``q_len = T``); the linear-attention state
   starts from the request's current slot and the state after token ``t`` goes to the row's slot ``t``.
3. ``accept``: with ``a`` drafts accepted, the KV keeps positions ``m .. m + a`` and the rest is freed
   (``KVCacheManager.truncate``); slot ``a`` becomes current; the head's speculative entries past ``m - 1`` are
   rewritten by the next catch-up, from the verify's hidden states.

With the prefix cache a slot's KV is whole once the head's entry there is written, and that entry reads the next
token: the manager keys each slot by its token and the next (``next_token_keys``), and the catch-ups book the slots
they complete (``kv.computed``). A prefill chunk with a known next token (``following``: one inside a prompt) is
caught up to its end, so it is published with a state checkpoint; a prompt's end gets its checkpoint at the first
draft, whose catch-up completes its last slot before the verify moves the state on; a request's end, at ``finish``,
a last catch-up over the positions still pending once the token after them is known. A request admitted with a
cached prefix starts with the head caught up to its end (``reset``).
"""

import os
import weakref
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from lightllm.common.kv_cache.manager import next_token_keys
from lightllm.common.transfer import host_to_device, tensor_to_device
from lightllm.layers import parallel
from lightllm.layers.infer_state import InferState, packed_positions


class MTPRunner:
    def __init__(self, runner, step: int, max_reqs: int):
        # A proxy, not a reference: the runner holds this object, and a cycle would keep the runner's GPU memory
        # (weights, KV, graphs) until the next garbage collection after ``del llm``, not at once
        self.runner, self.kv, self.model = weakref.proxy(runner), runner.kv, runner.model
        self.tp = runner.tp
        self.head = runner.model.mtp
        self.step, self.tokens = step, step + 1
        self.max_position = runner.config.max_position_embeddings - 1
        self.current = [0] * max_reqs  # which of the row's T state slots holds its state
        self.mtp_next = [0] * max_reqs
        self.pending: List[List[torch.Tensor]] = [[] for _ in range(max_reqs)]  # hidden [k, H] pieces
        self.follow: List[List[int]] = [[] for _ in range(max_reqs)]
        self._drafts: Optional[List[List[int]]] = None  # this step's drafts on the host, once read
        self._draft_dev: Optional[torch.Tensor] = None  # this step's drafts [B, N] on the device
        self._hidden = None  # the verify's hidden states [B, T, H]
        self._completed: list = []  # (slot, tokens) of the slots this step's first draft completes, booked after it
        self.publish_at_draft: set = set()  # rows whose prompt end is checkpointed at their first draft
        self.graphs = None  # MTPGraphs once captured

    def capture_graphs(self, batch_sizes: Sequence[int], graph_lens: Sequence[int], api=None) -> None:
        from lightllm.engine.mtp_graphs import MTPGraphs

        self.graphs = MTPGraphs(self, batch_sizes, graph_lens, api)

    def reset(self, slot: int, cached: int = 0) -> None:
        """A fresh request in ``slot``: state slot 0 current, its KV empty or ``cached`` tokens from the prefix cache
        (whose head entries are whole: their keys hold the next token)."""
        self.current[slot], self.mtp_next[slot], self.pending[slot], self.follow[slot] = 0, cached, [], []
        self.publish_at_draft.discard(slot)

    def state_idx(self, slots: Sequence[int], device) -> torch.Tensor:
        return host_to_device([s * self.tokens + self.current[s] for s in slots], torch.int32, torch.device(device))

    # ---- prefill -------------------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor, state: InferState, slots: Sequence[int],
                prompts: Sequence[Sequence[int]], following: Sequence[Optional[int]] = ()) -> torch.Tensor:  # fmt: skip
        """The main prefill forward (logits of each request's last token), then the head's catch-up over every
        chunk position whose next token is known: all but the last, or all of them where ``following`` (one per
        row, None after a prompt's end) gives the token after the chunk."""
        for slot, prompt in zip(slots, prompts):
            if self.kv.seq_len(slot) == len(prompt):  # its first chunk: a fresh request in this row
                self.reset(slot)
        state.state_idx = self.state_idx(slots, input_ids.device)
        logits, hidden = self.model.forward(input_ids, state, keep_hidden=True)
        following = list(following) or [None] * len(slots)
        for slot, part, prompt, after in zip(slots, hidden.split([len(p) for p in prompts]), prompts, following):
            self.pending[slot].append(part)
            self.follow[slot].extend(prompt)
            if after is not None:
                self.follow[slot].append(after)
        self._catch_up([s for s in slots if len(self.follow[s]) > 1])
        for slot, after in zip(slots, following):
            if after is not None:  # caught up to the chunk's end; the next chunk brings that token again
                self.follow[slot].pop()
        return logits

    def finish(self, slot: int, last_token: int) -> None:
        """The request in ``slot`` ends with ``last_token`` emitted (not in its KV): the head catches up over its
        pending positions, now that the token after the last of them is known, so its whole KV (and, once the row
        is freed, a checkpoint of its state after it) goes to the prefix cache. Nothing when none is pending, or
        when its last step did not complete (the KV holds more positions than it knows tokens of)."""
        follow = self.follow[slot]
        if not follow or self.mtp_next[slot] + len(follow) != self.kv.seq_len(slot):
            return
        if sum(p.shape[0] for p in self.pending[slot]) < len(follow):
            return
        follow.append(last_token)
        self._catch_up([slot])

    def _catch_up(self, slots: Sequence[int]) -> None:
        """The head over each slot's pending prompt positions followed by known tokens (all but the last pending
        one): its KV writes, as one packed prefill."""
        if not slots:
            return
        dev, table, i64 = self.runner.device, self.kv.table, torch.int64
        counts = [len(self.follow[s]) - 1 for s in slots]
        starts = [self.mtp_next[s] for s in slots]
        parts = []
        for s, k in zip(slots, counts):
            pending = self.pending[s]
            if len(pending) == 1 and pending[0].shape[0] == k:  # a decode step's: exactly the accepted positions
                parts.append(pending[0])
                self.pending[s] = []
            else:
                whole = torch.cat(pending) if len(pending) > 1 else pending[0]
                parts.append(whole[:k])
                self.pending[s] = [whole[k:]]
        hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        ids = [t for s in slots for t in self.follow[s][1:]]
        # every small input through pinned memory (host_to_device): a pageable copy would make the host wait
        positions = host_to_device(packed_positions(starts, counts), i64, dev)
        rows = host_to_device(np.repeat(np.asarray(slots, dtype=np.int64), counts), i64, dev)
        state = InferState.packed_prefill(slots, table, starts, counts, table[rows, positions].long(), dev,
                                          max_position=self.max_position)  # fmt: skip
        self.head.forward(host_to_device(ids, i64, dev), hidden, state)
        for s, k in zip(slots, counts):
            self._book(s, self.follow[s][: k + 1])
            self.mtp_next[s] += k
            self.follow[s] = self.follow[s][k:]

    def _book(self, slot: int, tokens: Sequence[int]) -> None:
        """The slots of ``tokens[:-1]`` (after the row's booked ones) are whole now, their head entries written:
        the prefix cache may take them, keyed with the token after each."""
        if self.kv.prefix is not None:
            self.kv.computed(slot, next_token_keys(tokens))

    def _first_draft_inputs(self, slots: Sequence[int]) -> dict:
        """The step's catch-up as ``first_draft`` takes it: ``T`` rows per request, the ``k`` pending ones first
        (tokens ``follow[1:]``, the pending hidden states), then filler (token 0, the rest of the verify's hidden
        window or zeros)."""
        T, dev = self.tokens, self.runner.device
        windows, ids, starts, lasts = [], [], [], []
        for s in slots:
            k = len(self.follow[s]) - 1
            pending = self.pending[s]
            if k > T:  # pending holds one decode step's positions at most (a prefill catches up all but its last)
                raise RuntimeError(f"MTP draft: slot {s} has {k} positions to catch up, expected at most {T}")
            if len(pending) == 1 and pending[0].shape[0] == T:  # the last verify's window, its k rows first
                windows.append(pending[0])
            else:  # a request's first decode step: its prefill's last position
                rows = torch.cat(pending) if len(pending) > 1 else pending[0]
                windows.append(torch.cat([rows[:k], rows.new_zeros(T - k, rows.shape[1])]))
            ids.extend(self.follow[s][1:])
            ids.extend([0] * (T - k))
            self._completed.append((s, self.follow[s][: k + 1]))
            starts.append(self.mtp_next[s])
            lasts.append(k - 1)
            self.pending[s] = []
            self.mtp_next[s] += k
            self.follow[s] = self.follow[s][k:]
        i64 = dict(dtype=torch.int64, device=dev)
        return {"input_ids": host_to_device(ids, **i64), "hidden": torch.stack(windows).flatten(0, 1),
                "start": host_to_device(starts, **i64), "last": host_to_device(lasts, **i64),
                "b_req_idx": host_to_device(slots, torch.int32, dev)}  # fmt: skip

    def first_draft(self, b: dict, bs: int, max_len: int, graph_len: Optional[int] = None):
        """The head over the catch-up window of ``bs`` requests (``b``: ``_first_draft_inputs``' columns, or a
        graph's static buffers): its KV writes at positions ``start .. start + T - 1``, and the logits and output
        hidden state of each request's last real row (``last``). One shape for any ``k``: the CUDA graph's."""
        T = self.tokens
        start, b_req_idx = b["start"][:bs], b["b_req_idx"][:bs]
        at = start[:, None] + torch.arange(T, device=start.device)
        state = InferState(is_prefill=False, b_req_idx=b_req_idx, req_to_token=self.kv.table,
                           b_seq_len=(start + T).to(torch.int32),
                           out_token_idx=self.kv.table[b_req_idx.long()[:, None], at].long().flatten(),
                           positions=at.clamp(max=self.max_position).flatten(), max_len_in_batch=max_len,
                           graph_max_len=graph_len, q_len=T)  # fmt: skip
        out_rows = torch.arange(bs, device=start.device) * T + b["last"][:bs]
        return self.head.forward(b["input_ids"][: bs * T], b["hidden"][: bs * T], state, out_rows=out_rows)

    # ---- one speculative step ------------------------------------------------------------------------------

    def draft(self, slots: Sequence[int], last_tokens: Sequence[int],
              choose: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:  # fmt: skip
        """``N`` draft tokens per request, ``[batch, N]`` int64 on the device (not read back: the verify takes them
        from there, and the host reads them once with the verify's tokens); ``choose(k, logits [batch, vocab])``
        picks the ``k``-th (0-based) on rank 0. With tensor parallelism rank 0's picks are broadcast: the workers
        pass no ``choose``."""
        dev, table, n = self.runner.device, self.kv.table, self.step
        for slot, token in zip(slots, last_tokens):
            self.follow[slot].append(token)
        bases = [self.kv.seq_len(s) for s in slots]  # m: the KV length before this step
        # the verify step's N + 1 slots of every request, in one allocation and one table write
        self._token_idx = self.kv.extend_many(slots, [self.tokens] * len(slots))
        graph = self.graphs.pick(len(slots), max(bases) + self.tokens) if self.graphs else None
        self._completed = []
        first = self._first_draft_inputs(slots)
        if graph is not None:
            logits, hidden = self.graphs.run_first_draft(graph, first)
        else:
            logits, hidden = self.first_draft(first, len(slots), max(bases) + self.tokens)
        self._book_first_draft()
        drafts = [self._pick(choose, 0, logits)]
        b_req_idx = first["b_req_idx"]
        base = host_to_device(bases, torch.int64, dev)
        rows = torch.arange(len(slots), device=dev)
        for k in range(1, n):
            pos = base + (k - 1)
            live = {"input_ids": drafts[-1].to(dev), "hidden": hidden, "positions": pos.clamp(max=self.max_position),
                    "out_token_idx": table[b_req_idx.long(), pos].long(), "b_req_idx": b_req_idx,
                    "b_seq_len": (pos + 1).to(torch.int32)}  # fmt: skip
            if graph is not None:
                logits, hidden = self.graphs.run_draft(graph, live)
            else:
                state = InferState(is_prefill=False, b_req_idx=b_req_idx, req_to_token=table,
                                   b_seq_len=live["b_seq_len"], out_token_idx=live["out_token_idx"],
                                   positions=live["positions"], max_len_in_batch=max(bases) + k)  # fmt: skip
                logits, hidden = self.head.forward(live["input_ids"], hidden, state, out_rows=rows)
            drafts.append(self._pick(choose, k, logits))
        self._draft_dev, self._drafts = torch.stack(drafts, dim=1), None
        return self._draft_dev

    def _book_first_draft(self) -> None:
        """Book the slots the first draft's catch-up completed. A row whose prompt ended in the last prefill gets
        its prompt-end checkpoint now (``publish_at_draft``): its catch-up completed the prompt's last slot, and its
        current state, which the verify moves on, is still the one after the prompt."""
        for slot, tokens in self._completed:
            self._book(slot, tokens)
            if slot in self.publish_at_draft:
                self.publish_at_draft.discard(slot)
                self.runner.publish_row(slot, True, state_at_computed=True)
        self._completed = []

    def _pick(self, choose, k: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft ``k`` of each request ``[batch]`` (int64): ``choose``'s on rank 0, which every other rank receives,
        so all ranks feed the head, verify and accept the same tokens (only rank 0 samples, as in plain decode)."""
        if choose is None and self.tp == 1:
            raise ValueError("MTP draft: expected a choose function on rank 0, got None")
        if choose is None:
            tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        else:
            tokens = choose(k, logits).to(torch.int64).contiguous()
        return parallel.broadcast_(tokens) if self.tp > 1 else tokens

    def verify(self, slots: Sequence[int], last_tokens: Sequence[int], drafts=None) -> torch.Tensor:
        """The main model over ``[t_m, d_1 .. d_N]`` of each request: float32 logits ``[batch, T, vocab]``.
        ``drafts``: this step's ``draft`` output (None: the same), or host lists of other tokens (tests)."""
        dev, T = self.runner.device, self.tokens
        bases = [self.kv.seq_len(s) - T for s in slots]
        i32 = dict(dtype=torch.int32, device=dev)
        positions = host_to_device(np.minimum(np.arange(T) + np.asarray(bases, dtype=np.int64)[:, None],
                                              self.max_position).ravel(), torch.int64, dev)  # fmt: skip
        if drafts is None or isinstance(drafts, torch.Tensor):
            drafts = self._draft_dev if drafts is None else drafts
            ids = torch.cat([host_to_device(last_tokens, torch.int64, dev)[:, None], drafts], dim=1).flatten()
        else:
            self._drafts = [list(d) for d in drafts]
            ids = host_to_device([[t, *d] for t, d in zip(last_tokens, self._drafts)], torch.int64, dev).flatten()
        live = {"input_ids": ids, "positions": positions,
                "out_token_idx": tensor_to_device(self._token_idx, dev), "b_req_idx": host_to_device(slots, **i32),
                "b_seq_len": host_to_device([m + T for m in bases], **i32), "state_idx": self.state_idx(slots, dev),
                "state_dst_idx": host_to_device([[s * T + t for t in range(T)] for s in slots], **i32)}  # fmt: skip
        graph = self.graphs.pick(len(slots), max(bases) + T) if self.graphs else None
        if graph is not None:
            logits, hidden = self.graphs.run_verify(graph, live)
            hidden = hidden.clone()  # the graph's output: the next replay overwrites it, the next catch-up reads it
        else:
            state = InferState(is_prefill=False, b_req_idx=live["b_req_idx"], req_to_token=self.kv.table,
                               b_seq_len=live["b_seq_len"], out_token_idx=live["out_token_idx"],
                               positions=live["positions"], max_len_in_batch=max(bases) + T, q_len=T,
                               state_idx=live["state_idx"], state_dst_idx=live["state_dst_idx"])  # fmt: skip
            logits, hidden = self.model.forward(ids, state, keep_hidden=True)
        self._hidden = hidden.view(len(slots), T, -1)
        return logits.view(len(slots), T, -1)

    def accept(self, slots: Sequence[int], accepted: Sequence[int]) -> None:
        """``accepted[i]`` drafts of request ``i`` were accepted: its KV, state slot and head catch-up follow."""
        if self._drafts is None:  # read once the engine has read the verify's tokens: the GPU is idle by then
            self._drafts = self._draft_dev.tolist()
        for slot, a in zip(slots, accepted):
            if not 0 <= a <= self.step:
                raise ValueError(f"MTP accept: accepted drafts expected in [0, {self.step}], got {a} (slot {slot})")
        self.kv.truncate_many(slots, [self.step - a for a in accepted])  # one free of the pool for the batch
        for i, (slot, a) in enumerate(zip(slots, accepted)):
            self.current[slot] = a
            self.mtp_next[slot] = self.kv.seq_len(slot) - a - 1  # m
            self.pending[slot] = [self._hidden[i]]  # the whole window: the next catch-up reads its a + 1 rows
            self.follow[slot] = [self.follow[slot][-1], *self._drafts[i][:a]]
        self._hidden = self._draft_dev = self._drafts = None


def draft_dir(args, model_dir: str) -> Optional[str]:
    """The folder of the MTP head when it is not ``model_dir`` (``--mtp_draft_model_dir``), else None."""
    draft = args.mtp_draft_model_dir
    if draft is None or os.path.realpath(draft) == os.path.realpath(model_dir):
        return None
    return draft


def check_mtp(args, family, config, model_dir: str) -> None:
    """Start-up checks of ``--mtp_mode`` and ``--mtp_draft_model_dir`` against the model (``ValueError``, one line,
    naming the flag)."""
    mode = args.mtp_mode
    if mode is None:
        return
    support = getattr(family, "mtp_support", None)
    if support is None:
        raise ValueError(f"--mtp_mode {mode}: {family.name} models have no MTP head; MTP serves Qwen3.5")
    draft = draft_dir(args, model_dir)
    if draft is not None:
        if not os.path.isdir(draft):
            raise ValueError(f"--mtp_draft_model_dir {draft}: expected a folder holding the MTP head (mtp.* weights "
                             "and a config.json), found no such folder")  # fmt: skip
        try:  # a folder error (no safetensors, a bad index) names the head's folder, not the flag that gave it
            why = family.mtp_draft_support(Path(draft), config)
            if why is not None:
                raise ValueError(why)
            why = support(Path(draft), config, mode)  # the mode, and mtp.* weights in the head's folder
        except ValueError as e:
            raise ValueError(f"--mtp_draft_model_dir {draft}: {e}") from None
    else:
        why = support(Path(model_dir), config, mode)
    if why is not None:
        raise ValueError(f"--mtp_mode {mode} can't run on {draft or model_dir}: {why}")
