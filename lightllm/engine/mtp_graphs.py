"""Decode CUDA graphs of MTP's steps: the verify (``batch x (N + 1)`` tokens), the first draft (the head's catch-up
over a window of ``N + 1`` rows per request, ``MTPRunner.first_draft``) and the draft steps after it (one head token
per request), one graph of each per KV length bucket and batch size, as the plain decode graphs
(``--graph_len_buckets``); ``--graph_max_batch_size`` counts requests.

Each graph set is captured as the plain decode graphs are (``common/cuda_graph.DecodeGraphs``): largest batch
first, each right after one eager forward inside the ``DECODE_ATTENTION`` warm-up scope, where the MTP diverse
attention (or FA3's ``num_splits``) and the verify gated delta rule tune. The graphs read static device buffers
allocated once at the largest batch; a step copies its live rows into the leading rows and resets the rows past it
to the padding request (its slot holds ``N + 1`` KV tokens and ``N + 1`` state slots of its own: harmless to
compute), so a graph captured for more requests serves a smaller batch. Launches are sized for the graph's bucket; a
step picks the smallest bucket holding its longest request after the verify, and one draft and verify step use the
same bucket and size. Past ``--graph_max_len_in_batch`` a step runs eagerly.
"""

import logging
from typing import Dict, Optional, Sequence, Tuple

import torch

from lightllm.common.cuda_graph import DecodeGraphs
from lightllm.layers.infer_state import InferState

logger = logging.getLogger(__name__)

GraphKey = Tuple[int, int]  # (KV length bucket, batch size)


class MTPGraphs:
    def __init__(self, mtp, batch_sizes: Sequence[int], graph_lens: Sequence[int], api=None):
        runner = mtp.runner
        self.mtp, self.kv, self.model, self.head = mtp, runner.kv, runner.model, mtp.head
        self.rows, T, dev = max(batch_sizes), mtp.tokens, runner.device
        pad = runner.pad_slot
        pad_tokens = torch.cat([torch.tensor([runner.pad_token]), self.kv.extend(pad, T - 1)]).to(dev)
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        g = self.rows
        # the padding request's values, every row: what rows past a live batch are reset to
        self._verify_pad = {
            "input_ids": torch.zeros(g * T, **i64),
            "positions": torch.arange(T, **i64).repeat(g),
            "out_token_idx": pad_tokens.repeat(g),
            "b_req_idx": torch.full((g,), pad, **i32),
            "b_seq_len": torch.full((g,), T, **i32),
            "state_idx": torch.full((g,), pad * T, **i32),
            "state_dst_idx": (pad * T + torch.arange(T, **i32)).repeat(g, 1),
        }
        self._draft_pad = {
            "input_ids": torch.zeros(g, **i64),
            "hidden": torch.zeros(g, runner.config.hidden_size, dtype=self.model.dtype, device=dev),
            "positions": torch.zeros(g, **i64),
            "out_token_idx": pad_tokens[:1].repeat(g),
            "b_req_idx": torch.full((g,), pad, **i32),
            "b_seq_len": torch.ones(g, **i32),
        }
        # the first draft's window: the padding request's T rows at positions 0 .. T - 1, its last one the output
        self._first_pad = {
            "input_ids": torch.zeros(g * T, **i64),
            "hidden": torch.zeros(g * T, runner.config.hidden_size, dtype=self.model.dtype, device=dev),
            "start": torch.zeros(g, **i64),
            "last": torch.full((g,), T - 1, **i64),
            "b_req_idx": torch.full((g,), pad, **i32),
        }
        self.verify_in = {name: t.clone() for name, t in self._verify_pad.items()}
        self.draft_in = {name: t.clone() for name, t in self._draft_pad.items()}
        self.first_in = {name: t.clone() for name, t in self._first_pad.items()}
        self._rows = torch.arange(g, device=dev)
        self.verify = DecodeGraphs(batch_sizes, graph_lens, api).capture_all(self._verify_forward)
        self.first = DecodeGraphs(batch_sizes, graph_lens, api).capture_all(self._first_draft_forward)
        self.draft = None
        if mtp.step > 1:
            self.draft = DecodeGraphs(batch_sizes, graph_lens, api).capture_all(self._draft_forward)
        # per bucket, all three together: what the runner reports
        sets = [s for s in (self.verify, self.first, self.draft) if s]
        self.costs = {n: tuple(map(sum, zip(*(s.costs[n] for s in sets)))) for n in self.verify.graph_lens}
        logger.info("MTP decode graphs: verify, first draft%s at batch sizes %s, KV length buckets %s (%.1f MiB)",
                    " and draft" if self.draft else "", self.verify.batch_sizes, self.verify.graph_lens,
                    sum(b for _, _, b in self.costs.values()) / 2**20)  # fmt: skip

    # ---- what the graphs capture ----------------------------------------------------------------------------

    def _verify_forward(self, bs: int, graph_len: int):
        b, T = self.verify_in, self.mtp.tokens
        state = InferState(is_prefill=False, b_req_idx=b["b_req_idx"][:bs], req_to_token=self.kv.table,
                           b_seq_len=b["b_seq_len"][:bs], out_token_idx=b["out_token_idx"][: bs * T],
                           positions=b["positions"][: bs * T], max_len_in_batch=T, graph_max_len=graph_len,
                           q_len=T, state_idx=b["state_idx"][:bs], state_dst_idx=b["state_dst_idx"][:bs])  # fmt: skip
        return self.model.forward(b["input_ids"][: bs * T], state, keep_hidden=True)

    def _first_draft_forward(self, bs: int, graph_len: int):
        return self.mtp.first_draft(self.first_in, bs, self.mtp.tokens, graph_len)

    def _draft_forward(self, bs: int, graph_len: int):
        b = self.draft_in
        state = InferState(is_prefill=False, b_req_idx=b["b_req_idx"][:bs], req_to_token=self.kv.table,
                           b_seq_len=b["b_seq_len"][:bs], out_token_idx=b["out_token_idx"][:bs],
                           positions=b["positions"][:bs], max_len_in_batch=1, graph_max_len=graph_len)  # fmt: skip
        return self.head.forward(b["input_ids"][:bs], b["hidden"][:bs], state, out_rows=self._rows[:bs])

    # ---- replay ---------------------------------------------------------------------------------------------

    def pick(self, batch: int, max_len: int) -> Optional[GraphKey]:
        """The key of the verify/draft graphs serving ``batch`` requests whose longest holds ``max_len`` KV tokens
        after the verify, or None (eager)."""
        return self.verify.pick(batch, max_len)

    def run_verify(self, key: GraphKey, live: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Replay the verify graph ``key`` over ``live`` (each column's live rows); the graph's own outputs, cut to
        the live rows (read before the next replay)."""
        bs = _stage(self.verify_in, self._verify_pad, live, key[1], self.mtp.tokens)
        logits, hidden = self.verify.replay(key)
        T = self.mtp.tokens
        return logits[: bs * T], hidden[: bs * T]

    def run_first_draft(self, key: GraphKey, live: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        bs = _stage(self.first_in, self._first_pad, live, key[1], self.mtp.tokens)
        logits, hidden = self.first.replay(key)
        return logits[:bs], hidden[:bs]

    def run_draft(self, key: GraphKey, live: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        bs = _stage(self.draft_in, self._draft_pad, live, key[1], 1)
        logits, hidden = self.draft.replay(key)
        return logits[:bs], hidden[:bs]


def _stage(buffers, pad, live, gbs: int, tokens: int) -> int:
    """Copy ``live``'s rows into the leading rows of ``buffers`` and the padding values into the rest up to
    ``gbs`` requests (``tokens`` rows each for the per-token columns); the live batch size."""
    bs = live["b_req_idx"].shape[0]
    for name, values in live.items():
        per_request = buffers[name].shape[0] == buffers["b_req_idx"].shape[0]
        n, end = values.shape[0], gbs if per_request else gbs * tokens
        buffers[name][:n].copy_(values, non_blocking=True)
        buffers[name][n:end].copy_(pad[name][n:end], non_blocking=True)
    return bs
